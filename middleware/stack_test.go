package middleware_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// Stack's layers are in the documented order, with opts given to each:
// Log records Retry's word; Retry counts a panic that Recover turned into
// an error, under the key it shares with Dedup; Dedup released its claim
// on the panic's way; the handler runs with its claim and its deadline.
func TestStack(t *testing.T) {
	ctx := context.Background()
	st := store.NewMemory()
	var logs bytes.Buffer
	var events []string
	const lease, timeout = 2 * time.Minute, 40 * time.Second
	opts := middleware.StackOptions{
		Logger: slog.New(slog.NewJSONHandler(&logs, nil)),
		Log:    middleware.LogOptions{DuplicateLevel: slog.LevelDebug},
		Keying: middleware.Keying{Namespace: "billing"},
		Retry:  middleware.RetryOptions{Backoff: func(int) time.Duration { return 7 * time.Second }},
		Dedup: middleware.DedupOptions{
			Lease:   lease,
			Observe: func(_ context.Context, e middleware.DedupEvent) { events = append(events, e.Kind.String()) },
		},
		Timeout: timeout,
	}
	calls := 0
	h := middleware.Stack(st, opts)(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		calls++
		c, ok := middleware.ClaimFrom(ctx)
		if assert.True(t, ok, "the handler's claim") {
			assert.Equal(t, "billing:m1", c.Key())
		}
		ks, _ := st.Inspect(ctx, "billing:m1")
		assert.Equal(t, store.Processing, ks.Status, "billing:m1 while the handler runs")
		assert.InDelta(t, float64(lease), float64(ks.TTL), float64(time.Minute), "the lease")
		dl, ok := ctx.Deadline()
		assert.True(t, ok, "the handler has a deadline")
		assert.InDelta(t, float64(timeout), float64(time.Until(dl)), float64(time.Minute/2), "the handler's deadline")
		if calls == 1 {
			panic("kaboom")
		}
		return nil
	}))

	for i, want := range []struct {
		outcome  rabbitmw.Outcome
		delay    time.Duration
		attempts int
		failures int64
		status   store.Status
		calls    int
		log      string
	}{
		{rabbitmw.Delay, 7 * time.Second, 1, 1, 0, 1, "delayed"},
		{rabbitmw.Ack, 0, 0, 0, store.Done, 2, "acked"},
		{rabbitmw.Duplicate, 0, 0, 0, store.Done, 2, ""}, // logged at Debug: not written
	} {
		logs.Reset()
		dec := rabbitmw.Decide(h.Handle(ctx, &amqp.Delivery{MessageId: "m1", Redelivered: i > 0}))
		if dec.Outcome != want.outcome || dec.Delay != want.delay || dec.Attempts != want.attempts {
			t.Errorf("delivery %d: %v after %v, attempts %d; want %v after %v, attempts %d",
				i, dec.Outcome, dec.Delay, dec.Attempts, want.outcome, want.delay, want.attempts)
		}
		ks, _ := st.Inspect(ctx, "billing:m1")
		assert.Equal(t, want.status, ks.Status, "delivery %d: billing:m1", i)
		assert.Equal(t, want.failures, ks.Failures, "delivery %d: failures", i)
		assert.Equal(t, want.calls, calls, "delivery %d: handler calls", i)
		var rec struct{ Outcome string }
		if logs.Len() > 0 {
			require.NoError(t, json.Unmarshal(logs.Bytes(), &rec), "delivery %d: log %q", i, logs.String())
		}
		assert.Equal(t, want.log, rec.Outcome, "delivery %d: logged %q", i, logs.String())
	}
	assert.Equal(t, []string{"claimed", "claimed", "duplicate"}, events, "Dedup's events")
}

// Stack's Retry dead-letters after MaxAttempts, or at once an error that
// Permanent reports.
func TestStackRetryOptions(t *testing.T) {
	errBad := errors.New("malformed order")
	h := middleware.Stack(store.NewMemory(), middleware.StackOptions{Retry: middleware.RetryOptions{
		MaxAttempts: 2,
		Permanent:   func(err error) bool { return errors.Is(err, errBad) },
	}})(rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		if d.MessageId == "bad" {
			return errBad
		}
		return errBoom
	}))
	for i, tt := range []struct {
		id   string
		want rabbitmw.Outcome
	}{{"m1", rabbitmw.Delay}, {"m1", rabbitmw.DeadLetter}, {"bad", rabbitmw.DeadLetter}} {
		got := rabbitmw.Decide(h.Handle(context.Background(), &amqp.Delivery{MessageId: tt.id, Redelivered: i == 1})).Outcome
		assert.Equal(t, tt.want, got, "delivery %d (%s)", i, tt.id)
	}
}

// Stack reaches the settings of every layer: here Dedup's BusyDelay and
// Retention and Retry's TTL, which the layers' own tests cover.
func TestStackReachesEverySetting(t *testing.T) {
	ctx := context.Background()
	st := store.NewMemory()
	h := middleware.Stack(st, middleware.StackOptions{
		Retry: middleware.RetryOptions{TTL: 3 * time.Hour},
		Dedup: middleware.DedupOptions{BusyDelay: 42 * time.Millisecond, Retention: 2 * time.Hour},
	})(rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		if d.Redelivered {
			return nil
		}
		return errBoom
	}))

	_, err := st.Claim(ctx, "held", "another consumer", time.Minute)
	require.NoError(t, err)
	dec := rabbitmw.Decide(h.Handle(ctx, &amqp.Delivery{MessageId: "held"}))
	assert.Equal(t, rabbitmw.Delay, dec.Outcome)
	assert.Equal(t, 42*time.Millisecond, dec.Delay, "Dedup.BusyDelay")

	h.Handle(ctx, &amqp.Delivery{MessageId: "m1"}) // fails: counted
	ks, err := st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.InDelta(t, float64(3*time.Hour), float64(ks.FailuresTTL), float64(time.Minute), "Retry.TTL")
	require.NoError(t, h.Handle(ctx, &amqp.Delivery{MessageId: "m1", Redelivered: true}))
	ks, err = st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.InDelta(t, float64(2*time.Hour), float64(ks.TTL), float64(time.Minute), "Dedup.Retention")
}

// lossyStore loses an answer now and then, at random: a Claim, a Complete
// or a Release that took effect reports an error, and a Release fails
// without taking effect.
type lossyStore struct {
	store.Store
	mu  sync.Mutex
	rng *rand.Rand
}

// lose reports whether to lose this call's answer, one time in ten.
func (s *lossyStore) lose() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rng.IntN(10) == 0
}

func (s *lossyStore) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	st, err := s.Store.Claim(ctx, key, token, lease)
	if s.lose() {
		return 0, errors.New("i/o timeout")
	}
	return st, err
}

func (s *lossyStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	err := s.Store.Complete(ctx, key, token, retention)
	if s.lose() {
		return errors.New("i/o timeout")
	}
	return err
}

func (s *lossyStore) Release(ctx context.Context, key, token string) error {
	if s.lose() {
		return errors.New("connection refused")
	}
	err := s.Store.Release(ctx, key, token)
	if s.lose() {
		return errors.New("i/o timeout")
	}
	return err
}

// Retry, Dedup and Timeout, with renewals that meet every fault, answers
// lost, deliveries cancelled by their consumer's shutdown and handlers cut
// short by the deadline, keep two handlers of a message from running at
// once, and apply each message's effect once.
func TestStackEffectsOnceUnderFaults(t *testing.T) {
	for seed := range 50 {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				const lease = 300 * time.Millisecond
				s := &flakyRenewalStore{
					Store: &lossyStore{Store: store.NewMemory(), rng: rand.New(rand.NewPCG(uint64(seed), 3))},
					rng:   rand.New(rand.NewPCG(uint64(seed), 1)),
				}
				x := newExclusive(t, uint64(seed), lease, lease)
				h := rabbitmw.Chain(
					middleware.Retry(store.NewMemory(), middleware.RetryOptions{MaxAttempts: 1000, Backoff: func(int) time.Duration { return 10 * time.Millisecond }}),
					middleware.Dedup(s, middleware.DedupOptions{Lease: lease, BusyDelay: 10 * time.Millisecond, UnavailableDelay: 10 * time.Millisecond}),
					middleware.Timeout(lease/2),
				)(x)
				x.deliver(h, 5, 3, true)
				time.Sleep(2 * lease) // the renewals still in flight return
			})
		})
	}
}

// orderError is an application's error type whose Error reads its fields,
// as most do, so that a nil *orderError panics when asked for its text.
type orderError struct{ id string }

func (e *orderError) Error() string { return "order " + e.id + " rejected" }

// A handler that returns a nil *orderError as its error (the typed nil of
// "var err *orderError; return err") failed: the message gets its
// MaxAttempts, and the text of the result, which Log and the broker's
// fault headers read outside Recover, does not panic. Before, Log's
// err.Error() panicked through Retry's marks, and the broker, recovering
// it, dead-lettered the message at its first attempt as a "panic".
func TestStackTypedNilErrorIsAFailure(t *testing.T) {
	ctx := context.Background()
	var logs bytes.Buffer
	h := middleware.Stack(store.NewMemory(), middleware.StackOptions{
		Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Retry:  middleware.RetryOptions{MaxAttempts: 3, Backoff: linear},
	})(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		var err *orderError
		return err
	}))
	for n := 1; n <= 3; n++ {
		d := &amqp.Delivery{MessageId: "m1", Headers: amqp.Table{rabbitmw.HeaderAttempts: int64(n - 1)}}
		var err error
		require.NotPanics(t, func() { err = h.Handle(ctx, d) }, "attempt %d", n)
		dec := rabbitmw.Decide(err)
		want := rabbitmw.Delay
		if n == 3 {
			want = rabbitmw.DeadLetter
		}
		assert.Equal(t, want, dec.Outcome, "attempt %d", n)
		assert.Equal(t, n, dec.Attempts)
		assert.Equal(t, "*middleware_test.orderError", rabbitmw.ErrorType(err))
		text := "*middleware_test.orderError returned as a nil pointer"
		if n == 3 {
			text += " (middleware: retries exhausted after 3 attempts)"
		}
		assert.Equal(t, text, err.Error(), "attempt %d", n)
	}
}

// A panic is a failed attempt whatever its value: one whose value is an
// error marked not counted, or a duplicate, is counted like any other and
// dead-lettered at the limit, never cycled for ever nor acknowledged.
func TestStackPanicWithAMarkedValueIsAFailure(t *testing.T) {
	ctx := context.Background()
	for _, v := range []error{
		fmt.Errorf("breaker: %w", rabbitmw.NotCounted(errors.New("open"))),
		fmt.Errorf("inner: %w", rabbitmw.ErrDuplicate),
	} {
		t.Run(v.Error(), func(t *testing.T) {
			h := middleware.Stack(store.NewMemory(), middleware.StackOptions{
				Retry: middleware.RetryOptions{MaxAttempts: 2, Backoff: linear},
			})(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { panic(v) }))
			for n, want := range []rabbitmw.Outcome{rabbitmw.Delay, rabbitmw.DeadLetter} {
				d := &amqp.Delivery{MessageId: "m1", Headers: amqp.Table{rabbitmw.HeaderAttempts: int64(n)}}
				err := h.Handle(ctx, d)
				dec := rabbitmw.Decide(err)
				assert.Equal(t, want, dec.Outcome, "attempt %d", n+1)
				assert.Equal(t, n+1, dec.Attempts, "attempt %d", n+1)
				assert.Equal(t, "panic", rabbitmw.ErrorType(err))
			}
		})
	}
}

// A key of the stack's that holds in Redis a value of another type than a
// string (written by something else that shares the Redis) will not heal
// by waiting: the message is dead-lettered, with a reason that names the
// Redis key, rather than delayed as "store unavailable" for ever. Over
// package redisstore, on miniredis.
func TestStackWrongTypeKey(t *testing.T) {
	fail := errors.New("handler failed")
	tests := []struct {
		name     string
		hash     string // the key that holds a hash
		attempts int    // the attempts header of the delivery
		handler  error
		runs     int    // handler runs
		errType  string // rabbitmw.ErrorType of the result
	}{
		{name: "the claim key", hash: "msg:m1", runs: 0, errType: "key_rejected"},
		// The failure is the handler's; the refusal to count it goes with it.
		{name: "the failure key, at the last attempt", hash: "retry:m1", attempts: 4, handler: fail, runs: 1, errType: "error"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, c, _ := redistest.Start(t)
			ctx := context.Background()
			require.NoError(t, c.HSet(ctx, tt.hash, "f", "v").Err())
			runs := 0
			h := middleware.Stack(redisstore.New(c, redisstore.Options{}), middleware.StackOptions{})(
				rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { runs++; return tt.handler }))
			msg := amqp.Publishing{MessageId: "m1"}
			if tt.attempts > 0 {
				msg.Headers = amqp.Table{rabbitmw.HeaderAttempts: int32(tt.attempts)}
			}
			rec := rabbitmwtest.NewRecorder()
			d := rec.Deliver(msg)
			err := h.Handle(ctx, d)

			assert.Equal(t, tt.runs, runs, "handler runs")
			dec := rabbitmw.Decide(err)
			assert.Equal(t, rabbitmw.DeadLetter, dec.Outcome, "Decide(%v)", err)
			require.Error(t, err)
			assert.Contains(t, err.Error(), `"`+tt.hash+`" holds a value of another type`)
			assert.ErrorIs(t, err, store.ErrKeyRejected)
			assert.ErrorIs(t, err, redisstore.ErrWrongType)
			assert.Equal(t, tt.errType, rabbitmw.ErrorType(err), "ErrorType(%v)", err)
		})
	}
}
