package broker

import (
	"context"
	"sync/atomic"
	"testing"
	"testing/synctest"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// A hookTransport makes sessions that call afterDeclare or afterConsume,
// if set, when their Declare or Consume has returned and before the
// consumer sees the result: a stop that comes just as the server answers
// the consumer's set-up.
type hookTransport struct {
	transport.Transport
	afterDeclare, afterConsume func()
}

func (t *hookTransport) Dial(ctx context.Context, name string) (session, error) {
	s, err := t.Transport.Dial(ctx, name)
	if err != nil {
		return nil, err
	}
	return &hookSession{session: s, t: t}, nil
}

type hookSession struct {
	session
	t *hookTransport
}

func (s *hookSession) Declare(ctx context.Context, specs []queueSpec) error {
	err := s.session.Declare(ctx, specs)
	if s.t.afterDeclare != nil {
		s.t.afterDeclare()
	}
	return err
}

func (s *hookSession) Consume(queue, tag string, prefetch int) (<-chan amqp.Delivery, error) {
	d, err := s.session.Consume(queue, tag, prefetch)
	if s.t.afterConsume != nil {
		s.t.afterConsume()
	}
	return d, err
}

// A stop that comes as basic.consume is answered, the server having
// already pushed deliveries, ends the consumer before it consumes: no
// delivery is handled or acked, the close returns them all to the queue,
// and Consume returns nil, logging its stop once.
func TestShutdownAsTheSetUpEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		for _, id := range []string{"a", "b", "c"} {
			f.publish(id, nil, nil)
		}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		b := newBroker(&hookTransport{Transport: f.b.tr, afterConsume: cancel}, f.b.cfg)
		var handled atomic.Int32
		err := b.Consume(ctx, f.q, rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
			handled.Add(1)
			return nil
		}), ConsumeOptions{Workers: 4, Prefetch: 16, Topology: f.top})
		require.NoError(t, err, "Consume")
		assert.Zero(t, handled.Load(), "deliveries handled")
		st := f.mem.Stats()
		assert.Zero(t, st.Acked, "acked")
		assert.Equal(t, 3, st.RequeuedOnClose, "returned to the queue by the close")
		assert.Equal(t, 3, f.length(f.q), "ready")
		assert.Zero(t, f.mem.Unacked(f.q), "unacked")
		assert.Zero(t, f.logs.Count("broker: consuming"), "consumer sessions")
		assert.Equal(t, 1, f.logs.Count("INFO broker: consumer stopped"), "stops logged")
		assert.Zero(t, f.logs.Count("fatal"), "fatal errors logged")
	})
}

// A server's refusal of the consumer's set-up that comes as Consume's
// context is cancelled is a fatal error all the same: the stop closes the
// session, but did not cause the refusal, and a queue with other
// arguments must not pass for a clean stop.
func TestShutdownAsTheSetUpIsRefused(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		// The user's queue, declared without a dead-letter exchange.
		q := f.q + "-user"
		top := Topology{Delays: testTiers}
		t.Cleanup(func() { _ = f.b.Delete(context.Background(), q, top) })
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		err := f.b.do(ctx, "declare", func(s session) error { return s.Declare(ctx, []queueSpec{{Name: q}}) })
		require.NoError(t, err, "declare the user's queue")

		b := newBroker(&hookTransport{Transport: f.b.tr, afterDeclare: cancel}, f.b.cfg)
		err = b.Consume(ctx, q, rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }),
			ConsumeOptions{Workers: 1, Topology: top})
		require.ErrorIs(t, err, ErrQueueArguments, "Consume")
		assert.Equal(t, 1, f.logs.Count("broker: consumer stopped by a fatal error"), "fatal errors logged")
		assert.Zero(t, f.logs.Count("INFO broker: consumer stopped"), "clean stops logged")
	})
}

// A transport whose sessions' Declare waits for the server's answer,
// which does not come, until its context ends, and then returns the
// context's error, as a session's calls of the server do.
type silentDeclareTransport struct{ transport.Transport }

func (t silentDeclareTransport) Dial(ctx context.Context, name string) (session, error) {
	s, err := t.Transport.Dial(ctx, name)
	if err != nil {
		return nil, err
	}
	return silentDeclareSession{s}, nil
}

type silentDeclareSession struct{ session }

func (silentDeclareSession) Declare(ctx context.Context, _ []queueSpec) error {
	<-ctx.Done()
	return ctx.Err()
}

// A stop that comes while Consume declares its topology, the declaration
// returning the stop's own context error, ends Consume with nil, as a stop
// does: it is not a fatal error.
func TestStopWhileDeclaring(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		b := newBroker(silentDeclareTransport{f.b.tr}, f.b.cfg)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- b.Consume(ctx, f.q, rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }),
				ConsumeOptions{Topology: f.top})
		}()
		synctest.Wait() // Consume waits in its declaration
		cancel()
		require.NoError(t, <-done, "Consume")
	})
}
