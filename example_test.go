package rabbitmw_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
	"github.com/rabbitmw/rabbitmw/store"
)

// Layers run in the order given to Chain, the first outermost.
func ExampleChain() {
	layer := func(name string) rabbitmw.Middleware {
		return func(next rabbitmw.Handler) rabbitmw.Handler {
			return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				fmt.Println("enter", name)
				defer fmt.Println("leave", name)
				return next.Handle(ctx, d)
			})
		}
	}
	h := rabbitmw.Chain(layer("a"), layer("b"))(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error {
			fmt.Println("handle")
			return nil
		}))
	h.Handle(context.Background(), &amqp.Delivery{})
	// Output:
	// enter a
	// enter b
	// handle
	// leave b
	// leave a
}

// The recommended stack in front of a business handler, settled on a plain
// channel with Settle. (A Recorder stands in for the channel here.)
func ExampleSettle() {
	st := store.NewMemory()
	h := rabbitmw.Chain(
		middleware.Retry(st, middleware.RetryOptions{}),
		middleware.Recover(),
		middleware.Dedup(st, middleware.DedupOptions{}),
		middleware.Timeout(30*time.Second),
	)(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		fmt.Printf("charging for %s\n", d.MessageId)
		return nil
	}))

	ch := rabbitmwtest.NewRecorder() // in production: the *amqp.Channel deliveries come from
	for range 2 {
		d := ch.Deliver(amqp.Publishing{MessageId: "order-42", Body: []byte(`{"amount":100}`)})
		err := h.Handle(context.Background(), d)
		rabbitmw.Settle(context.Background(), d, err)
		fmt.Printf("delivery %d: %s\n", d.DeliveryTag, rabbitmw.Decide(err).Outcome)
	}
	// Output:
	// charging for order-42
	// delivery 1: acked
	// delivery 2: duplicate
}

// A Settler holds a delayed delivery off the consumer's loop, so the
// deliveries after it settle at once. (A Recorder stands in for the channel
// here.)
func ExampleSettler() {
	s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
	ch := rabbitmwtest.NewRecorder() // in production: the *amqp.Channel deliveries come from
	for _, err := range []error{
		nil,
		rabbitmw.RetryAfter(errors.New("bank unreachable"), time.Minute),
		rabbitmw.Permanent(errors.New("malformed JSON")),
	} {
		d := ch.Deliver(amqp.Publishing{})
		s.Settle(context.Background(), d, err) // err: what the handler returned
		fmt.Printf("delivery %d: %s\n", d.DeliveryTag, ch.Settlement(d.DeliveryTag))
	}
	s.Close() // requeues at once what still waits out its delay
	fmt.Printf("after Close, delivery 2: %s\n", ch.Settlement(2))
	// Output:
	// delivery 1: acked
	// delivery 2: unsettled
	// delivery 3: dead-lettered
	// after Close, delivery 2: requeued
}

func ExampleDecide() {
	for _, err := range []error{
		nil,
		errors.New("timeout talking to the bank"),
		rabbitmw.RetryAfter(errors.New("rate limited"), 30*time.Second),
		rabbitmw.Permanent(errors.New("malformed JSON")),
		fmt.Errorf("seen before: %w", rabbitmw.ErrDuplicate),
	} {
		d := rabbitmw.Decide(err)
		fmt.Println(d.Outcome, d.Delay)
	}
	// Output:
	// acked 0s
	// requeued 0s
	// delayed 30s
	// dead-lettered 0s
	// duplicate 0s
}

// A layer beneath Retry that holds messages back, here a rate limit, marks
// its result NotCounted: the message waits, and Retry does not count the
// wait as one of its attempts.
func ExampleNotCounted() {
	errLimited := errors.New("rate limit of the payment API reached")
	limited := true
	rateLimit := func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			if limited {
				return rabbitmw.RetryAfter(rabbitmw.NotCounted(errLimited), 10*time.Second)
			}
			return next.Handle(ctx, d)
		})
	}
	charge := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	h := rabbitmw.Chain(
		middleware.Retry(store.NewMemory(), middleware.RetryOptions{MaxAttempts: 2}),
		rateLimit,
	)(charge)

	d := &amqp.Delivery{MessageId: "order-42"}
	for range 3 {
		dec := rabbitmw.Decide(h.Handle(context.Background(), d))
		fmt.Println(dec.Outcome, dec.Delay, "attempts counted:", dec.Attempts)
	}
	limited = false
	fmt.Println(rabbitmw.Decide(h.Handle(context.Background(), d)).Outcome)
	// Output:
	// delayed 10s attempts counted: 0
	// delayed 10s attempts counted: 0
	// delayed 10s attempts counted: 0
	// acked
}
