package middleware_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// Two Retry layers (a service-wide one around a per-handler one, say):
// the inner dead-letters an abandoned message at its limit "without
// running the handler again", but its result still wraps ErrAbandoned, so
// the outer counts a second failure for the same attempt and, below its
// own limit, runs the handler again: the crash the inner layer stopped.
func TestReviewNestedRetryReRunsAnExhaustedAbandonedMessage(t *testing.T) {
	ctx := context.Background()
	s := store.NewMemory()
	s.Fail(ctx, "m1", time.Hour)
	s.Fail(ctx, "m1", time.Hour) // two crashes counted already
	calls := 0
	inner := middleware.Retry(s, middleware.RetryOptions{MaxAttempts: 3, Backoff: linear})
	outer := middleware.Retry(s, middleware.RetryOptions{MaxAttempts: 3, Backoff: linear})
	h := outer(inner(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		calls++
		if calls == 1 {
			return abandoned // the third crash
		}
		return errBoom // stands for the crash it would be
	})))
	d, _ := deliver("m1", "")
	err := h.Handle(ctx, d)
	if dec := rabbitmw.Decide(err); calls != 1 || dec.Outcome != rabbitmw.DeadLetter {
		t.Errorf("handler called %d times, %v (%v); want 1 call, dead-lettered at the inner limit", calls, dec.Outcome, err)
	}
}
