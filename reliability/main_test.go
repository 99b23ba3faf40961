//go:build reliability

// Package reliability_test is the fault-injection suite of issue 6: tests
// that start real servers and real consumer processes, break them, and
// check what each message ended as. It is kept out of the quick run by
// the reliability build tag:
//
//	go test -race -count=1 -tags reliability ./reliability/...
//
// Add -v to see the summary table. Servers and processes a test starts
// belong to it: they are stopped and waited for when the test ends, and
// TestMain checks that no goroutine outlives the tests.
package reliability_test

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "rabbitmw-reliability-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		printSummary()
		os.RemoveAll(dir)
		os.Exit(code)
	}))
}
