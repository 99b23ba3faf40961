package broker

import (
	"context"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// A stallTransport makes sessions whose writes of the kinds stall was
// called with (acks, nacks, basic.cancel) block until the session is
// closed: as amqp091's write blocks on a socket the server no longer reads
// (a resource alarm, a network that stops answering, or a publish blocked
// in its write holding the connection's lock), until the session's close
// closes the socket.
type stallTransport struct {
	transport.Transport
	once    sync.Once
	stalled chan struct{}
	ops     stallOps // set by stall, before stalled is closed

	mu       sync.Mutex
	sessions []*stallSession
}

func newStallTransport(tr transport.Transport) *stallTransport {
	return &stallTransport{Transport: tr, stalled: make(chan struct{})}
}

// stallOps are the writes a stallTransport blocks.
type stallOps uint8

const (
	stallAcks    stallOps = 1 << iota // basic.ack
	stallNacks                        // basic.nack and basic.reject
	stallCancel                       // basic.cancel
	stallDeclare                      // queue.declare and its bindings
	stallConsume                      // basic.qos and basic.consume
)

// stall makes the writes of ops block from now on. Only the first call
// counts.
func (t *stallTransport) stall(ops stallOps) {
	t.once.Do(func() {
		t.ops = ops
		close(t.stalled)
	})
}

// blocks blocks, and reports true once the session is closed, if op is
// stalled; otherwise it reports false at once.
func (s *stallSession) blocks(op stallOps) bool {
	select {
	case <-s.t.stalled:
		if s.t.ops&op == 0 {
			return false
		}
		<-s.closing
		return true
	default:
		return false
	}
}

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

func (s *stallSession) Declare(ctx context.Context, specs []queueSpec) error {
	s.blocks(stallDeclare) // once it returns true, s is closed: the call fails as on a closed session
	return s.session.Declare(ctx, specs)
}

func (s *stallSession) Consume(queue, tag string, prefetch int) (<-chan amqp.Delivery, error) {
	s.blocks(stallConsume)
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

func (s *stallSession) Cancel(tag string) error {
	if s.blocks(stallCancel) {
		return amqp.ErrClosed
	}
	return s.session.Cancel(tag)
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
	if a.s.blocks(stallAcks) {
		return amqp.ErrClosed
	}
	return a.Acknowledger.Ack(tag, multiple)
}

func (a *stallAck) Nack(tag uint64, multiple, requeue bool) error {
	if a.s.blocks(stallNacks) {
		return amqp.ErrClosed
	}
	return a.Acknowledger.Nack(tag, multiple, requeue)
}

func (a *stallAck) Reject(tag uint64, requeue bool) error {
	if a.s.blocks(stallNacks) {
		return amqp.ErrClosed
	}
	return a.Acknowledger.Reject(tag, requeue)
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
		assert.Equal(t, 1, f.mem.Unacked(f.q), "unacked while its ack is kept")
		st.stall(stallAcks)
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("Consume did not return within a minute of its cancellation with an ack blocked")
			st.closeAll() // ends the blocked write, and the test
			<-done
		}
		require.NoError(t, err, "Consume")
		assert.Equal(t, 1, f.mem.Stats().RequeuedOnClose, "returned by the close")
	})
}

// A session given up (a copy's confirm did not come within settleTimeout)
// while its acker is blocked in a write is closed all the same, and
// Consume connects again.
func TestGivenUpSessionWithAnAckBlocked(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		st := newStallTransport(f.b.tr)
		st.stall(stallAcks)
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
		assert.Equal(t, 2, f.logs.Count("broker: consuming"), "consumer sessions")
		f.mem.SetConfirmDelay(0)
		cancel()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Error("Consume did not return within a minute of its cancellation with an ack blocked")
			st.closeAll() // ends the blocked writes, and the test
			<-done
		}
		require.NoError(t, err, "Consume")
	})
}

// consumeStalled runs Consume of f.q on b, with h and opts, until ctx is
// cancelled, and returns a function that waits for it to return: it fails
// the test if that takes a minute (of the bubble's time) after it is
// called, closing st's sessions to end the blocked writes. It returns
// Consume's error and how long it took to return.
func consumeStalled(ctx context.Context, f *fixture, st *stallTransport, h rabbitmw.HandlerFunc, opts ConsumeOptions) (wait func(t *testing.T, what string) (error, time.Duration)) {
	b := newBroker(st, f.b.cfg) // for Consume; f.b publishes
	opts.Topology = f.top
	var err error
	done := make(chan struct{})
	go func() {
		defer close(done)
		err = b.Consume(ctx, f.q, h, opts)
	}()
	return func(t *testing.T, what string) (error, time.Duration) {
		t.Helper()
		start := time.Now()
		select {
		case <-done:
		case <-time.After(time.Minute):
			t.Errorf("Consume did not return within a minute with %s", what)
			st.closeAll() // ends the blocked writes, and the test
			<-done
		}
		return err, time.Since(start)
	}
}

// Writes blocked at the end of a consumer (the server stopped reading the
// socket) do not hang Consume: basic.cancel and the requeues of the
// deliveries not started are given closeTimeout, then the session is
// closed, which ends them; the server requeues what was not settled. The
// acks kept go first, and the handler in flight finishes and is acked.
func TestShutdownWithWritesBlocked(t *testing.T) {
	for _, tc := range []struct {
		name  string
		stall stallOps
		// serverCancel ends the consumer by deleting its queue (a fatal
		// error) instead of cancelling Consume's context.
		serverCancel bool
		wantErr      error
		// handlerTakes is how long a's handler runs after the end.
		handlerTakes time.Duration
	}{
		{name: "basic.cancel blocked", stall: stallCancel},
		// a's ack is kept when the session is closed: it goes first.
		{name: "basic.cancel blocked, an ack kept at the deadline", stall: stallCancel, handlerTakes: closeTimeout - time.Millisecond},
		{name: "requeues blocked", stall: stallNacks},
		{name: "basic.cancel and requeues blocked", stall: stallCancel | stallNacks},
		{name: "requeues blocked after the server cancelled", stall: stallNacks, serverCancel: true, wantErr: ErrConsumerCancelled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := setup(t, backends[0], Topology{})
				st := newStallTransport(f.b.tr)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				release := make(chan struct{})
				// One worker: a is in its handler when the consumer
				// ends, b and c are received and not started.
				wait := consumeStalled(ctx, f, st, func(_ context.Context, d *amqp.Delivery) error {
					if d.MessageId == "a" {
						<-release
						time.Sleep(tc.handlerTakes)
					}
					return nil
				}, ConsumeOptions{Workers: 1, Prefetch: 16})
				for _, id := range []string{"a", "b", "c"} {
					f.publish(id, nil, nil)
				}
				synctest.Wait()
				st.stall(tc.stall)
				if tc.serverCancel {
					require.NoError(t, f.b.Delete(context.Background(), f.q, f.top), "Delete")
				} else {
					cancel()
				}
				synctest.Wait()
				close(release)
				err, took := wait(t, tc.name)
				if tc.wantErr != nil {
					require.ErrorIs(t, err, tc.wantErr, "Consume")
					// Declare again for the cleanup's Delete.
					require.NoError(t, f.b.Declare(context.Background(), f.q, f.top), "Declare")
				} else {
					require.NoError(t, err, "Consume")
				}
				if max := 2 * closeTimeout; took > max {
					t.Errorf("Consume returned %v after the end; want at most %v", took, max)
				}
				// Nothing acked but a; b and c back in the queue (given
				// back, or returned by the close; a worker may have given
				// back b, and had it again).
				assert.Equal(t, 1, f.mem.Stats().Acked, "acked (a, in flight)")
				if !tc.serverCancel {
					assert.Equal(t, 2, f.length(f.q), "ready (b, c)")
					assert.Equal(t, 0, f.mem.Unacked(f.q), "unacked")
				}
			})
		})
	}
}

// A consumer whose set-up the server does not answer (a quorum queue that
// lost its majority holds basic.consume, and queue.declare, until its
// members elect a leader) stops when its context is cancelled: the calls
// that do not watch the context are ended by closing the session.
func TestShutdownWithTheSetUpBlocked(t *testing.T) {
	for _, tc := range []struct {
		name  string
		stall stallOps
	}{
		{"queue.declare", stallDeclare},
		{"basic.consume", stallConsume},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := setup(t, backends[0], Topology{})
				st := newStallTransport(f.b.tr)
				st.stall(tc.stall)
				ctx, cancel := context.WithCancel(context.Background())
				wait := consumeStalled(ctx, f, st, func(context.Context, *amqp.Delivery) error { return nil },
					ConsumeOptions{Workers: 1, Prefetch: 1})
				time.Sleep(time.Minute) // the server holds the call, for as long as it takes
				synctest.Wait()
				assert.Equal(t, 0, f.logs.Count("broker: consuming"), "consumer sessions")
				cancel()
				err, took := wait(t, tc.name+" blocked")
				require.NoError(t, err, "Consume")
				if max := 2 * closeTimeout; took > max {
					t.Errorf("Consume returned %v after its cancellation; want at most %v", took, max)
				}
			})
		})
	}
}
