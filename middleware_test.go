package rabbitmw_test

// The root's composition: Middleware and Chain (the order of layers, nil
// layers), and Decide over the errors that the layers of package
// middleware return, composed as the recommended stack composes them.

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// named returns a layer that records its name on the way in and out.
func named(name string, trace *[]string) rabbitmw.Middleware {
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			*trace = append(*trace, name+">")
			err := next.Handle(ctx, d)
			*trace = append(*trace, "<"+name)
			return err
		})
	}
}

func TestChainOrder(t *testing.T) {
	var trace []string
	h := rabbitmw.Chain(named("a", &trace), named("b", &trace), named("c", &trace))(
		rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
			trace = append(trace, "h")
			return nil
		}))
	require.NoError(t, h.Handle(context.Background(), &amqp.Delivery{}))
	assert.Equal(t, []string{"a>", "b>", "c>", "h", "<c", "<b", "<a"}, trace, "Chain(a, b, c)(h)")
}

// Chain(a, b)(h) is a(b(h)), and chains nest.
func TestChainNests(t *testing.T) {
	var t1, t2 []string
	leaf := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	rabbitmw.Chain(rabbitmw.Chain(named("a", &t1), named("b", &t1)), named("c", &t1))(leaf).Handle(context.Background(), nil)
	named("a", &t2)(named("b", &t2)(named("c", &t2)(leaf))).Handle(context.Background(), nil)
	assert.Equal(t, t2, t1, "a nested Chain runs as a(b(c(h)))")
}

type sentinel struct{}

func (sentinel) Handle(context.Context, *amqp.Delivery) error { return nil }

func TestChainEmpty(t *testing.T) {
	var h rabbitmw.Handler = sentinel{}
	assert.Equal(t, h, rabbitmw.Chain()(h), "Chain()(h) is h")
}

// A nil layer or handler panics when the chain is built, not at the first
// delivery; a layer that adds nothing (Log(nil)) is not nil and composes.
func TestChainNilLayers(t *testing.T) {
	assert.PanicsWithValue(t, "rabbitmw: Chain: middleware 1 is nil", func() {
		rabbitmw.Chain(middleware.Recover(), nil)
	})
	assert.PanicsWithValue(t, "rabbitmw: Chain: nil handler", func() { rabbitmw.Chain()(nil) })
	var h rabbitmw.Handler = sentinel{}
	assert.Equal(t, h, rabbitmw.Chain(middleware.Log(nil))(h), "Log(nil) adds nothing")
}

// The layers of the recommended stack, in its order, each recording that
// it ran: what each sees of the result beneath it is what makes the order.
func TestChainOfTheLayers(t *testing.T) {
	s := store.NewMemory()
	var trace []string
	h := rabbitmw.Chain(
		named("retry", &trace), middleware.Retry(s, middleware.RetryOptions{MaxAttempts: 2}),
		named("recover", &trace), middleware.Recover(),
		named("dedup", &trace), middleware.Dedup(s, middleware.DedupOptions{}),
		named("timeout", &trace), middleware.Timeout(time.Second),
	)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		trace = append(trace, "h")
		panic("boom")
	}))
	d, _ := deliverytest.New("m1", "")
	err := h.Handle(context.Background(), d)
	// The panic unwinds through Timeout and Dedup (which releases its
	// claim), is turned into an error by Recover, and counted by Retry.
	assert.Equal(t, []string{"retry>", "recover>", "dedup>", "timeout>", "h", "<recover", "<retry"}, trace)
	var pe *rabbitmw.PanicError
	require.ErrorAs(t, err, &pe)
	dec := rabbitmw.Decide(err)
	assert.Equal(t, rabbitmw.Delay, dec.Outcome, "a panic below the limit is delayed")
	assert.Equal(t, 1, dec.Attempts, "counted once")
	st, cerr := s.Claim(context.Background(), "m1", "stranger", time.Minute)
	require.NoError(t, cerr)
	assert.Equal(t, store.Claimed, st, "Dedup released its claim as the panic went by")
}

// Decide over what each layer returns, composed as the recommended stack.
func TestDecideOverTheLayers(t *testing.T) {
	boom := errors.New("boom")
	busy := store.NewMemory()
	_, err := busy.Claim(context.Background(), "held", "another consumer", time.Minute)
	require.NoError(t, err)
	for _, tc := range []struct {
		name     string
		id       string
		store    store.Store
		handler  func(ctx context.Context) error
		outcome  rabbitmw.Outcome
		is       error
		attempts int
	}{
		{name: "success", id: "m", handler: func(context.Context) error { return nil }, outcome: rabbitmw.Ack},
		{name: "a failure below the limit", id: "m", handler: func(context.Context) error { return boom },
			outcome: rabbitmw.Delay, is: boom, attempts: 1},
		{name: "a permanent failure", id: "m", handler: func(context.Context) error { return rabbitmw.Permanent(boom) },
			outcome: rabbitmw.DeadLetter, is: boom, attempts: 1},
		{name: "a timeout", id: "m", handler: func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() },
			outcome: rabbitmw.Delay, is: middleware.ErrTimeout, attempts: 1},
		{name: "held by another consumer", id: "held", store: busy, handler: func(context.Context) error { return nil },
			outcome: rabbitmw.Delay, is: middleware.ErrBusy},
		{name: "no key", handler: func(context.Context) error { return nil },
			outcome: rabbitmw.DeadLetter, is: middleware.ErrNoKey, attempts: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := tc.store
			if s == nil {
				s = store.NewMemory()
			}
			h := rabbitmw.Chain(
				middleware.Retry(s, middleware.RetryOptions{MaxAttempts: 3}),
				middleware.Recover(),
				middleware.Dedup(s, middleware.DedupOptions{}),
				middleware.Timeout(50*time.Millisecond),
			)(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error { return tc.handler(ctx) }))
			d, _ := deliverytest.New(tc.id, "")
			err := h.Handle(context.Background(), d)
			dec := rabbitmw.Decide(err)
			assert.Equal(t, tc.outcome, dec.Outcome, "Decide(%v)", err)
			assert.Equal(t, tc.attempts, dec.Attempts, "Decide(%v).Attempts", err)
			if tc.is != nil {
				assert.ErrorIs(t, err, tc.is)
			}
		})
	}

	// The last allowed attempt dead-letters, with the reason.
	s := store.NewMemory()
	h := rabbitmw.Chain(
		middleware.Retry(s, middleware.RetryOptions{MaxAttempts: 2}),
		middleware.Dedup(s, middleware.DedupOptions{}),
	)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return boom }))
	var dec rabbitmw.Decision
	for i := range 2 {
		d, _ := deliverytest.New("exhausted", "")
		d.Redelivered = i > 0
		dec = rabbitmw.Decide(h.Handle(context.Background(), d))
	}
	assert.Equal(t, rabbitmw.DeadLetter, dec.Outcome)
	assert.Equal(t, 2, dec.Attempts)
	assert.ErrorIs(t, dec.Err, middleware.ErrRetriesExhausted)
	assert.ErrorIs(t, dec.Err, boom)

	// A duplicate is acked, whatever layers it went through.
	d, _ := deliverytest.New("exhausted", "")
	s2 := store.NewMemory()
	_, err = s2.Claim(context.Background(), "done", "t", time.Minute)
	require.NoError(t, err)
	require.NoError(t, s2.Complete(context.Background(), "done", "t", time.Hour))
	d.MessageId = "done"
	err = rabbitmw.Chain(
		middleware.Retry(s2, middleware.RetryOptions{}),
		middleware.Recover(),
		middleware.Dedup(s2, middleware.DedupOptions{}),
	)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return boom })).Handle(context.Background(), d)
	assert.Equal(t, rabbitmw.Duplicate, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	assert.ErrorIs(t, err, rabbitmw.ErrDuplicate)
}
