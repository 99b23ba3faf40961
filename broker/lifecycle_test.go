package broker

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
)

// The consumer's lifecycle: what becomes of handlers and their results when
// a connection is lost and when Consume shuts down. The tests named Test…
// run on the memory server in a synctest bubble, where time is the test's;
// the test… functions are cases of the behaviours table.

// A gauge counts the handlers running, and the most that ran at once.
type gauge struct {
	mu       sync.Mutex
	now, max int
}

// enter counts a handler in; the returned func counts it out.
func (g *gauge) enter() (leave func()) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.now++
	g.max = max(g.max, g.now)
	return func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.now--
	}
}

func (g *gauge) most() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.max
}

// A gate is a channel that handlers wait on, opened once by the test or,
// at the latest, when the test ends, so that no handler outlives it.
type gate struct {
	once sync.Once
	ch   chan struct{}
}

func newGate(t *testing.T) *gate {
	g := &gate{ch: make(chan struct{})}
	t.Cleanup(g.open)
	return g
}

func (g *gate) open() { g.once.Do(func() { close(g.ch) }) }

// started returns the number of calls of the ids with prefix.
func (j *journal) started(prefix string) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	n := 0
	for id, calls := range j.calls {
		if strings.HasPrefix(id, prefix) {
			n += len(calls)
		}
	}
	return n
}

// A handler still running when its connection is lost does not hold up
// the reconnection: a delivery of the new connection is handled while it
// runs. It keeps its worker: with it, never more than Workers handlers run.
func TestSlowHandlerDoesNotStallReconnection(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		var g gauge
		slow, next := newGate(t), newGate(t)
		j := newJournal()
		r := f.consume(slowThenNext(&g, j, slow, next), ConsumeOptions{Workers: 2})
		f.publish("slow", nil, nil)
		synctest.Wait()
		assert.Equal(t, 1, len(j.callsOf("slow")), "handler calls of slow")

		f.mem.CloseConnections()
		time.Sleep(time.Second) // past the reconnection backoff
		for i := range 3 {
			f.publish(fmt.Sprint("next", i), nil, nil)
		}
		synctest.Wait()
		assert.Equal(t, 2, f.logs.Count("broker: consuming"), "consumer sessions while the slow handler runs")
		assert.Equal(t, 1, f.logs.Count("WARN broker: connection lost"), "records of the lost connection")
		assert.Equal(t, 2, len(j.callsOf("slow")), "handler calls of slow (the first still running, its redelivery done)")
		assert.Equal(t, 1, j.started("next"), "new deliveries started while the slow handler runs")
		assert.Equal(t, 2, g.most(), "most handlers at once")

		slow.open() // its slot goes to the next delivery
		synctest.Wait()
		assert.Equal(t, 2, j.started("next"), "new deliveries started once the slow handler returned")
		next.open()
		synctest.Wait()
		assert.Equal(t, 3, j.started("next"), "new deliveries handled")
		assert.Equal(t, 2, g.most(), "most handlers at once")
		require.NoError(t, r.stop(t), "Consume after cancel")
		f.assertSettled(t)
	})
}

// At shutdown, Consume accounts for the handlers of a lost connection as
// for its own: it waits for them until the deadline, then cancels their
// context, and gives up on those that still run after the grace.
func TestShutdownWaitsForHandlersOfLostConnections(t *testing.T) {
	for _, c := range []struct {
		name     string
		honours  bool // the handler returns when its context is cancelled
		wantTook time.Duration
		wantErr  error
	}{
		{"HandlerReturnsAtTheDeadline", true, 5 * time.Second, nil},
		{"HandlerIgnoresItsContext", false, 5*time.Second + shutdownGrace, ErrShutdownTimeout},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := setup(t, backends[0], Topology{})
				stuck := newGate(t)
				var returned atomic.Bool
				j := newJournal()
				r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					if j.record(d) > 1 {
						return nil
					}
					defer returned.Store(true)
					if c.honours {
						<-ctx.Done()
						return ctx.Err()
					}
					<-stuck.ch
					return nil
				}), ConsumeOptions{Workers: 2, ShutdownTimeout: 5 * time.Second})
				f.publish("slow", nil, nil)
				synctest.Wait()
				f.mem.CloseConnections()
				time.Sleep(time.Second)
				synctest.Wait()
				assert.Equal(t, 2, len(j.callsOf("slow")), "handler calls (the first still running, the redelivery done)")

				begin := time.Now()
				r.cancel()
				err := r.wait(t, time.Minute)
				took := time.Since(begin)
				if c.wantErr == nil {
					require.NoError(t, err, "Consume")
				} else {
					require.ErrorIs(t, err, c.wantErr, "Consume")
					assert.Contains(t, err.Error(), "1 handlers did not return", "error")
					assert.Equal(t, 1, strings.Count(err.Error(), "did not return"), "reports of the handlers in the error")
				}
				assert.Equal(t, c.wantTook, took, "Consume returned after")
				assert.Equal(t, c.honours, returned.Load(), "the lost connection's handler returned before Consume")
			})
		})
	}
}

// The reconnection backoff starts again from its minimum once a session is
// consuming, however soon it is lost: cuts right after each reconnection
// must not make the waits grow.
func TestReconnectionBackoffResetsOnceConsuming(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		logs := fixtures.NewLogRecorder(t)
		m := brokertest.NewServer()
		t.Cleanup(m.Close)
		const minimum = time.Second
		b := New(m.URL(), Options{Logger: slog.New(logs), ReconnectMin: minimum, ReconnectMax: time.Hour})
		t.Cleanup(func() { b.Close() })
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() {
			done <- b.Consume(ctx, "q", rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }),
				ConsumeOptions{Topology: Topology{Delays: testTiers}})
		}()
		const cuts = 10
		begin := time.Now()
		for i := range cuts {
			for logs.Count("broker: consuming") < i+1 {
				if time.Since(begin) > 24*time.Hour {
					t.Fatalf("consumer sessions after a day = %d; want %d", logs.Count("broker: consuming"), i+1)
				}
				time.Sleep(10 * time.Millisecond)
			}
			m.CloseConnections() // at once: the session lasted no time
		}
		for logs.Count("broker: consuming") < cuts+1 {
			time.Sleep(10 * time.Millisecond)
		}
		took := time.Since(begin)
		cancel()
		require.NoError(t, <-done, "Consume after cancel")
		waits := retryWaits(t, logs)
		assert.Equal(t, cuts, len(waits), "reconnections")
		for i, w := range waits {
			if w > minimum {
				t.Errorf("wait before reconnection %d = %v; want <= %v (ReconnectMin: the session before was consuming)", i+1, w, minimum)
			}
		}
		if took > cuts*minimum+time.Second {
			t.Errorf("%d reconnections took %v; want at most about %v", cuts, took, cuts*minimum)
		}
	})
}

var retryIn = regexp.MustCompile(`retry_in="([^"]+)"`)

// retryWaits returns the waits logged before reconnections, in order.
func retryWaits(t *testing.T, logs *fixtures.LogRecorder) []time.Duration {
	t.Helper()
	var waits []time.Duration
	for _, r := range logs.All() {
		if !strings.Contains(r, "broker: reconnecting") {
			continue
		}
		m := retryIn.FindStringSubmatch(r)
		if m == nil {
			t.Fatalf("reconnection record without retry_in: %s", r)
		}
		d, err := time.ParseDuration(m[1])
		require.NoError(t, err, "parse retry_in")
		waits = append(waits, d)
	}
	return waits
}

// ids returns how many copies of each message id the work queue, its
// delay queues and its dead-letter queue hold, taking them out.
func (f *fixture) ids() map[string]int {
	f.t.Helper()
	top, err := f.top.resolve(f.q)
	require.NoError(f.t, err, "resolve")
	n := map[string]int{}
	for _, q := range top.names() {
		for _, d := range f.drain(q) {
			n[d.MessageId]++
		}
	}
	return n
}

// Handlers that return a delay or a dead-letter after the shutdown
// deadline cancelled their context, on a server whose confirms take a
// moment: each result is settled once, under a context of its own. No
// message exists twice (a copy in a delay queue or the dead-letter queue,
// and the original requeued), none is lost.
func TestResultsAfterTheShutdownDeadlineSettledOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		lateResults(t, f, func() { f.mem.SetConfirmDelay(10 * time.Millisecond) })
	})
}

// testLateResults is TestResultsAfterTheShutdownDeadlineSettledOnce on
// both backends, with the real clock.
func testLateResults(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	lateResults(t, f, func() {})
}

func lateResults(t *testing.T, f *fixture, slowConfirms func()) {
	const workers = 4
	ids := []string{"r0", "p0", "r1", "p1", "r2", "p2", "r3", "p3"}
	for _, id := range ids {
		f.publish(id, []byte("x"), nil)
	}
	slowConfirms()
	var mu sync.Mutex
	settled := map[string][]string{}
	started := make(chan string, len(ids))
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		started <- d.MessageId
		<-ctx.Done() // the shutdown deadline
		if strings.HasPrefix(d.MessageId, "r") {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		return rabbitmw.Permanent(errBoom)
	}), ConsumeOptions{Workers: workers, Prefetch: len(ids), ShutdownTimeout: 100 * time.Millisecond,
		OnSettle: func(d *amqp.Delivery, o rabbitmw.Outcome, err error) {
			mu.Lock()
			defer mu.Unlock()
			settled[d.MessageId] = append(settled[d.MessageId], fmt.Sprintf("%v %v", o, err))
		}})
	inFlight := map[string]bool{}
	for range workers {
		select {
		case id := <-started:
			inFlight[id] = true
		case <-time.After(20 * time.Second):
			t.Fatalf("handlers started = %d; want %d", len(inFlight), workers)
		}
	}
	require.NoError(t, r.stop(t), "Consume after a shutdown past its deadline")
	// The delayed copies come back to the work queue (RabbitMQ moves them
	// out of the delay queue a moment before they are in the work queue).
	require.Eventually(t, func() bool {
		return f.polledLength(f.q+".delay.50ms") == 0 && f.polledLength(f.q)+f.polledLength(f.q+".dlq") >= len(ids)
	}, 20*time.Second, 10*time.Millisecond, "delayed copies not back")
	copies := f.ids()
	for _, id := range ids {
		if n := copies[id]; n != 1 {
			t.Errorf("copies of %s (handler started: %t) = %d; want 1", id, inFlight[id], n)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for id := range inFlight {
		want := rabbitmw.Delay.String() + " <nil>"
		if strings.HasPrefix(id, "p") {
			want = rabbitmw.DeadLetter.String() + " <nil>"
		}
		assert.Equal(t, []string{want}, settled[id], "settlements of "+id)
	}
}

// A result that comes just before the end of the grace is settled even if
// its confirm comes after it: Consume waits for the settlement.
func TestSettlementInProgressAtTheEndOfTheGrace(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		f.publish("x", []byte("x"), nil)
		f.mem.SetConfirmDelay(time.Second)
		r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			<-ctx.Done()
			time.Sleep(shutdownGrace / 2)
			return rabbitmw.Permanent(errBoom)
		}), ConsumeOptions{ShutdownTimeout: time.Second})
		synctest.Wait()
		begin := time.Now()
		require.NoError(t, r.stop(t), "Consume")
		assert.Equal(t, time.Second+shutdownGrace/2+time.Second, time.Since(begin), "Consume returned after")
		f.mem.SetConfirmDelay(0)
		assert.Equal(t, map[string]int{"x": 1}, f.ids(), "copies")
	})
}

// A confirm that comes after a long wait still settles the original: it is
// acked then, neither requeued while its copy exists nor lost.
func TestLateConfirmSettlesTheOriginal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		f.publish("x", []byte("x"), nil)
		f.mem.SetConfirmDelay(40 * time.Second)
		j := newJournal()
		r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			if j.record(d) == 1 {
				return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
			}
			return nil
		}), ConsumeOptions{})
		time.Sleep(time.Minute)
		synctest.Wait()
		assert.Equal(t, 2, len(j.callsOf("x")), "handler calls (the original, its delayed copy)")
		assert.Equal(t, 0, f.mem.Stats().Nacked, "deliveries nacked with requeue")
		assert.Equal(t, 1, f.logs.Count("broker: consuming"), "consumer sessions")
		f.mem.SetConfirmDelay(0)
		require.NoError(t, r.stop(t), "Consume after cancel")
		f.assertSettled(t)
	})
}

// A copy whose confirm never comes, to a delay queue or to the
// dead-letter queue: the original is not requeued while its copy may
// exist; the session is given up after settleTimeout, and the server
// redelivers the original. This is the window the docs name: the message
// then exists twice.
func TestConfirmThatNeverComesGivesTheSessionUp(t *testing.T) {
	for _, c := range []struct {
		name  string
		first error // the first handler call's result
		calls int   // handler calls: the original, its copy if it comes back, the original again
	}{
		{"delay", rabbitmw.RetryAfter(errBoom, 50*time.Millisecond), 3},
		{"dead-letter", rabbitmw.Permanent(errBoom), 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := setup(t, backends[0], Topology{})
				f.publish("x", []byte("x"), nil)
				f.mem.SetConfirmDelay(time.Hour)
				j := newJournal()
				r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					if j.record(d) == 1 {
						return c.first
					}
					return nil
				}), ConsumeOptions{})
				time.Sleep(settleTimeout + time.Minute)
				synctest.Wait()
				s := f.mem.Stats()
				assert.Equal(t, 0, s.Nacked, "deliveries nacked with requeue")
				assert.Equal(t, 1, s.RequeuedOnClose, "deliveries returned by the connection's close")
				assert.Equal(t, 2, f.logs.Count("broker: consuming"), "consumer sessions")
				assert.Equal(t, 1, f.logs.Count("WARN", c.name+" copy not confirmed", `message_id="x"`), "warnings about the copy")
				assert.Equal(t, c.calls, len(j.callsOf("x")), "handler calls")
				f.mem.SetConfirmDelay(0)
				require.NoError(t, r.stop(t), "Consume after cancel")
			})
		})
	}
}

// A publish whose context is done already sends nothing.
func testPublishWithDoneContext(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 20*time.Second)
	done, cancel := context.WithCancel(ctx)
	cancel()
	var late, barrier error
	require.NoError(t, f.b.do(ctx, "publish", func(s session) error {
		late = s.Publish(done, "", f.q, amqp.Publishing{MessageId: "late", Body: []byte("x")})
		// Confirmed after the first would be, on the same channel.
		barrier = s.Publish(ctx, "", f.q, amqp.Publishing{MessageId: "barrier", Body: []byte("x")})
		return nil
	}), "session")
	require.ErrorIs(t, late, context.Canceled, "publish with a done context")
	require.NoError(t, barrier, "publish with a live context")
	got := f.drain(f.q)
	var sent []string
	for _, d := range got {
		sent = append(sent, d.MessageId)
	}
	assert.Equal(t, []string{"barrier"}, sent, "messages in the queue")
}

// testSlowHandlerReconnects is TestSlowHandlerDoesNotStallReconnection on
// both backends, with the real clock.
func testSlowHandlerReconnects(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	before := goleak.IgnoreCurrent()
	var g gauge
	slow, next := newGate(t), newGate(t)
	j := newJournal()
	r := f.consume(slowThenNext(&g, j, slow, next), ConsumeOptions{Workers: 2})
	f.publish("slow", nil, nil)
	require.Eventually(t, func() bool { return len(j.callsOf("slow")) == 1 }, 20*time.Second, 10*time.Millisecond, "slow not started")
	f.be.drop(t, f.mem, f.process)
	for i := range 3 {
		f.publish(fmt.Sprint("next", i), nil, nil)
	}
	require.Eventually(t, func() bool {
		return j.started("next") >= 1
	}, 20*time.Second, 10*time.Millisecond, "no new delivery handled while the lost connection's handler runs")
	slow.open()
	require.Eventually(t, func() bool { return j.started("next") >= 2 }, 20*time.Second, 10*time.Millisecond, "second new delivery not started")
	next.open()
	require.Eventually(t, func() bool { return j.started("next") == 3 }, 20*time.Second, 10*time.Millisecond, "new deliveries not handled")
	require.NoError(t, r.stop(t), "Consume after cancel")
	assert.Equal(t, 2, g.most(), "most handlers at once (Workers)")
	f.assertSettled(t)
	if f.mem != nil {
		// Every goroutine of the Consume call ended with it, the lost
		// session's handler included. (On RabbitMQ, the Broker's shared
		// connection, dialled again after the drop, has goroutines too.)
		goleak.VerifyNone(t, before)
	}
}

// Many reconnects leave no goroutine behind while Consume keeps running:
// each session's pumps end with it, and each handler's goroutine with its
// handler. The goroutines are compared at two moments when Consume has no
// session (the server is down, and refused its last attempt): before the
// first session, and after the twenty-first.
func TestReconnectsLeakNothing(t *testing.T) {
	f := setupWith(t, backends[0], Topology{}, 20*time.Millisecond)
	t.Cleanup(func() { f.mem.SetDown(false) }) // for the Delete of setup's cleanup
	// downAndRefused puts the server down, closes every connection, and
	// waits until the consumer's next attempt to connect was refused.
	downAndRefused := func() {
		t.Helper()
		f.mem.SetDown(true)
		f.mem.CloseConnections()
		dials := f.mem.Stats().Dials
		require.Eventually(t, func() bool {
			return f.mem.Stats().Dials > dials
		}, 10*time.Second, 10*time.Millisecond, "no connection attempt while the server is down")
	}
	f.mem.SetDown(true)
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return nil
	}), ConsumeOptions{Workers: 4})
	downAndRefused()
	before := goleak.IgnoreCurrent()
	f.mem.SetDown(false)

	sessions := func() int { return f.logs.Count("broker: consuming") }
	require.Eventually(t, func() bool { return sessions() == 1 }, 10*time.Second, 10*time.Millisecond, "not consuming")
	for i := range 20 {
		f.mem.CloseConnections()
		require.Eventually(t, func() bool { return sessions() == i+2 }, 10*time.Second, 10*time.Millisecond, "consumer did not reconnect")
		f.publish(fmt.Sprint("r", i), nil, nil)
	}
	require.Eventually(t, func() bool { return j.effected() == 20 }, 10*time.Second, 10*time.Millisecond, "messages not handled")
	downAndRefused()
	assert.NoError(t, goleak.Find(before), "goroutines left by 21 sessions while Consume runs")
	f.mem.SetDown(false)
	require.NoError(t, r.stop(t), "Consume after cancel")
}

// slowThenNext is the handler of the slow-handler reconnection tests: the
// first delivery of "slow" waits for slow, every "next…" for next; g
// gauges how many run at once, and j records each delivery.
func slowThenNext(g *gauge, j *journal, slow, next *gate) rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		defer g.enter()()
		n := j.record(d)
		switch {
		case d.MessageId == "slow" && n == 1:
			<-slow.ch
		case strings.HasPrefix(d.MessageId, "next"):
			<-next.ch
		}
		return nil
	})
}
