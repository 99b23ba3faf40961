package middleware_test

import (
	"context"
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

func TestKey(t *testing.T) {
	tests := []struct {
		id, body string
		want     string
		wantErr  error
	}{
		{id: "order-42", body: "x", want: "order-42"},
		{id: " spaced ", want: " spaced "},
		{body: "hello", want: "5d41402abc4b2a76b9719d911017c592"}, // md5("hello"), as hand-written consumers compute it
		{wantErr: middleware.ErrNoKey},
	}
	for _, tt := range tests {
		got, err := middleware.Key(&amqp.Delivery{MessageId: tt.id, Body: []byte(tt.body)})
		assert.Equal(t, tt.want, got, "Key(id %q, body %q)", tt.id, tt.body)
		assert.ErrorIs(t, err, tt.wantErr, "Key(id %q, body %q)", tt.id, tt.body)
	}
}

// The key is set in one place, a Keys layer, and Retry and Dedup beneath
// it both use it; a Keys layer beneath the layer that named the message
// dead-letters it if it would name it otherwise, rather than have its
// failures counted under one key and its claim taken under another.
func TestKeys(t *testing.T) {
	errNoID := errors.New("no order id")
	noID := func(*amqp.Delivery) (string, error) { return "", errNoID }
	ns := func(n string) middleware.Keying { return middleware.Keying{Namespace: n} }
	keys := func(k middleware.Keying) func(store.Store) rabbitmw.Middleware {
		return func(store.Store) rabbitmw.Middleware { return middleware.Keys(k) }
	}
	retry := func(st store.Store) rabbitmw.Middleware {
		return middleware.Retry(st, middleware.RetryOptions{Backoff: linear})
	}
	dedup := func(st store.Store) rabbitmw.Middleware { return middleware.Dedup(st, middleware.DedupOptions{}) }
	// own is a layer of one's own, which hands the key down in the context.
	own := func(store.Store) rabbitmw.Middleware {
		return func(next rabbitmw.Handler) rabbitmw.Handler {
			return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error { return next.Handle(ctx, d) })
		}
	}
	recoverer := func(store.Store) rabbitmw.Middleware { return middleware.Recover() }
	byHeader := func(store.Store) rabbitmw.Middleware {
		return middleware.Retry(nil, middleware.RetryOptions{CountByHeader: true, Backoff: linear})
	}
	type layer = func(store.Store) rabbitmw.Middleware
	tests := []struct {
		name        string
		layers      []layer
		wantOutcome rabbitmw.Outcome
		wantClaim   string // the key the handler's claim has; "" if it must not run
		wantFailed  string // the key of the failure count; "" if none
		wantIs      error
		wantText    string
	}{
		{
			name:        "no Keys: Key, no namespace",
			layers:      []layer{retry, dedup},
			wantOutcome: rabbitmw.Delay, wantClaim: "m1", wantFailed: "m1",
		},
		{
			name:        "Keys above both",
			layers:      []layer{keys(ns("billing")), retry, dedup},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			// (Dedup refuses a Retry directly beneath it: see
			// TestDedupRefusesRetryBeneathIt.)
			name:        "Keys above Dedup above a layer above Retry",
			layers:      []layer{keys(ns("billing")), dedup, own, retry},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			name:        "through a layer of one's own and Recover",
			layers:      []layer{keys(ns("billing")), own, retry, own, recoverer, dedup},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			name:        "a Retry that counts by the header makes no key",
			layers:      []layer{keys(ns("billing")), byHeader, dedup},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1",
		},
		{
			name:        "the Key fails: Dedup dead-letters with its error",
			layers:      []layer{keys(middleware.Keying{Key: noID}), retry, dedup},
			wantOutcome: rabbitmw.DeadLetter, wantIs: errNoID,
			wantText: "middleware: dedup: no idempotency key: no order id",
		},
		{
			name:        "Keys beneath Retry: dead-lettered, the handler not run",
			layers:      []layer{retry, keys(ns("billing")), dedup},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Keys makes "billing:m1"; the Retry above it made "m1"`,
		},
		{
			name:        "Keys beneath Recover beneath Retry",
			layers:      []layer{retry, recoverer, keys(ns("billing")), dedup},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Keys makes "billing:m1"; the Retry above it made "m1"`,
		},
		{
			name:        "Keys beneath Dedup, which made the key",
			layers:      []layer{dedup, keys(ns("billing")), retry},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Keys makes "billing:m1"; the Dedup above it made "m1"`,
		},
		{
			name:        "Retry beneath Dedup, which made the key",
			layers:      []layer{dedup, own, retry},
			wantOutcome: rabbitmw.Delay, wantClaim: "m1", wantFailed: "m1",
		},
		{
			name:        "Keys beneath Keys, another namespace",
			layers:      []layer{keys(ns("billing")), own, keys(ns("shipping")), retry, dedup},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Keys makes "shipping:m1"; the Keys above it made "billing:m1"`,
		},
		{
			name:        "Keys beneath Keys, the same key",
			layers:      []layer{keys(ns("billing")), keys(ns("billing")), retry, dedup},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			st := store.NewMemory()
			var layers []rabbitmw.Middleware
			for _, l := range tt.layers {
				layers = append(layers, l(st))
			}
			claimed := ""
			h := rabbitmw.Chain(layers...)(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
				claimed = "(no claim)"
				if c, ok := middleware.ClaimFrom(ctx); ok {
					claimed = c.Key()
				}
				return errBoom
			}))
			err := h.Handle(ctx, &amqp.Delivery{MessageId: "m1", Body: []byte("order 42")})
			assert.Equal(t, tt.wantOutcome, rabbitmw.Decide(err).Outcome, "outcome of %v", err)
			assert.Equal(t, tt.wantClaim, claimed, "the handler's claim")
			if tt.wantIs != nil {
				assert.ErrorIs(t, err, tt.wantIs)
			}
			if tt.wantText != "" {
				assert.EqualError(t, err, tt.wantText)
			}
			for _, key := range []string{"m1", "billing:m1", "shipping:m1"} {
				want := int64(0)
				if key == tt.wantFailed {
					want = 1
				}
				ks, _ := st.Inspect(ctx, key)
				assert.Equal(t, want, ks.Failures, "failures under %q", key)
			}
		})
	}
}

// A handler that runs a chain of its own for another message, in its
// context, does not lend that message the key of its own.
func TestKeyingOtherDelivery(t *testing.T) {
	ctx := context.Background()
	st := store.NewMemory()
	inner := middleware.Dedup(st, middleware.DedupOptions{})(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
		c, _ := middleware.ClaimFrom(ctx)
		assert.Equal(t, "m2", c.Key(), "inner claim")
		return nil
	}))
	outer := middleware.Stack(st, middleware.StackOptions{Keying: middleware.Keying{Namespace: "billing"}})(rabbitmw.HandlerFunc(
		func(ctx context.Context, _ *amqp.Delivery) error {
			return inner.Handle(ctx, &amqp.Delivery{MessageId: "m2"})
		}))
	require.NoError(t, outer.Handle(ctx, &amqp.Delivery{MessageId: "m1"}))
	for key, want := range map[string]store.Status{"billing:m1": store.Done, "m2": store.Done, "billing:m2": 0} {
		ks, _ := st.Inspect(ctx, key)
		assert.Equal(t, want, ks.Status, "%q", key)
	}
}
