//go:build reliability

// Package reliability_test is the fault-injection suite of issue 6: tests
// that start real servers, break them, and check what each message ended
// as. It is kept out of the quick run by the reliability build tag:
//
//	go test -race -count=1 -tags reliability ./reliability/...
//
// Servers a test starts belong to it: they are stopped and waited for when
// the test ends, and TestMain checks that no goroutine outlives the tests.
package reliability_test

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
