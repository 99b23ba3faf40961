package rabbit

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The cycle rule on x-death as the server leaves it, the new record first
// (the cases that a real server can run are in the DeadLetterCycleRule
// behaviour of package broker).
func TestDeadLetterCycle(t *testing.T) {
	rec := func(queue, reason string) amqp.Table {
		return amqp.Table{"queue": queue, "reason": reason, "count": int64(1)}
	}
	tests := []struct {
		name   string
		deaths any
		cycle  bool
	}{
		{"none", nil, false},
		{"not an array", "x", false},
		{"only other queues", []any{rec("q.delay.1s", "expired"), rec("other", "maxlen")}, false},
		{"the target, automatic", []any{rec("q.delay.1s", "expired"), rec("q", "delivery_limit")}, true},
		{"the target itself, at once", []any{rec("q", "expired")}, true},
		{"the target, rejected", []any{rec("q.delay.1s", "expired"), rec("q", "rejected")}, false},
		{"a reject on the way", []any{rec("q.delay.1s", "expired"), rec("other", "rejected"), rec("q", "expired")}, false},
		{"a reject before", []any{rec("q.delay.1s", "expired"), rec("q", "expired"), rec("other", "rejected")}, true},
		{"a string on the way", []any{rec("q.delay.1s", "expired"), "legacy", rec("q", "expired")}, false},
	}
	for _, tt := range tests {
		if got := DeadLetterCycle(tt.deaths, "q"); got != tt.cycle {
			t.Errorf("DeadLetterCycle(%s) = %v; want %v", tt.name, got, tt.cycle)
		}
	}
}
