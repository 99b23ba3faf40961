package store_test

import (
	"testing"

	"go.uber.org/goleak"
)

// The stores start no goroutine; the conformance kit's end with each case.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
