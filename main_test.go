package rabbitmw_test

import (
	"testing"

	"go.uber.org/goleak"
)

// A Settler's goroutines end at Close; nothing else here starts one.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
