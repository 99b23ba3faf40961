// Package benchstack is what the in-process measurements of the stack
// share: BenchmarkChain in package e2e and the stack figures of the
// bench command (go run ./bench -stack-only) run the same stack through the
// same loop, so that their figures can be compared.
package benchstack

import (
	"context"
	"log/slog"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// Timeout is the deadline of the stack's Timeout layer.
const Timeout = 30 * time.Second

// Recommended is the stack of the README over st: middleware.Stack, with
// Timeout as its deadline. Its logger discards per-delivery records:
// production logs cost what their slog handler costs, which is not the
// stack's to measure.
func Recommended(st store.Store) rabbitmw.Middleware {
	return middleware.Stack(st, middleware.StackOptions{Logger: discard, Timeout: Timeout})
}

// WithoutTimeout is [Recommended] without its Timeout layer.
func WithoutTimeout(st store.Store) rabbitmw.Middleware {
	return rabbitmw.Chain(
		middleware.Log(discard),
		middleware.Retry(st, middleware.RetryOptions{}),
		middleware.Recover(),
		middleware.Dedup(st, middleware.DedupOptions{}),
	)
}

var discard = slog.New(slog.DiscardHandler)

// Run hands b.N deliveries to stack in front of a handler that does
// nothing. With dup false each has a new message id (claim, handler,
// complete); with dup true each repeats one id, done before the timer
// starts (claim only). It fails b if a delivery does not end as acked, or
// as a duplicate, respectively.
func Run(b *testing.B, stack rabbitmw.Middleware, dup bool) {
	run(b, stack(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })), dup)
}

// RunWaiting is [Run] of new messages in front of a handler that calls
// ctx.Done once and does nothing else, as a handler that does any I/O
// (which watches its context) does at least: the contexts that the layers
// build lazily are built then.
func RunWaiting(b *testing.B, stack rabbitmw.Middleware) {
	run(b, stack(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		default:
			return nil
		}
	})), false)
}

func run(b *testing.B, h rabbitmw.Handler, dup bool) {
	d := &amqp.Delivery{MessageId: "dup", Body: []byte(`{"order":42}`)}
	ctx := context.Background()
	want := rabbitmw.Ack
	var ids []string
	if dup {
		if err := h.Handle(ctx, d); err != nil {
			b.Fatal(err)
		}
		want = rabbitmw.Duplicate
	} else {
		ids = make([]string, b.N)
		for i := range ids {
			ids[i] = "m" + strconv.Itoa(i)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if !dup {
			d.MessageId = ids[i]
		}
		if err := h.Handle(ctx, d); rabbitmw.Decide(err).Outcome != want {
			b.Fatalf("delivery %d: %v decides %v; want %v", i, err, rabbitmw.Decide(err).Outcome, want)
		}
	}
}

// NopStore claims every key and does nothing else: a stack over it costs
// only its layers.
type NopStore struct{}

// Claim implements [store.Store].
func (NopStore) Claim(context.Context, string, string, time.Duration) (store.Status, error) {
	return store.Claimed, nil
}

// Extend implements [store.Store].
func (NopStore) Extend(context.Context, string, string, time.Duration) error { return nil }

// Complete implements [store.Store].
func (NopStore) Complete(context.Context, string, string, time.Duration) error { return nil }

// Release implements [store.Store].
func (NopStore) Release(context.Context, string, string) error { return nil }

// Fail implements [store.Store].
func (NopStore) Fail(context.Context, string, time.Duration) (int64, error) { return 1, nil }

// ResetFailures implements [store.Store].
func (NopStore) ResetFailures(context.Context, string) error { return nil }

var _ store.Store = NopStore{}
