// Package benchstack is what the in-process measurements of the stack
// share: BenchmarkChain in package e2e and the stack figures of the
// bench command (go run ./bench -stack-only) run the same stack through the
// same loop, so that their figures can be compared.
package benchstack

import (
	"context"
	"log/slog"
	"runtime"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/recording"
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

// Run hands b.N deliveries, under context.Background(), to stack in front
// of a handler that does nothing. With dup false each has a new message
// id (claim, handler, complete); with dup true each repeats one id, done
// before the timer starts (claim only). It fails b if a delivery does not
// end as acked, or as a duplicate, respectively.
func Run(b *testing.B, stack rabbitmw.Middleware, dup bool) {
	run(b, context.Background(), stack(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })), dup)
}

// RunWaiting is [Run] of new messages in front of the realistic handler:
// one that waits on its context, as any handler doing I/O does. It calls
// ctx.Done once and does nothing else, the least such a handler does: the
// layers' contexts are then watched, with what that costs (a done
// channel, a timer for the deadline).
func RunWaiting(b *testing.B, stack rabbitmw.Middleware) {
	run(b, context.Background(), stack(waiting), false)
}

// RunWaitingInConsumer is [RunWaiting] under a context like the one that
// package broker gives its handlers: cancellable (the layers' contexts
// must then also watch it) and counting the writes that record a finished
// attempt (see internal/recording).
func RunWaitingInConsumer(b *testing.B, stack rabbitmw.Middleware) {
	var tracker recording.Tracker
	ctx, cancel := context.WithCancel(recording.With(context.Background(), &tracker))
	defer cancel()
	run(b, ctx, stack(waiting), false)
	if n, _ := tracker.Pending(); n != 0 {
		b.Fatalf("%d writes still counted in progress after the run", n)
	}
}

// waiting is the handler of [RunWaiting].
var waiting = rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	default:
		return nil
	}
})

func run(b *testing.B, ctx context.Context, h rabbitmw.Handler, dup bool) {
	d := &amqp.Delivery{MessageId: "dup", Body: []byte(`{"order":42}`)}
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
	OnCPU(b, func() {
		for i := range b.N {
			if !dup {
				d.MessageId = ids[i]
			}
			if err := h.Handle(ctx, d); rabbitmw.Decide(err).Outcome != want {
				b.Fatalf("delivery %d: %v decides %v; want %v", i, err, rabbitmw.Decide(err).Outcome, want)
			}
		}
	})
}

// OnCPU runs f on one thread and reports the thread's CPU time per
// operation as cpu-ns/op: on a shared machine, ns/op also counts the time
// the benchmark waited for a core. It leaves out what other threads do
// for f: the garbage collector's background work, mostly.
func OnCPU(b *testing.B, f func()) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	start := threadCPU()
	f()
	if end := threadCPU(); start >= 0 && end >= 0 && b.N > 0 {
		b.ReportMetric(float64(end-start)/float64(b.N), "cpu-ns/op")
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
