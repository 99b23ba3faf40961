package middleware_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// linear is a deterministic backoff for tests: n seconds after failure n.
func linear(n int) time.Duration { return time.Duration(n) * time.Second }

func TestRetry(t *testing.T) {
	ctx := context.Background()
	unreachable := errors.New("connection refused")
	tests := []struct {
		name     string
		result   error // the inner layers' result
		header   any   // x-rabbitmw-attempts, if not nil
		redeliv  bool  // Redelivered flag
		prior    int   // failures already counted in the store
		storeErr error // Fail's error
		cancel   bool  // ctx done before the result
		opts     middleware.RetryOptions

		wantOutcome  rabbitmw.Outcome
		wantDelay    time.Duration
		wantAttempts int
		wantIs       error
		wantCount    int // failures in the store afterwards
		wantSettle   string
	}{
		{
			name:        "success leaves no trace",
			wantOutcome: rabbitmw.Ack, wantSettle: "acked",
		},
		{
			name: "first failure is delayed by the backoff", result: errBoom,
			wantOutcome: rabbitmw.Delay, wantDelay: 1 * time.Second, wantAttempts: 1, wantIs: errBoom, wantCount: 1, wantSettle: "requeued",
		},
		{
			name: "third failure, counted across redeliveries", result: errBoom, prior: 2, redeliv: true,
			wantOutcome: rabbitmw.Delay, wantDelay: 3 * time.Second, wantAttempts: 3, wantIs: errBoom, wantCount: 3, wantSettle: "requeued",
		},
		{
			name: "fifth failure is dead-lettered with its last error, never acked", result: errBoom, prior: 4,
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 5, wantIs: middleware.ErrRetriesExhausted, wantCount: 0, wantSettle: "dead-lettered",
		},
		{
			name: "MaxAttempts 2", result: errBoom, prior: 1, opts: middleware.RetryOptions{MaxAttempts: 2},
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 2, wantIs: errBoom, wantSettle: "dead-lettered",
		},
		{
			name: "success after failures clears the count", prior: 3, redeliv: true,
			wantOutcome: rabbitmw.Ack, wantCount: 0, wantSettle: "acked",
		},
		{
			name: "success of a delayed copy clears the count", prior: 2, header: int32(2),
			wantOutcome: rabbitmw.Ack, wantCount: 0, wantSettle: "acked",
		},
		{
			name: "permanent error is dead-lettered at once, count cleared", result: rabbitmw.Permanent(errBoom), prior: 1,
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 2, wantIs: errBoom, wantCount: 0, wantSettle: "dead-lettered",
		},
		{
			name: "duplicate is not a failure", result: fmt.Errorf("x: %w", rabbitmw.ErrDuplicate), prior: 1,
			wantOutcome: rabbitmw.Duplicate, wantCount: 1, wantSettle: "acked",
		},
		{
			name: "busy is not a failure", result: rabbitmw.RetryAfter(middleware.ErrBusy, 5*time.Second), prior: 4,
			wantOutcome: rabbitmw.Delay, wantDelay: 5 * time.Second, wantIs: middleware.ErrBusy, wantCount: 4, wantSettle: "requeued",
		},
		{
			name: "store outage in Dedup is not a failure", result: rabbitmw.RetryAfter(fmt.Errorf("%w: x", middleware.ErrStoreUnavailable), 5*time.Second), prior: 4,
			wantOutcome: rabbitmw.Delay, wantDelay: 5 * time.Second, wantIs: middleware.ErrStoreUnavailable, wantCount: 4, wantSettle: "requeued",
		},
		{
			name: "lost lease is not a failure", result: rabbitmw.RetryAfter(middleware.ErrLeaseLost, 5*time.Second), prior: 4,
			wantOutcome: rabbitmw.Delay, wantDelay: 5 * time.Second, wantCount: 4, wantSettle: "requeued",
		},
		{
			name: "a rate limit beneath Retry is not a failure", result: rabbitmw.RetryAfter(rabbitmw.NotCounted(errLimited), 3*time.Second), prior: 4,
			wantOutcome: rabbitmw.Delay, wantDelay: 3 * time.Second, wantIs: errLimited, wantCount: 4, wantSettle: "requeued",
		},
		{
			name: "not counted, with no delay, is requeued", result: fmt.Errorf("open circuit: %w", rabbitmw.NotCounted(errLimited)), prior: 4,
			wantOutcome: rabbitmw.Requeue, wantIs: errLimited, wantCount: 4, wantSettle: "requeued",
		},
		{
			name: "shutdown is not a failure", result: context.Canceled, cancel: true, prior: 4,
			wantOutcome: rabbitmw.Requeue, wantCount: 4, wantSettle: "requeued",
		},
		{
			name: "a longer delay asked by the handler wins", result: rabbitmw.RetryAfter(errBoom, time.Minute),
			wantOutcome: rabbitmw.Delay, wantDelay: time.Minute, wantAttempts: 1, wantCount: 1, wantSettle: "requeued",
		},
		{
			name: "a panic is a failure", result: &rabbitmw.PanicError{Value: "x"}, prior: 4,
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 5, wantSettle: "dead-lettered",
		},
		{
			name: "the header is a floor when the store was wiped", result: errBoom, header: int64(4),
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 5, wantSettle: "dead-lettered",
		},
		{
			name: "a header of another type still counts", result: errBoom, header: "3",
			wantOutcome: rabbitmw.Delay, wantDelay: 4 * time.Second, wantAttempts: 4, wantCount: 1, wantSettle: "requeued",
		},
		{
			name: "a nonsense header counts as none", result: errBoom, header: []any{"x"},
			wantOutcome: rabbitmw.Delay, wantDelay: 1 * time.Second, wantAttempts: 1, wantCount: 1, wantSettle: "requeued",
		},
		{
			name: "store outage in Retry: counted by the header, reported", result: errBoom, header: int8(1), storeErr: unreachable,
			wantOutcome: rabbitmw.Delay, wantDelay: 2 * time.Second, wantAttempts: 2, wantIs: unreachable, wantSettle: "requeued",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := &faultyStore{Store: store.NewMemory()}
			for range tt.prior {
				s.Fail(ctx, "m1", time.Hour)
			}
			set(&s.fail, tt.storeErr)
			if tt.opts.Backoff == nil {
				tt.opts.Backoff = linear
			}
			ctx, cancel := context.WithCancel(ctx)
			defer cancel()
			h := middleware.Retry(s, tt.opts)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
				if tt.cancel {
					cancel()
				}
				return tt.result
			}))
			d, rec := deliverytest.New("m1", "")
			d.Redelivered = tt.redeliv
			if tt.header != nil {
				d.Headers = amqp.Table{rabbitmw.HeaderAttempts: tt.header}
			}
			err := h.Handle(ctx, d)

			dec := rabbitmw.Decide(err)
			if dec.Outcome != tt.wantOutcome || dec.Delay != tt.wantDelay || dec.Attempts != tt.wantAttempts {
				t.Errorf("Decide(%v) = %v after %v, attempts %d; want %v after %v, attempts %d",
					err, dec.Outcome, dec.Delay, dec.Attempts, tt.wantOutcome, tt.wantDelay, tt.wantAttempts)
			}
			if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Errorf("result %v does not wrap %v", err, tt.wantIs)
			}
			set(&s.fail, nil)
			if n, _ := s.Store.Fail(context.Background(), "m1", time.Hour); int(n)-1 != tt.wantCount {
				t.Errorf("failure count afterwards = %d; want %d", n-1, tt.wantCount)
			}
			if got := deliverytest.Settle(t, d, rec, err); got != tt.wantSettle {
				t.Errorf("settled %s; want %s", got, tt.wantSettle)
			}
		})
	}
}

var errLimited = errors.New("rate limited")

// RetryOptions.Permanent dead-letters, at once, the counted errors it
// reports; it is not asked about the results that Retry does not count.
func TestRetryPermanentClassifier(t *testing.T) {
	errBad := errors.New("malformed order")
	isBad := func(err error) bool { return errors.Is(err, errBad) }
	tests := []struct {
		name      string
		result    error
		permanent func(error) bool
		cancel    bool // ctx done before the result

		wantOutcome  rabbitmw.Outcome
		wantAttempts int
		wantCount    int // failures in the store afterwards
		wantAsked    bool
	}{
		{name: "a classified error is dead-lettered at once, counted", result: errBad, permanent: isBad,
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 2, wantCount: 0, wantAsked: true},
		{name: "wrapped, it is found", result: fmt.Errorf("order 42: %w", errBad), permanent: isBad,
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 2, wantCount: 0, wantAsked: true},
		{name: "over the handler's own delay", result: rabbitmw.RetryAfter(errBad, time.Minute), permanent: isBad,
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 2, wantCount: 0, wantAsked: true},
		{name: "another error is retried", result: errBoom, permanent: isBad,
			wantOutcome: rabbitmw.Delay, wantAttempts: 2, wantCount: 2, wantAsked: true},
		{name: "a panic is retried", result: &rabbitmw.PanicError{Value: "x"}, permanent: isBad,
			wantOutcome: rabbitmw.Delay, wantAttempts: 2, wantCount: 2, wantAsked: true},
		{name: "without a classifier, retried", result: errBad,
			wantOutcome: rabbitmw.Delay, wantAttempts: 2, wantCount: 2},
		{name: "not counted: not asked", result: rabbitmw.RetryAfter(rabbitmw.NotCounted(errBad), time.Second), permanent: isBad,
			wantOutcome: rabbitmw.Delay, wantCount: 1},
		{name: "a duplicate: not asked", result: rabbitmw.ErrDuplicate, permanent: isBad,
			wantOutcome: rabbitmw.Duplicate, wantCount: 1},
		{name: "success: not asked", permanent: isBad,
			wantOutcome: rabbitmw.Ack, wantCount: 0},
		{name: "shutting down: not asked", result: errBad, permanent: isBad, cancel: true,
			wantOutcome: rabbitmw.Requeue, wantCount: 1},
		{name: "already permanent: not asked", result: rabbitmw.Permanent(errBoom), permanent: isBad,
			wantOutcome: rabbitmw.DeadLetter, wantAttempts: 2, wantCount: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s := store.NewMemory()
			s.Fail(ctx, "m1", time.Hour)
			asked := false
			opts := middleware.RetryOptions{Backoff: linear}
			if tt.permanent != nil {
				opts.Permanent = func(err error) bool {
					asked = true
					return tt.permanent(err)
				}
			}
			h := middleware.Retry(s, opts)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
				if tt.cancel {
					cancel()
				}
				return tt.result
			}))
			d, _ := deliverytest.New("m1", "")
			d.Redelivered = true
			err := h.Handle(ctx, d)
			dec := rabbitmw.Decide(err)
			if dec.Outcome != tt.wantOutcome || dec.Attempts != tt.wantAttempts {
				t.Errorf("Decide(%v) = %v, attempts %d; want %v, attempts %d", err, dec.Outcome, dec.Attempts, tt.wantOutcome, tt.wantAttempts)
			}
			if dec.Outcome == rabbitmw.DeadLetter && errors.Is(err, middleware.ErrRetriesExhausted) {
				t.Errorf("result %v wraps ErrRetriesExhausted; want the error alone", err)
			}
			if tt.result != nil && !errors.Is(err, tt.result) {
				t.Errorf("result %v does not wrap %v", err, tt.result)
			}
			if asked != tt.wantAsked {
				t.Errorf("Permanent called: %v; want %v", asked, tt.wantAsked)
			}
			if n, _ := s.Fail(context.Background(), "m1", time.Hour); int(n)-1 != tt.wantCount {
				t.Errorf("failure count afterwards = %d; want %d", n-1, tt.wantCount)
			}
		})
	}
}

// A first delivery that succeeds costs Retry no store call at all.
func TestRetryHappyPathIsFree(t *testing.T) {
	s := &faultyStore{Store: store.NewMemory()}
	h := middleware.Retry(s, middleware.RetryOptions{})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { return nil }))
	d, _ := deliverytest.New("m1", "")
	require.NoError(t, h.Handle(context.Background(), d))
	for _, op := range []string{"fail", "reset"} {
		if n := s.Calls(op); n != 0 {
			t.Errorf("%s called %d times on the happy path; want 0", op, n)
		}
	}
}

// Without a store, the header alone counts: the broker's delayed copies
// carry it forward.
func TestRetryWithoutStore(t *testing.T) {
	h := middleware.Retry(nil, middleware.RetryOptions{MaxAttempts: 3, Backoff: linear, CountByHeader: true})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { return errBoom }))
	for prior, want := range []rabbitmw.Outcome{rabbitmw.Delay, rabbitmw.Delay, rabbitmw.DeadLetter} {
		d, _ := deliverytest.New("m1", "")
		d.Headers = amqp.Table{rabbitmw.HeaderAttempts: int32(prior)}
		dec := rabbitmw.Decide(h.Handle(context.Background(), d))
		if dec.Outcome != want || dec.Attempts != prior+1 {
			t.Errorf("with %d prior failures: %v, attempts %d; want %v, attempts %d", prior, dec.Outcome, dec.Attempts, want, prior+1)
		}
	}
}

func TestExponential(t *testing.T) {
	b := middleware.Exponential(100*time.Millisecond, 5*time.Second)
	for n := -1; n <= 100; n++ {
		full := 5 * time.Second
		if n <= 6 { // 100ms·2^5 = 3.2s is the last below the cap
			full = 100 * time.Millisecond << max(n-1, 0)
		}
		for range 50 {
			if got := b(n); got < full/2 || got > full {
				t.Fatalf("Exponential(100ms, 5s)(%d) = %v; want within [%v, %v]", n, got, full/2, full)
			}
		}
	}
	// Jitter: not every delay is the same.
	seen := map[time.Duration]bool{}
	for range 20 {
		seen[b(3)] = true
	}
	if len(seen) < 2 {
		t.Errorf("Exponential gave the same delay 20 times; want jitter")
	}
	for _, bad := range [][2]time.Duration{{0, time.Second}, {time.Second, time.Millisecond}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Exponential(%v, %v) did not panic", bad[0], bad[1])
				}
			}()
			middleware.Exponential(bad[0], bad[1])
		}()
	}
}

// abandoned is what Dedup returns for a message whose last attempt never
// finished.
var abandoned = fmt.Errorf("middleware: dedup: key %q: %w", "m1", middleware.ErrAbandoned)

// An attempt that never finished (Dedup's ErrAbandoned) is a failed
// attempt: counted, and tried again at once in the same delivery; at the
// limit the message is dead-lettered without running the handler again.
func TestRetryAbandoned(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name    string
		prior   int     // failures already counted in the store
		results []error // of the layers beneath, call by call

		wantCalls    int
		wantOutcome  rabbitmw.Outcome
		wantDelay    time.Duration
		wantAttempts int
		wantIs       []error
		wantCount    int
	}{
		{
			name: "counted, tried again at once, the success clears the count", results: []error{abandoned, nil},
			wantCalls: 2, wantOutcome: rabbitmw.Ack, wantCount: 0,
		},
		{
			name: "a failure of the retry is counted too", results: []error{abandoned, errBoom},
			wantCalls: 2, wantOutcome: rabbitmw.Delay, wantDelay: 2 * time.Second, wantAttempts: 2, wantIs: []error{errBoom}, wantCount: 2,
		},
		{
			name: "a failure of the retry at the limit", results: []error{abandoned, errBoom}, prior: 1,
			wantCalls: 2, wantOutcome: rabbitmw.DeadLetter, wantAttempts: 3, wantIs: []error{middleware.ErrRetriesExhausted, errBoom}, wantCount: 0,
		},
		{
			name: "a busy retry keeps the count", results: []error{abandoned, rabbitmw.RetryAfter(middleware.ErrBusy, 7*time.Second)},
			wantCalls: 2, wantOutcome: rabbitmw.Delay, wantDelay: 7 * time.Second, wantAttempts: 1, wantIs: []error{middleware.ErrBusy}, wantCount: 1,
		},
		{
			name: "abandoned again: counted, not tried a third time", results: []error{abandoned, abandoned},
			wantCalls: 2, wantOutcome: rabbitmw.Delay, wantDelay: 2 * time.Second, wantAttempts: 2, wantIs: []error{middleware.ErrAbandoned}, wantCount: 2,
		},
		{
			name: "at the limit: dead-lettered, the handler not run again", results: []error{abandoned}, prior: 2,
			wantCalls: 1, wantOutcome: rabbitmw.DeadLetter, wantAttempts: 3, wantIs: []error{middleware.ErrRetriesExhausted, middleware.ErrAbandoned}, wantCount: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := &faultyStore{Store: store.NewMemory()}
			for range tt.prior {
				s.Fail(ctx, "m1", time.Hour)
			}
			calls := 0
			h := middleware.Retry(s, middleware.RetryOptions{MaxAttempts: 3, Backoff: linear})(rabbitmw.HandlerFunc(
				func(context.Context, *amqp.Delivery) error {
					calls++
					return tt.results[calls-1]
				}))
			d, _ := deliverytest.New("m1", "")
			err := h.Handle(ctx, d)
			dec := rabbitmw.Decide(err)
			if calls != tt.wantCalls || dec.Outcome != tt.wantOutcome || dec.Delay != tt.wantDelay || dec.Attempts != tt.wantAttempts {
				t.Errorf("%d calls, Decide(%v) = %v after %v, attempts %d; want %d calls, %v after %v, attempts %d",
					calls, err, dec.Outcome, dec.Delay, dec.Attempts, tt.wantCalls, tt.wantOutcome, tt.wantDelay, tt.wantAttempts)
			}
			for _, target := range tt.wantIs {
				if !errors.Is(err, target) {
					t.Errorf("result %v does not wrap %v", err, target)
				}
			}
			if n, _ := s.Store.Fail(ctx, "m1", time.Hour); int(n)-1 != tt.wantCount {
				t.Errorf("failure count afterwards = %d; want %d", n-1, tt.wantCount)
			}
		})
	}
}

// ErrAbandoned promises that a message that kills every consumer that
// handles it is dead-lettered after MaxAttempts crashes. Each life of the
// consumer below finds the claim of the life before abandoned, and dies in
// the handler if it runs it (runtime.Goexit ends the goroutine; Dedup's
// deferred release runs, so each life first plants the dead claim that a
// SIGKILL leaves, and lets its lease end). The redelivery after a crash
// carries the same headers as the delivery before, so when Retry cannot
// count the abandoned attempt in its store (it has none, or Fail fails), it
// delays the message instead of trying it again in place: the broker's
// delayed copy carries the count, and the next life counts on from it.
func TestRetryAbandonedCrashLoop(t *testing.T) {
	for _, tt := range []struct {
		name       string
		retryStore func(store.Store) store.Store
	}{
		{"Retry with the store", func(s store.Store) store.Store { return s }},
		{"Retry with a nil store", func(store.Store) store.Store { return nil }},
		{"Retry with a store that cannot count", func(s store.Store) store.Store {
			f := &faultyStore{Store: s}
			set(&f.fail, errors.New("connection refused"))
			return f
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx := context.Background()
				s := store.NewMemory()
				const lease = time.Minute
				ran, lives := 0, 6
				var final error
				headers := amqp.Table{} // of the next delivery
				for life := 1; life <= lives && final == nil; life++ {
					// The previous life died holding the claim; its lease ended.
					if st, err := s.Claim(ctx, "m1", "dead-process-token", lease); err != nil || st != store.Claimed {
						t.Fatalf("life %d: planting the dead claim: %v, %v", life, st, err)
					}
					time.Sleep(lease + time.Second)
					rs := tt.retryStore(s)
					h := middleware.Retry(rs, middleware.RetryOptions{MaxAttempts: 3, Backoff: linear, CountByHeader: rs == nil})(
						middleware.Dedup(s, middleware.DedupOptions{Lease: lease})(rabbitmw.HandlerFunc(
							func(context.Context, *amqp.Delivery) error {
								ran++
								runtime.Goexit() // the consumer dies here
								return nil
							})))
					d, _ := deliverytest.New("m1", "")
					d.Redelivered = true
					d.Headers = headers
					result := make(chan error, 1)
					exited := make(chan struct{})
					go func() {
						defer close(exited)
						result <- h.Handle(ctx, d)
					}()
					<-exited
					select {
					case final = <-result:
						if dec := rabbitmw.Decide(final); dec.Outcome == rabbitmw.Delay {
							// The broker republishes a copy with the count;
							// the handler kills the consumer on it, and its
							// redelivery comes to the next life.
							headers = amqp.Table{rabbitmw.HeaderAttempts: int32(dec.Attempts)}
							final = nil
						}
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
// the inner dead-letters an abandoned message at its limit without running
// the handler again. Its result still wraps ErrAbandoned, but the outer
// reads it as the dead-letter it is: it does not count the attempt again
// nor, below its own limit, run the handler again.
func TestRetryNestedKeepsTheInnerDeadLetterOfAnAbandonedMessage(t *testing.T) {
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
	d, _ := deliverytest.New("m1", "")
	err := h.Handle(ctx, d)
	if dec := rabbitmw.Decide(err); calls != 1 || dec.Outcome != rabbitmw.DeadLetter {
		t.Errorf("handler called %d times, %v (%v); want 1 call, dead-lettered at the inner limit", calls, dec.Outcome, err)
	}
}

// Two messages whose attempts were abandoned together are not tried again
// together: while one is retried, the retry of the other waits for its
// turn, so that if the first kills the process again, the second is not in
// flight with it. A retry that is still waiting when ctx is done is
// delayed instead.
func TestRetryAbandonedOneAtATime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s := store.NewMemory()
		finish := make(chan struct{})
		var mu sync.Mutex
		calls := map[string]int{}
		h := middleware.Retry(s, middleware.RetryOptions{Backoff: linear})(rabbitmw.HandlerFunc(
			func(_ context.Context, d *amqp.Delivery) error {
				mu.Lock()
				calls[d.MessageId]++
				n := calls[d.MessageId]
				mu.Unlock()
				if n == 1 {
					return abandoned
				}
				if d.MessageId == "first" {
					<-finish
				}
				return nil
			}))
		called := func(id string) int {
			mu.Lock()
			defer mu.Unlock()
			return calls[id]
		}
		results := map[string]chan error{"first": make(chan error, 1), "second": make(chan error, 1), "third": make(chan error, 1)}
		handle := func(ctx context.Context, id string) {
			d, _ := deliverytest.New(id, "")
			results[id] <- h.Handle(ctx, d)
		}
		go handle(ctx, "first")
		synctest.Wait() // first is being tried again, alone
		go handle(ctx, "second")
		tctx, tcancel := context.WithCancel(ctx)
		go handle(tctx, "third")
		synctest.Wait()
		if n, m := called("second"), called("third"); n != 1 || m != 1 {
			t.Fatalf("while first is tried again, second and third were called %d and %d times; want once each (their abandoned attempt), then waiting", n, m)
		}
		tcancel()
		dec := rabbitmw.Decide(<-results["third"])
		if dec.Outcome != rabbitmw.Delay || dec.Delay != time.Second || dec.Attempts != 1 || !errors.Is(dec.Err, middleware.ErrAbandoned) {
			t.Errorf("third, cancelled while waiting: %v after %v, attempts %d (%v); want delayed 1s, attempts 1, ErrAbandoned", dec.Outcome, dec.Delay, dec.Attempts, dec.Err)
		}
		close(finish)
		for _, id := range []string{"first", "second"} {
			if err := <-results[id]; err != nil || called(id) != 2 {
				t.Errorf("%s = %v after %d calls; want nil after 2 (abandoned, then tried again)", id, err, called(id))
			}
		}
	})
}

// The reason Retry gives at its limit reads cause first, so that a column
// cut to its width, or a group by text, shows what failed.
func TestExhaustedReadsCauseFirst(t *testing.T) {
	h := middleware.Retry(nil, middleware.RetryOptions{MaxAttempts: 2, CountByHeader: true})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { return errors.New("decode order 7: unexpected EOF") }))
	err := h.Handle(context.Background(), &amqp.Delivery{MessageId: "m", Headers: amqp.Table{rabbitmw.HeaderAttempts: int64(1)}})
	require.ErrorIs(t, err, middleware.ErrRetriesExhausted)
	assert.Equal(t, "decode order 7: unexpected EOF (middleware: retries exhausted after 2 attempts)", err.Error())
}

// A failure that Retry could not count in its store is reported with the
// store's error beside it, but the type of the failure stays the
// handler's: a store that timed out does not make every message that fails
// meanwhile a "timeout" in the dead-letter queue, the log and the metrics.
func TestRetryStoreErrorDoesNotChangeTheErrorType(t *testing.T) {
	for _, storeErr := range []error{
		fmt.Errorf("redis: %w", context.DeadlineExceeded),
		fmt.Errorf("redis: %w", context.Canceled),
	} {
		for _, tc := range []struct {
			name     string
			result   error
			header   int64
			wantType string
			want     rabbitmw.Outcome
		}{
			{"below the limit", &json.SyntaxError{Offset: 3}, 0, "*json.SyntaxError", rabbitmw.Delay},
			{"at the limit", &json.SyntaxError{Offset: 3}, 4, "*json.SyntaxError", rabbitmw.DeadLetter},
			{"permanent", rabbitmw.Permanent(&json.SyntaxError{Offset: 3}), 0, "*json.SyntaxError", rabbitmw.DeadLetter},
			{"untyped", errBoom, 4, "error", rabbitmw.DeadLetter},
		} {
			t.Run(fmt.Sprintf("%v/%s", storeErr, tc.name), func(t *testing.T) {
				s := &faultyStore{Store: store.NewMemory()}
				set(&s.fail, storeErr)
				h := middleware.Retry(s, middleware.RetryOptions{Backoff: linear})(rabbitmw.HandlerFunc(
					func(context.Context, *amqp.Delivery) error { return tc.result }))
				d, _ := deliverytest.New("m1", "")
				d.Headers = amqp.Table{rabbitmw.HeaderAttempts: tc.header}
				err := h.Handle(context.Background(), d)
				assert.Equal(t, tc.want, rabbitmw.Decide(err).Outcome)
				assert.Equal(t, int(tc.header)+1, rabbitmw.Decide(err).Attempts)
				assert.ErrorIs(t, err, storeErr, "the store's error is reported")
				assert.Equal(t, tc.wantType, rabbitmw.ErrorType(err))
			})
		}
	}
}

// A failure that only the attempts header counts (CountByHeader, or a
// store whose Fail failed) is delayed, even if Backoff asks for no wait:
// only the copy that the broker package republishes for a delay carries
// the new count, and a requeue would bring the message back with the
// header of before, for ever. A failure that the store counted may be
// requeued at once.
func TestRetryZeroBackoffStillCarriesTheCount(t *testing.T) {
	now := func(int) time.Duration { return 0 }
	tests := []struct {
		name    string
		store   func() store.Store
		abandon bool // the result is Dedup's ErrAbandoned
		want    rabbitmw.Outcome
	}{
		{"by the header", func() store.Store { return nil }, false, rabbitmw.Delay},
		{"store down", func() store.Store {
			s := &faultyStore{Store: store.NewMemory()}
			set(&s.fail, errors.New("connection refused"))
			return s
		}, false, rabbitmw.Delay},
		{"store down, abandoned", func() store.Store {
			s := &faultyStore{Store: store.NewMemory()}
			set(&s.fail, errors.New("connection refused"))
			return s
		}, true, rabbitmw.Delay},
		{"counted in the store", func() store.Store { return store.NewMemory() }, false, rabbitmw.Requeue},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := tt.store()
			h := middleware.Retry(s, middleware.RetryOptions{Backoff: now, CountByHeader: s == nil})(rabbitmw.HandlerFunc(
				func(context.Context, *amqp.Delivery) error {
					if tt.abandon {
						return abandoned
					}
					return errBoom
				}))
			d, _ := deliverytest.New("m1", "")
			d.Headers = amqp.Table{rabbitmw.HeaderAttempts: int64(2)}
			dec := rabbitmw.Decide(h.Handle(context.Background(), d))
			assert.Equal(t, tt.want, dec.Outcome)
			assert.Equal(t, 3, dec.Attempts)
		})
	}
}
