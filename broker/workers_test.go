package broker

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw"
)

// closedSession is a session that is already lost.
type closedSession struct{ session }

func (closedSession) Closed() <-chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

// A delivery taken from a session that has closed is not handled: it
// cannot be settled, and the server redelivers it. The worker's slot is
// freed.
func TestWorkerSkipsDeliveryOfClosedSession(t *testing.T) {
	var calls atomic.Int32
	c := &consumer{h: rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		calls.Add(1)
		return nil
	}), log: slog.New(slog.DiscardHandler), workers: 1, slots: make(chan struct{}, 1)}
	rec := &countingAcker{}
	deliveries := make(chan amqp.Delivery, 1)
	deliveries <- amqp.Delivery{Acknowledger: rec, DeliveryTag: 1}
	close(deliveries)
	a := newAcker("q", 1, 1, &Observer{}, c.log)
	defer a.close()
	newConn(c, closedSession{}, a, deliveries).work(context.Background())
	assert.Equal(t, int32(0), calls.Load(), "handler calls")
	assert.Equal(t, int32(0), rec.n.Load(), "settlements")
	assert.Equal(t, 0, len(c.slots), "slots held")
}

type countingAcker struct{ n atomic.Int32 }

func (a *countingAcker) Ack(uint64, bool) error { a.n.Add(1); return nil }

func (a *countingAcker) Nack(uint64, bool, bool) error { a.n.Add(1); return nil }

func (a *countingAcker) Reject(uint64, bool) error { a.n.Add(1); return nil }
