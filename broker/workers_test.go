package broker

import (
	"context"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/errtest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
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

// A handler's result whose tree is malformed (an error that wraps
// itself) is settled, rather than hang the worker that reads it: under
// Retry it is retried, then dead-lettered with its text, cut; a panic
// with such a value that escapes the chain is dead-lettered as a panic.
func TestMalformedChainIsSettled(t *testing.T) {
	f := setup(t, backends[0], Topology{})
	retry := middleware.Retry(store.NewMemory(), middleware.RetryOptions{MaxAttempts: 2, Backoff: func(int) time.Duration { return time.Millisecond }})
	r := f.consume(retry(rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		self := &errtest.Loop{}
		self.Next = self
		if d.MessageId == "panic" {
			panic(self)
		}
		return self
	})), ConsumeOptions{})
	f.publish("loop", []byte("x"), nil)
	f.publish("panic", []byte("x"), nil)
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 2 }, 20*time.Second, 10*time.Millisecond, "messages not dead-lettered")
	require.NoError(t, r.stop(t), "Consume after cancel")
	dead := map[string]amqp.Table{}
	for _, d := range f.drain(f.q + ".dlq") {
		dead[d.MessageId] = d.Headers
	}
	const cut = " (rabbitmw: malformed error chain cut: a cycle, or over 100 errors deep)"
	assert.Equal(t, "loop"+cut+" (middleware: retries exhausted after 2 attempts)", dead["loop"][HeaderError])
	assert.Equal(t, "malformed_chain", dead["loop"][HeaderErrorType])
	assert.Equal(t, "panic: loop", dead["panic"][HeaderError])
	assert.Equal(t, "panic", dead["panic"][HeaderErrorType])
}
