package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// The recommended stack, for a service that shares its store with others.
func ExampleStack() {
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr { // drop what varies between runs
			if a.Key == slog.TimeKey || a.Key == "duration" {
				return slog.Attr{}
			}
			return a
		},
	}))
	h := middleware.Stack(store.NewMemory(), middleware.StackOptions{
		Logger: logger,
		Keying: middleware.Keying{Namespace: "billing"},
	})(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		c, _ := middleware.ClaimFrom(ctx)
		fmt.Println("charging", d.MessageId, "under", c.Key())
		return nil
	}))
	for tag := range uint64(2) { // the same message, delivered twice
		h.Handle(context.Background(), &amqp.Delivery{MessageId: "pay-1", DeliveryTag: tag + 1})
	}
	// Output:
	// charging pay-1 under billing:pay-1
	// level=INFO msg=delivery message_id=pay-1 delivery_tag=1 routing_key="" redelivered=false attempt=1 outcome=acked
	// level=INFO msg=delivery message_id=pay-1 delivery_tag=2 routing_key="" redelivered=false attempt=1 outcome=duplicate reason="middleware: dedup: key \"billing:pay-1\": rabbitmw: duplicate delivery"
}

func ExampleDedup() {
	st := store.NewMemory()
	h := middleware.Dedup(st, middleware.DedupOptions{})(rabbitmw.HandlerFunc(
		func(ctx context.Context, d *amqp.Delivery) error {
			fmt.Println("shipping", d.MessageId)
			return nil
		}))
	for range 3 { // the same message, delivered three times
		err := h.Handle(context.Background(), &amqp.Delivery{MessageId: "parcel-7"})
		fmt.Println(rabbitmw.Decide(err).Outcome)
	}
	// Output:
	// shipping parcel-7
	// acked
	// duplicate
	// duplicate
}

func ExampleRetry() {
	st := store.NewMemory()
	h := middleware.Retry(st, middleware.RetryOptions{
		MaxAttempts: 3,
		Backoff:     func(n int) time.Duration { return time.Duration(n) * time.Second },
	})(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		return errors.New("bank unreachable")
	}))
	for range 3 { // each redelivery of the failing message
		d := rabbitmw.Decide(h.Handle(context.Background(), &amqp.Delivery{MessageId: "pay-1", Redelivered: true}))
		fmt.Println(d.Attempts, d.Outcome, d.Delay)
	}
	// Output:
	// 1 delayed 1s
	// 2 delayed 2s
	// 3 dead-lettered 0s
}

func ExampleRecover() {
	h := middleware.Recover()(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		var m map[string]int
		m["boom"]++ // a bug
		return nil
	}))
	err := h.Handle(context.Background(), &amqp.Delivery{})
	var pe *rabbitmw.PanicError
	fmt.Println(errors.As(err, &pe), err)
	// Output:
	// true panic: assignment to entry in nil map
}

func ExampleLog() {
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr { // drop what varies between runs
			if a.Key == slog.TimeKey || a.Key == "duration" {
				return slog.Attr{}
			}
			return a
		},
	}))
	h := middleware.Log(logger)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		return rabbitmw.RetryAfter(errors.New("bank unreachable"), 5*time.Second)
	}))
	h.Handle(context.Background(), &amqp.Delivery{MessageId: "pay-1", DeliveryTag: 9, RoutingKey: "payments"})
	// Output:
	// level=WARN msg=delivery message_id=pay-1 delivery_tag=9 routing_key=payments redelivered=false attempt=1 outcome=delayed delay=5s error="bank unreachable" error_type=error
}

// A busy consumer keeps its duplicates out of an Info log, and adds the
// tenant each message belongs to (here from a header) to its record.
func ExampleLogWith() {
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr { // drop what varies between runs
			if a.Key == slog.TimeKey || a.Key == "duration" {
				return slog.Attr{}
			}
			return a
		},
	}))
	h := middleware.LogWith(logger, middleware.LogOptions{
		DuplicateLevel: slog.LevelDebug,
		AppendAttrs: func(attrs []slog.Attr, d *amqp.Delivery) []slog.Attr {
			t, _ := d.Headers["tenant"].(string)
			return append(attrs, slog.String("tenant", t))
		},
	})(middleware.Dedup(store.NewMemory(), middleware.DedupOptions{})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { return nil })))
	for tag := range uint64(2) { // the same message twice: the duplicate is logged at Debug
		h.Handle(context.Background(), &amqp.Delivery{MessageId: "pay-1", DeliveryTag: tag + 1, Headers: amqp.Table{"tenant": "acme"}})
	}
	// Output:
	// level=INFO msg=delivery message_id=pay-1 delivery_tag=1 routing_key="" redelivered=false attempt=1 outcome=acked tenant=acme
}

func ExampleTimeout() {
	h := middleware.Timeout(10 * time.Millisecond)(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
		<-ctx.Done() // a slow call that honours its context
		return ctx.Err()
	}))
	err := h.Handle(context.Background(), &amqp.Delivery{})
	fmt.Println(errors.Is(err, middleware.ErrTimeout), err)
	// Output:
	// true middleware: handler timed out after 10ms: context deadline exceeded
}
