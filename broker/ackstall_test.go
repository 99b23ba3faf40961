package broker

import (
	"context"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// A stallTransport makes sessions whose acks, once stall is called, block
// until the session is closed: as amqp091's write blocks on a socket the
// server no longer reads (a resource alarm, a network that stops
// answering, or a publish blocked in its write holding the connection's
// lock), until the session's close closes the socket.
type stallTransport struct {
	transport.Transport
	once    sync.Once
	stalled chan struct{}

	mu       sync.Mutex
	sessions []*stallSession
}

func newStallTransport(tr transport.Transport) *stallTransport {
	return &stallTransport{Transport: tr, stalled: make(chan struct{})}
}

func (t *stallTransport) stall() { t.once.Do(func() { close(t.stalled) }) }

func (t *stallTransport) Dial(ctx context.Context, name string) (session, error) {
	s, err := t.Transport.Dial(ctx, name)
	if err != nil {
		return nil, err
	}
	ss := &stallSession{session: s, t: t, closing: make(chan struct{})}
	t.mu.Lock()
	t.sessions = append(t.sessions, ss)
	t.mu.Unlock()
	return ss, nil
}

// closeAll closes every session, ending the acks blocked.
func (t *stallTransport) closeAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, s := range t.sessions {
		s.Close()
	}
}

type stallSession struct {
	session
	t       *stallTransport
	once    sync.Once
	closing chan struct{}
	ack     *stallAck // the Acknowledger of every delivery of the session
}

func (s *stallSession) Consume(queue, tag string, prefetch int) (<-chan amqp.Delivery, error) {
	in, err := s.session.Consume(queue, tag, prefetch)
	if err != nil {
		return nil, err
	}
	out := make(chan amqp.Delivery)
	go func() { // ends when in is closed or s is
		defer close(out)
		for d := range in {
			if s.ack == nil {
				s.ack = &stallAck{Acknowledger: d.Acknowledger, s: s}
			}
			d.Acknowledger = s.ack
			select {
			case out <- d:
			case <-s.closing:
				return
			}
		}
	}()
	return out, nil
}

func (s *stallSession) Close() error {
	s.once.Do(func() { close(s.closing) })
	return s.session.Close()
}

type stallAck struct {
	amqp.Acknowledger
	s *stallSession
}

func (a *stallAck) Ack(tag uint64, multiple bool) error {
	select {
	case <-a.s.t.stalled:
		<-a.s.closing
		return amqp.ErrClosed
	default:
	}
	return a.Acknowledger.Ack(tag, multiple)
}

// An ack whose write blocks when Consume shuts down (the server stopped
// reading the socket) does not hang Consume: the acks kept are given a
// bounded time, then the session is closed, which ends the write, and the
// server redelivers the message.
func TestShutdownWithAnAckBlocked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		st := newStallTransport(f.b.tr)
		b := newBroker(st, f.b.cfg) // for Consume; f.b publishes
		ctx, cancel := context.WithCancel(context.Background())
		var err error
		done := make(chan struct{})
		go func() {
			defer close(done)
			err = b.Consume(ctx, f.q, rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }),
				ConsumeOptions{Workers: 4, Prefetch: 16, Topology: f.top})
		}()
		f.publish("m", nil, nil)
		synctest.Wait()
		equal(t, "unacked while its ack is kept", f.mem.Unacked(f.q), 1)
		st.stall()
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("Consume did not return within a minute of its cancellation with an ack blocked")
			st.closeAll() // ends the blocked write, and the test
			<-done
		}
		noErr(t, "Consume", err)
		equal(t, "returned by the close", f.mem.Stats().RequeuedOnClose, 1)
	})
}

// A session given up (a copy's confirm did not come within settleTimeout)
// while its acker is blocked in a write is closed all the same, and
// Consume connects again.
func TestGivenUpSessionWithAnAckBlocked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		st := newStallTransport(f.b.tr)
		st.stall()
		b := newBroker(st, f.b.cfg) // for Consume; f.b publishes
		f.publish("a", nil, nil)
		f.publish("x", nil, nil)
		f.mem.SetConfirmDelay(time.Hour) // for x's copy
		j := newJournal()
		ctx, cancel := context.WithCancel(context.Background())
		var err error
		done := make(chan struct{})
		go func() {
			defer close(done)
			err = b.Consume(ctx, f.q, rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
				if j.record(d) == 1 && d.MessageId == "x" {
					return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
				}
				return nil
			}), ConsumeOptions{Workers: 4, Prefetch: 16, Topology: f.top})
		}()
		time.Sleep(settleTimeout + time.Minute)
		synctest.Wait()
		equal(t, "consumer sessions", f.logs.count("broker: consuming"), 2)
		f.mem.SetConfirmDelay(0)
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("Consume did not return within a minute of its cancellation with an ack blocked")
			st.closeAll() // ends the blocked writes, and the test
			<-done
		}
		noErr(t, "Consume", err)
	})
}
