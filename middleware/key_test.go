package middleware_test

import (
	"context"
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

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
		if got != tt.want || !errors.Is(err, tt.wantErr) {
			t.Errorf("Key(id %q, body %q) = %q, %v; want %q, %v", tt.id, tt.body, got, err, tt.want, tt.wantErr)
		}
	}
}

// A message has one key in a chain: the outermost keyed layer makes it,
// those beneath use it, and one with a Keying of its own that makes
// another key dead-letters the message, rather than count its failures
// under one key and claim it under another.
func TestKeyingShared(t *testing.T) {
	errNoID := errors.New("no order id")
	noID := func(*amqp.Delivery) (string, error) { return "", errNoID }
	byBody := func(d *amqp.Delivery) (string, error) { return string(d.Body), nil }
	ns := func(n string) middleware.Keying { return middleware.Keying{Namespace: n} }
	retry := func(k middleware.Keying) func(store.Store) rabbitmw.Middleware {
		return func(st store.Store) rabbitmw.Middleware {
			return middleware.Retry(st, middleware.RetryOptions{Keying: k, Backoff: linear})
		}
	}
	dedup := func(k middleware.Keying) func(store.Store) rabbitmw.Middleware {
		return func(st store.Store) rabbitmw.Middleware {
			return middleware.Dedup(st, middleware.DedupOptions{Keying: k})
		}
	}
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
	tests := []struct {
		name        string
		layers      []func(store.Store) rabbitmw.Middleware
		wantOutcome rabbitmw.Outcome
		wantClaim   string // the key the handler's claim has; "" if it must not run
		wantFailed  string // the key of the failure count; "" if none
		wantIs      error
		wantText    string
	}{
		{
			name:        "Keying on Retry alone: Dedup claims under Retry's key",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(ns("billing")), dedup(middleware.Keying{})},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			name:        "the same Keying on both",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(ns("billing")), dedup(ns("billing"))},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			name:        "a Namespace on Dedup alone: dead-lettered, the handler not run",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(middleware.Keying{}), dedup(ns("billing"))},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Dedup makes "billing:m1"; the Retry above it made "m1"`,
		},
		{
			name:        "different Keys",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(middleware.Keying{Key: byBody}), dedup(middleware.Keying{Key: middleware.Key})},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Dedup makes "m1"; the Retry above it made "order 42"`,
		},
		{
			name:        "Dedup's own Key fails where Retry's did not",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(middleware.Keying{}), dedup(middleware.Keying{Key: noID})},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Dedup makes no key (no order id); the Retry above it made "m1"`,
		},
		{
			name:        "Retry's Key fails: Dedup dead-letters with its error",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(middleware.Keying{Key: noID}), dedup(middleware.Keying{})},
			wantOutcome: rabbitmw.DeadLetter, wantIs: errNoID,
			wantText: "middleware: dedup: no idempotency key: no order id",
		},
		{
			name:        "Retry beneath Dedup uses Dedup's key",
			layers:      []func(store.Store) rabbitmw.Middleware{dedup(ns("billing")), retry(middleware.Keying{})},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			name:        "Retry beneath Dedup with another Keying",
			layers:      []func(store.Store) rabbitmw.Middleware{dedup(ns("billing")), retry(ns("shipping"))},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Retry makes "shipping:m1"; the Dedup above it made "billing:m1"`,
		},
		{
			name:        "through a layer of one's own and Recover",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(ns("billing")), own, recoverer, dedup(middleware.Keying{})},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			name:        "a mismatch through a layer of one's own",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(middleware.Keying{}), own, dedup(ns("billing"))},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Dedup makes "billing:m1"; the Retry above it made "m1"`,
		},
		{
			name:        "a mismatch through Recover",
			layers:      []func(store.Store) rabbitmw.Middleware{retry(middleware.Keying{}), recoverer, dedup(ns("billing"))},
			wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrKeyMismatch,
			wantText: `middleware: keyed layers disagree on a message's key: Dedup makes "billing:m1"; the Retry above it made "m1"`,
		},
		{
			name:        "Retry beneath Dedup and a layer of one's own",
			layers:      []func(store.Store) rabbitmw.Middleware{dedup(ns("billing")), own, retry(middleware.Keying{})},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1", wantFailed: "billing:m1",
		},
		{
			name:        "a Retry that counts by the header makes no key",
			layers:      []func(store.Store) rabbitmw.Middleware{byHeader, dedup(ns("billing"))},
			wantOutcome: rabbitmw.Delay, wantClaim: "billing:m1",
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
			if got := rabbitmw.Decide(err).Outcome; got != tt.wantOutcome {
				t.Errorf("outcome %v (%v); want %v", got, err, tt.wantOutcome)
			}
			if claimed != tt.wantClaim {
				t.Errorf("handler ran with claim %q; want %q", claimed, tt.wantClaim)
			}
			if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Errorf("result %v; want one wrapping %v", err, tt.wantIs)
			}
			if tt.wantText != "" && err.Error() != tt.wantText {
				t.Errorf("result %q; want %q", err, tt.wantText)
			}
			for _, key := range []string{"m1", "billing:m1", "shipping:m1"} {
				want := int64(0)
				if key == tt.wantFailed {
					want = 1
				}
				if ks, _ := st.Inspect(ctx, key); ks.Failures != want {
					t.Errorf("failures under %q: %d; want %d", key, ks.Failures, want)
				}
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
		if c, _ := middleware.ClaimFrom(ctx); c.Key() != "m2" {
			t.Errorf("inner claim %q; want %q", c.Key(), "m2")
		}
		return nil
	}))
	outer := middleware.Stack(st, middleware.StackOptions{Keying: middleware.Keying{Namespace: "billing"}})(rabbitmw.HandlerFunc(
		func(ctx context.Context, _ *amqp.Delivery) error {
			return inner.Handle(ctx, &amqp.Delivery{MessageId: "m2"})
		}))
	if err := outer.Handle(ctx, &amqp.Delivery{MessageId: "m1"}); err != nil {
		t.Fatalf("Handle: %v", err)
	}
	for key, want := range map[string]store.Status{"billing:m1": store.Done, "m2": store.Done, "billing:m2": 0} {
		if ks, _ := st.Inspect(ctx, key); ks.Status != want {
			t.Errorf("%q is %v; want %v", key, ks.Status, want)
		}
	}
}
