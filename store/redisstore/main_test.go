package redisstore_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Neither the store nor its batcher starts a goroutine (the callers send
// the pipelines); the conformance kit's end with each case.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
