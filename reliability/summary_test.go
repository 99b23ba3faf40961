//go:build reliability

package reliability_test

// The summary table: one row per scenario, printed when the suite ends
// (go test shows it with -v, or when a test fails) and written to the
// file named by RELIABILITY_REPORT, if set.

import (
	"cmp"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// A row is one scenario's figures. Once, Twice, Lost and DeadLettered
// count distinct messages (ids); Twice counts those applied two times or
// more.
type row struct {
	Scenario     string
	Messages     int // published, duplicates included
	Duplicates   int // published with an id used before
	Faults       string
	Once         int
	Twice        int
	Lost         int
	DeadLettered int
	Note         string
}

var summary struct {
	mu   sync.Mutex
	rows []row
}

// record logs r for t and adds it to the summary.
func record(t *testing.T, r row) {
	t.Helper()
	t.Logf("summary: %s | messages %d | duplicates published %d | faults %s | once %d | twice %d | lost %d | dead-lettered %d | %s",
		r.Scenario, r.Messages, r.Duplicates, r.Faults, r.Once, r.Twice, r.Lost, r.DeadLettered, r.Note)
	summary.mu.Lock()
	defer summary.mu.Unlock()
	summary.rows = append(summary.rows, r)
}

// summaryTable returns the rows as a Markdown table, or "" if there are none.
func summaryTable() string {
	summary.mu.Lock()
	defer summary.mu.Unlock()
	if len(summary.rows) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString("| scenario | messages | duplicates published | faults injected | effects once | effects twice | lost | dead-lettered | note |\n")
	b.WriteString("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |\n")
	rows := slices.Clone(summary.rows)
	slices.SortStableFunc(rows, func(a, b row) int { return cmp.Compare(scenarioNumber(a.Scenario), scenarioNumber(b.Scenario)) })
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %d | %d | %s | %d | %d | %d | %d | %s |\n",
			r.Scenario, r.Messages, r.Duplicates, r.Faults, r.Once, r.Twice, r.Lost, r.DeadLettered, r.Note)
	}
	return b.String()
}

// printSummary prints the table and writes it to RELIABILITY_REPORT.
func printSummary() {
	table := summaryTable()
	if table == "" {
		return
	}
	fmt.Printf("\nreliability summary:\n%s\n", table)
	if path := os.Getenv("RELIABILITY_REPORT"); path != "" {
		if err := os.WriteFile(path, []byte(table), 0o644); err != nil {
			fmt.Fprintf(os.Stderr, "writing RELIABILITY_REPORT: %v\n", err)
		}
	}
}

// scenarioNumber is the number a scenario's name starts with ("10 shutdown
// …" is 10), so that the table lists 9 before 10; 0 for a name without one.
func scenarioNumber(name string) int {
	digits, _, _ := strings.Cut(name, " ")
	n, _ := strconv.Atoi(digits)
	return n
}
