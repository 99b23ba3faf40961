package middleware_test

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// ErrAbandoned promises that a message that kills every consumer that
// handles it is dead-lettered after MaxAttempts crashes. Each life of the
// consumer below finds the claim of the life before abandoned, and dies in
// the handler (runtime.Goexit ends the goroutine; Dedup's deferred release
// runs, so each life first plants the dead claim that a SIGKILL leaves,
// and lets its lease end). The redelivery after a crash carries the
// same headers, so with Retry counting by the header alone (a nil store,
// which RetryOptions allows) the count is 1 at every life and the crash
// loop never ends.
func TestReviewCrashLoopBoundedWithoutRetryStore(t *testing.T) {
	for _, tt := range []struct {
		name       string
		retryStore bool
	}{
		{"Retry with the store", true},
		{"Retry with a nil store", false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx := context.Background()
				s := store.NewMemory()
				const lease = time.Minute
				ran, lives := 0, 6
				var final error
				for life := 1; life <= lives && final == nil; life++ {
					// The previous life died holding the claim; its lease ended.
					if st, err := s.Claim(ctx, "m1", "dead-process-token", lease); err != nil || st != store.Claimed {
						t.Fatalf("life %d: planting the dead claim: %v, %v", life, st, err)
					}
					time.Sleep(lease + time.Second)
					var rs store.Store
					if tt.retryStore {
						rs = s
					}
					h := middleware.Retry(rs, middleware.RetryOptions{MaxAttempts: 3, Backoff: linear})(
						middleware.Dedup(s, middleware.DedupOptions{Lease: lease})(rabbitmw.HandlerFunc(
							func(context.Context, *amqp.Delivery) error {
								ran++
								runtime.Goexit() // the consumer dies here
								return nil
							})))
					d, _ := deliver("m1", "")
					d.Redelivered = true
					result := make(chan error, 1)
					exited := make(chan struct{})
					go func() {
						defer close(exited)
						result <- h.Handle(ctx, d)
					}()
					<-exited
					select {
					case final = <-result:
					default: // died
					}
				}
				if final == nil {
					t.Fatalf("the handler ran (and killed its consumer) %d times in %d lives, never dead-lettered; want a dead-letter after MaxAttempts 3", ran, lives)
				}
				if dec := rabbitmw.Decide(final); dec.Outcome != rabbitmw.DeadLetter || !errors.Is(final, middleware.ErrAbandoned) {
					t.Errorf("final result %v: %v; want dead-lettered with ErrAbandoned", final, dec.Outcome)
				}
			})
		})
	}
}

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
