package broker_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
)

// A consumer on the in-memory server of package brokertest: one message
// is handled, one is retried after a delay, one is dead-lettered; the
// handler then cancels the consumer, which stops gracefully.
func ExampleNew_inMemory() {
	srv := brokertest.NewServer()
	defer srv.Close()
	b := broker.New(srv.URL(), broker.Options{})
	defer b.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	top := broker.Topology{Delays: []time.Duration{100 * time.Millisecond, time.Second}}
	if err := b.Declare(ctx, "orders", top); err != nil {
		log.Fatal(err)
	}
	for _, id := range []string{"1", "2", "3"} {
		msg := amqp.Publishing{MessageId: id, Body: []byte("order " + id)}
		if err := b.Publish(ctx, "", "orders", msg); err != nil {
			log.Fatal(err)
		}
	}

	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		switch {
		case d.MessageId == "2" && rabbitmw.PriorAttempts(d) == 0:
			fmt.Println("order 2 failed: retry in 100ms")
			return rabbitmw.RetryAfter(rabbitmw.WithAttempts(errors.New("stock service down"), 1), 100*time.Millisecond)
		case d.MessageId == "3":
			fmt.Println("order 3 is invalid: dead-letter it")
			return rabbitmw.Permanent(errors.New("invalid order"))
		}
		fmt.Printf("%s handled (attempt %d)\n", d.Body, rabbitmw.PriorAttempts(d)+1)
		if d.MessageId == "2" {
			cancel() // stop consuming; this delivery is still acked
		}
		return nil
	})
	err := b.Consume(ctx, "orders", h, broker.ConsumeOptions{Workers: 1, Topology: top})
	fmt.Println("Consume returned:", err)

	dead, _, _ := b.Get(context.Background(), "orders.dlq")
	fmt.Printf("dead-lettered: %s, because %q\n", dead.Body, dead.Headers[broker.HeaderError])
	// Output:
	// order 1 handled (attempt 1)
	// order 2 failed: retry in 100ms
	// order 3 is invalid: dead-letter it
	// order 2 handled (attempt 2)
	// Consume returned: <nil>
	// dead-lettered: order 3, because "invalid order"
}

// Consuming from RabbitMQ until the process is interrupted.
func ExampleBroker_Consume() {
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	b := broker.New("amqp://guest:guest@127.0.0.1:5672/", broker.Options{Logger: logger})
	defer b.Close()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	handler := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		// Process d.Body; return nil, or an error that says what to do.
		return nil
	})
	// Declares orders, orders.dlq and orders.delay.*; blocks until ctx is
	// cancelled (nil) or a fatal error.
	if err := b.Consume(ctx, "orders", handler, broker.ConsumeOptions{Workers: 8}); err != nil {
		logger.Error("consumer stopped", "error", err)
	}
}

// Publishing with confirms: Publish returns once RabbitMQ has the message.
func ExampleBroker_Publish() {
	b := broker.New("amqp://guest:guest@127.0.0.1:5672/", broker.Options{})
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := b.Publish(ctx, "", "orders", amqp.Publishing{ContentType: "application/json", Body: []byte(`{"id":1}`)})
	switch {
	case errors.Is(err, broker.ErrUnroutable):
		log.Print("no queue named orders")
	case err != nil:
		log.Print(err)
	}
}

// A work queue fed by a topic exchange: the consumer declares the exchange
// "events", binds its queue to it with "order.*", and handles what the
// producers publish there. A key the binding does not match is returned
// to its publisher as unroutable, not dropped.
func ExampleTopology_exchanges() {
	srv := brokertest.NewServer() // or RabbitMQ: the same code
	defer srv.Close()
	b := broker.New(srv.URL(), broker.Options{})
	defer b.Close()

	top := broker.Topology{
		Exchanges: []broker.Exchange{{Name: "events", Kind: broker.ExchangeTopic}},
		Bindings:  []broker.Binding{{Exchange: "events", Key: "order.*"}},
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := b.Declare(ctx, "orders", top); err != nil {
		log.Fatal(err)
	}
	for _, key := range []string{"order.created", "user.created", "order.paid"} {
		err := b.Publish(ctx, "events", key, amqp.Publishing{Body: []byte(key)})
		if errors.Is(err, broker.ErrUnroutable) {
			fmt.Println(key, "reached no queue")
		}
	}

	n := 0
	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		fmt.Printf("%s from %q\n", d.Body, d.Exchange)
		if n++; n == 2 {
			cancel()
		}
		return nil
	})
	if err := b.Consume(ctx, "orders", h, broker.ConsumeOptions{Workers: 1, Topology: top}); err != nil {
		log.Fatal(err)
	}
	// Output:
	// user.created reached no queue
	// order.created from "events"
	// order.paid from "events"
}
