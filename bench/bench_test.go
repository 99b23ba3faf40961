package main

import (
	"context"
	"encoding/json"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestMessageIDs(t *testing.T) {
	tests := []struct {
		n          int
		dup        float64
		gap        int
		wantUnique int
	}{
		{n: 10, dup: 0, gap: 4, wantUnique: 10},
		{n: 20000, dup: 0.2, gap: 1000, wantUnique: 16000},
		{n: 100, dup: 0.5, gap: 1000, wantUnique: 50}, // gap shrunk to n/2
		{n: 1, dup: 0.5, gap: 1000, wantUnique: 1},
	}
	for _, tc := range tests {
		ids, unique := messageIDs(tc.n, tc.dup, tc.gap)
		if len(ids) != tc.n || unique != tc.wantUnique {
			t.Errorf("messageIDs(%d, %v, %d) = %d ids, %d unique; want %d, %d", tc.n, tc.dup, tc.gap, len(ids), unique, tc.n, tc.wantUnique)
		}
		first := map[string]int{}
		for i, id := range ids {
			if j, seen := first[id]; seen {
				if gap := min(tc.gap, tc.n/2); i-j < gap {
					t.Errorf("messageIDs(%d, %v, %d): %s at %d and %d, less than %d apart", tc.n, tc.dup, tc.gap, id, j, i, gap)
				}
				continue
			}
			first[id] = i
		}
		if len(first) != unique {
			t.Errorf("messageIDs(%d, %v, %d): %d distinct ids; want %d", tc.n, tc.dup, tc.gap, len(first), unique)
		}
	}
}

func TestPercentile(t *testing.T) {
	sorted := []int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{{50, 5}, {99, 10}, {100, 10}, {10, 1}, {1, 1}} {
		if got := percentile(sorted, tc.p); got != tc.want {
			t.Errorf("percentile(1..10, %v) = %v; want %v", tc.p, got, tc.want)
		}
	}
	if got := percentile(nil, 50); got != 0 {
		t.Errorf("percentile(nil, 50) = %v; want 0", got)
	}
}

func TestThousands(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		want string
	}{{0, "0"}, {999.4, "999"}, {1000, "1,000"}, {1234567.8, "1,234,568"}} {
		if got := thousands(tc.v); got != tc.want {
			t.Errorf("thousands(%v) = %q; want %q", tc.v, got, tc.want)
		}
	}
}

// The raw and hand-written contenders run with the settings that the
// broker reports in its log: if that record changes, this fails, rather
// than the benchmark comparing at different settings.
func TestBrokerSettings(t *testing.T) {
	ctx := context.Background()
	p, w, err := brokerSettings(ctx, 0, 0)
	if err != nil || p < 1 || w < 1 {
		t.Fatalf("brokerSettings(0, 0) = %d, %d, %v; want the defaults", p, w, err)
	}
	p, w, err = brokerSettings(ctx, 7, 3)
	if err != nil || p != 7 || w != 3 {
		t.Fatalf("brokerSettings(7, 3) = %d, %d, %v; want 7, 3, nil", p, w, err)
	}
}

func TestParseFlags(t *testing.T) {
	cfg, err := parseFlags([]string{"-n", "100", "-only", "plain, rabbitmw-redis", "-sweep-workers", "2,4"})
	require.NoError(t, err)
	if cfg.n != 100 || len(cfg.only) != 2 || cfg.only[1] != redisName || len(cfg.sweepWorkers) != 2 {
		t.Errorf("parseFlags = %+v; want n 100, only [plain rabbitmw-redis], sweep workers [2 4]", cfg)
	}
	for _, args := range [][]string{{"-only", "nope"}, {"-dup", "1"}, {"-n", "0"}, {"-sweep-prefetch", "0"}, {"extra"}} {
		if _, err := parseFlags(args); err == nil {
			t.Errorf("parseFlags(%q) = nil error; want one", args)
		}
	}
}

// The verdicts that bench prints, and BENCHMARKS.md quotes: each target
// met, missed, and not measured.
func TestTargets(t *testing.T) {
	cpu := func(self, redis, rabbit, pg float64) cpuUsage {
		return cpuUsage{Self: self, Redis: redis, Rabbit: rabbit, Postgres: pg}
	}
	sum := func(name string, median float64, c cpuUsage) *summary {
		return &summary{figures: figures{Contender: name, Prefetch: 32, Workers: 16, CPU: c}, Median: median}
	}
	withProblem := func(p string) summaries {
		s := *sum(redisName, 0, cpuUsage{})
		s.Problems = []string{p}
		return summaries{*sum(plainName, 0, cpuUsage{}), s}
	}
	defaults := settings{Defaults: true, Rounds: 5, Prefetch: 32, Workers: 16}
	fewRounds := settings{Defaults: true, Rounds: 3, Prefetch: 32, Workers: 16}
	plain := sum(plainName, 1000, cpu(50, 0, 50, -1))
	hand := sum(handPgName, 1000, cpu(100, 0, 100, 200))
	wm := sum(watermillName, 800, cpu(100, 0, 100, -1))
	stack := func(ns float64, allocs int64) *stackCase {
		return &stackCase{Name: stackWaitsNew, Ns: ns, Allocs: allocs}
	}

	for _, tc := range []struct {
		name string
		got  target
		want string
	}{
		{"rate at the bound", rateTarget("", sum(redisName, 850, cpuUsage{}), plain, redisRateBound, defaults), met},
		{"rate under the bound", rateTarget("", sum(redisName, 849, cpuUsage{}), plain, redisRateBound, defaults), missed},
		{"rate in too few rounds", rateTarget("", sum(redisName, 900, cpuUsage{}), plain, redisRateBound, fewRounds), notMeasured},
		{"rate without the baseline", rateTarget("", sum(redisName, 900, cpuUsage{}), nil, redisRateBound, defaults), notMeasured},
		{"PostgreSQL rate at the bound", rateTarget("", sum(postgresName, 1200, cpuUsage{}), hand, pgRateBound, defaults), met},

		{"CPU at the bound", cpuTarget("", sum(redisName, 0, cpu(50, 25, 25, -1)), plain, redisCPUBound, defaults), met},
		{"CPU over the bound", cpuTarget("", sum(redisName, 0, cpu(50, 26, 25, -1)), plain, redisCPUBound, defaults), missed},
		{"CPU unknown", cpuTarget("", sum(redisName, 0, cpu(1, -1, 1, -1)), plain, redisCPUBound, defaults), notMeasured},
		{"PostgreSQL's CPU counts", cpuTarget("", sum(postgresName, 0, cpu(90, 0, 90, 181)), hand, pgCPUBound, defaults), missed},
		{"PostgreSQL CPU within", cpuTarget("", sum(postgresName, 0, cpu(90, 0, 90, 180)), hand, pgCPUBound, defaults), met},

		// The group commit line informs, whatever its figures, and is not
		// measured without both contenders.
		{"group commit under the bounds", groupCommitLine(sum(postgresGroupName, 1000, cpu(100, 0, 100, 200)), hand, defaults), informational},
		{"group commit without the hand-written inbox", groupCommitLine(sum(postgresGroupName, 1300, cpu(50, 0, 50, 50)), nil, defaults), notMeasured},

		{"ahead of watermill", watermillTarget(sum(redisName, 801, cpu(50, 50, 99, -1)), wm), met},
		{"faster than watermill, but dearer", watermillTarget(sum(redisName, 801, cpu(50, 50, 100, -1)), wm), missed},
		{"level with watermill", watermillTarget(sum(redisName, 800, cpu(1, 1, 1, -1)), wm), missed},
		{"watermill did not run", watermillTarget(sum(redisName, 1000, cpuUsage{}), nil), notMeasured},

		{"stack within", stackTarget("", stack(2000, 6), stackNsBound, stackAllocBound), met},
		{"stack too slow", stackTarget("", stack(2001, 6), stackNsBound, stackAllocBound), missed},
		{"stack allocates too much", stackTarget("", stack(500, 7), stackNsBound, stackAllocBound), missed},
		{"stack not measured", stackTarget("", nil, stackNsBound, stackAllocBound), notMeasured},

		{"exactly once", exactlyOnceTarget(summaries{*plain, *hand}), met},
		{"a message left behind", exactlyOnceTarget(withProblem("round 1: 1 messages left in the queue, 0 in its dead-letter queue")), missed},
	} {
		if tc.got.Status != tc.want {
			t.Errorf("%s: %s (%s); want %s", tc.name, tc.got.Status, tc.got.Detail, tc.want)
		}
	}
}

// The targets print headed "targets:", one line each, with no issue
// number.
func TestPrintTargets(t *testing.T) {
	var out strings.Builder
	printTargets(&out, (&compareResult{}).targets())
	s := out.String()
	if !strings.HasPrefix(s, "targets:\n") || strings.Contains(s, "issue") || strings.Count(s, "\n") != 9 {
		t.Errorf("printed %q; want it headed \"targets:\", seven targets and an informational line, no issue number", s)
	}
}

// The outputs, a run and a summary keep their JSON keys (a run and a
// summary share theirs through figures).
func TestResultJSON(t *testing.T) {
	for _, tc := range []struct {
		v    any
		want []string
	}{
		{&compareResult{}, []string{"Runs", "loads", "machine", "rabbitmq_idle_cpu_per_s", "run_id", "settings", "summary", "targets"}},
		{&sweepResult{}, []string{"cells", "defaults", "grid_prefetch", "grid_workers", "machine", "rabbitmq_idle_cpu_per_s", "run_id", "settings"}},
		{&runResult{}, []string{"contender", "cpu", "deliveries", "effects", "left_in_dlq", "left_in_queue", "load", "messages", "msgs_per_sec", "prefetch", "rabbitmq_idle_cpu_per_s", "redis_commands", "repeated_effects", "round", "seconds", "unique_effects", "unique_ids", "workers"}},
		{&summary{}, []string{"contender", "cpu", "deliveries", "effects", "load_max", "load_min", "msgs_per_sec_max", "msgs_per_sec_median", "msgs_per_sec_min", "prefetch", "ratio_to_plain", "redis_commands_per_msg", "unique_effects", "workers"}},
	} {
		b, err := json.Marshal(tc.v)
		require.NoError(t, err)
		var m map[string]any
		require.NoError(t, json.Unmarshal(b, &m))
		if got := slices.Sorted(maps.Keys(m)); !slices.Equal(got, tc.want) {
			t.Errorf("%T keys = %v; want %v", tc.v, got, tc.want)
		}
	}
}

// The counter closes done once, when the acks reach the target, whatever
// the sizes of the acks that cross it; effects are counted by message.
func TestCounter(t *testing.T) {
	c := newCounter(5)
	for _, id := range []string{"m0", "m1", "m1", "m4", "bad", "m9"} {
		c.effect(id)
	}
	total, unique, repeated := c.effectCounts()
	if total != 4 || unique != 3 || repeated != 1 {
		t.Errorf("effectCounts() = %d, %d, %d; want 4, 3, 1", total, unique, repeated)
	}
	c.ack(3)
	select {
	case <-c.done:
		t.Fatal("done after 3 of 5 acks")
	default:
	}
	c.ack(4) // past the target: closes done, once
	c.ack(1)
	select {
	case <-c.done:
	default:
		t.Fatal("not done after 8 of 5 acks")
	}
	if c.elapsed() < 0 {
		t.Errorf("elapsed() = %v; want ≥ 0", c.elapsed())
	}
}

// Each contender of a set of summaries is related to raw's median.
func TestRelateToRaw(t *testing.T) {
	ss := summaries{{figures: figures{Contender: redisName}, Median: 500}, {figures: figures{Contender: plainName}, Median: 1000}}
	ss.relateToRaw()
	if ss.find(redisName).RatioToRaw != 0.5 || ss.find(plainName).RatioToRaw != 1 {
		t.Errorf("ratios %v; want 0.5 and 1", ss)
	}
	ss = summaries{{figures: figures{Contender: redisName}, Median: 500}}
	ss.relateToRaw()
	if ss.find(plainName) != nil || ss[0].RatioToRaw != 0 {
		t.Errorf("without plain: %v; want ratio 0", ss)
	}
}

func TestInRoundOrder(t *testing.T) {
	items := []string{"a", "b", "c"}
	if got := inRoundOrder(items, 1); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Errorf("round 1: %v; want a b c", got)
	}
	if got := inRoundOrder(items, 2); !slices.Equal(got, []string{"c", "b", "a"}) {
		t.Errorf("round 2: %v; want c b a", got)
	}
	if !slices.Equal(items, []string{"a", "b", "c"}) {
		t.Errorf("inRoundOrder changed its argument: %v", items)
	}
}

// The scale plot has a panel per contender and a line per process, a
// point per case; the table a row per case and contender.
func TestScaleChart(t *testing.T) {
	r := &scaleResult{}
	for i, sc := range scaleCases {
		cell := scaleCell{Case: sc}
		for j, name := range []string{plainName, redisName} {
			cell.Summary = append(cell.Summary, summary{figures: figures{Contender: name,
				CPU: cpuUsage{Self: float64(10 * (i + j)), Redis: 1, Rabbit: 20, Postgres: -1}}, Median: 1000})
		}
		r.Cases = append(r.Cases, cell)
	}
	c := r.chart()
	if len(c.Panels) != 2 || len(c.X) != len(scaleCases) || len(c.Series) != 4 {
		t.Fatalf("chart: %d panels, %d cases, %d series; want 2, %d, 4", len(c.Panels), len(c.X), len(c.Series), len(scaleCases))
	}
	if got := c.Panels[1].Y[3][2]; got != 10*(2+1)+1+20 {
		t.Errorf("rabbitmw-redis's total at case 3 = %v; want %v", got, 10*(2+1)+1+20)
	}
	var md strings.Builder
	r.markdown(&md)
	if n := strings.Count(md.String(), "\n| "); n != 2+2*len(scaleCases) {
		t.Errorf("markdown has %d table rows; want %d:\n%s", n, 2+2*len(scaleCases), md.String())
	}
	var svg strings.Builder
	if err := c.writeSVG(&svg); err != nil || !strings.Contains(svg.String(), "</svg>") {
		t.Errorf("writeSVG: %v", err)
	}
}

// RabbitMQ's CPU is read from the process that listens on the AMQP port:
// here, this test's own listener.
func TestListenerPID(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port
	if got := listenerPID(port); got != os.Getpid() {
		t.Errorf("listenerPID(%d) = %d; want this process, %d", port, got, os.Getpid())
	}
	l.Close()
	if got := listenerPID(port); got != 0 {
		t.Errorf("listenerPID(%d) after the listener closed = %d; want 0", port, got)
	}
}
