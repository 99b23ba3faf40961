package brokertest_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
)

// A Broker on a Server: publish a message and take it back.
func ExampleNewServer() {
	srv := brokertest.NewServer()
	defer srv.Close()
	b := broker.New(srv.URL(), broker.Options{})
	defer b.Close()

	ctx := context.Background()
	if err := b.Declare(ctx, "orders", broker.Topology{}); err != nil {
		log.Fatal(err)
	}
	if err := b.Publish(ctx, "", "orders", amqp.Publishing{MessageId: "1", Body: []byte("order 1")}); err != nil {
		log.Fatal(err)
	}
	d, _, err := b.Get(ctx, "orders")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s, unacked: %d\n", d.Body, srv.Unacked("orders"))
	_ = d.Ack(false)
	fmt.Printf("unacked after the ack: %d, connection attempts: %d\n", srv.Unacked("orders"), srv.Stats().Dials)
	// Output:
	// order 1, unacked: 1
	// unacked after the ack: 0, connection attempts: 1
}

// Each Server has a URL of its own; a Broker for the URL of a closed
// Server, or of none, fails at once with broker.ErrClosed instead of
// retrying.
func TestURL(t *testing.T) {
	a, b := brokertest.NewServer(), brokertest.NewServer()
	defer b.Close()
	if a.URL() == b.URL() {
		t.Fatalf("two servers at %q; want a URL each", a.URL())
	}
	a.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, url := range []string{a.URL(), "memory://none"} {
		br := broker.New(url, broker.Options{})
		_, err := br.Len(ctx, "q")
		assert.ErrorIs(t, err, broker.ErrClosed, "Len on a Broker for %s", url)
		if ctx.Err() != nil {
			t.Errorf("Len on a Broker for %s retried until its context ended; want a fatal error", url)
		}
		br.Close()
	}
	br := broker.New(b.URL(), broker.Options{})
	defer br.Close()
	if _, err := br.Len(ctx, "q"); !errors.Is(err, broker.ErrQueueNotFound) {
		t.Errorf("Len of a missing queue on an open server = %v; want an error wrapping broker.ErrQueueNotFound", err)
	}
}
