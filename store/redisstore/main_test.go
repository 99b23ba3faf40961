package redisstore_test

import (
	"testing"

	"go.uber.org/goleak"
)

// The store starts no goroutine, and the batcher's exit once nothing is
// queued; the conformance kit's end with each case.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
