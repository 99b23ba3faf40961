package broker

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
)

// Coalesced acks (see acker): the cases of the behaviours table, run on
// both servers, and the Test… functions, on the memory server in a
// synctest bubble.

// ackCounter counts the ack frames a consumer sends, through
// Observer.Ack.
type ackCounter struct {
	mu                 sync.Mutex
	frames, deliveries int
	failed             int
}

// observe makes f's Broker report its acks to c; call it before Consume.
func (c *ackCounter) observe(f *fixture) {
	f.b.cfg.obs.Ack = func(e AckEvent) {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.frames++
		c.deliveries += e.Deliveries
		if e.Err != nil {
			c.failed++
		}
	}
}

func (c *ackCounter) counts() (frames, deliveries, failed int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.frames, c.deliveries, c.failed
}

// A multiple ack settles every unsettled delivery of its channel up to its
// tag; a multiple ack of a tag settled already is an unknown delivery tag,
// whatever lies below it, and the server closes the channel. The memory
// server does as RabbitMQ.
func testMultipleAckSemantics(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 20*time.Second)
	get3 := func() [3]*amqp.Delivery {
		t.Helper()
		var ds [3]*amqp.Delivery
		for i := range ds {
			d, ok, err := f.b.Get(ctx, f.q)
			if err != nil || !ok {
				t.Fatalf("Get = %v, %v; want a delivery", ok, err)
			}
			ds[i] = d
		}
		if ds[1].DeliveryTag != ds[0].DeliveryTag+1 || ds[2].DeliveryTag != ds[1].DeliveryTag+1 {
			t.Fatalf("delivery tags %d, %d, %d; want consecutive", ds[0].DeliveryTag, ds[1].DeliveryTag, ds[2].DeliveryTag)
		}
		return ds
	}
	for i := range 3 {
		f.publish(fmt.Sprint("m", i), []byte("x"), nil)
	}

	// Over a nacked tag: the tags below and at it are settled.
	ds := get3()
	require.NoError(t, ds[1].Nack(false, true), "Nack(second)")
	require.NoError(t, ds[2].Ack(true), "Ack(third, multiple)")
	require.Eventually(t, func() bool { return f.polledLength(f.q) == 1 }, 10*time.Second, 10*time.Millisecond, "the nacked message not back in the queue")
	if f.mem != nil {
		assert.Equal(t, 0, f.mem.Unacked(f.q), "unacked")
		assert.Equal(t, 0, f.mem.Stats().UnknownTags, "unknown tags")
	}
	for i := range 2 {
		f.publish(fmt.Sprint("n", i), []byte("x"), nil)
	}

	// At a nacked tag: refused, the channel closes, the others return.
	ds = get3()
	require.NoError(t, ds[1].Nack(false, true), "Nack(second)")
	_ = ds[1].Ack(true) // the server refuses it after the call returned
	if f.mem != nil {
		assert.Equal(t, 1, f.mem.Stats().UnknownTags, "unknown tags")
	} else {
		ch, ok := ds[0].Acknowledger.(*amqp.Channel)
		if !ok {
			t.Fatalf("Acknowledger %T; want *amqp.Channel", ds[0].Acknowledger)
		}
		require.Eventually(t, ch.IsClosed, 10*time.Second, 10*time.Millisecond, "channel not closed by the multiple ack of a settled tag")
	}
	require.Eventually(t, func() bool { return f.polledLength(f.q) == 3 }, 10*time.Second, 10*time.Millisecond, "messages not back in the queue")
	f.drain(f.q)
}

// Many workers, handlers of various lengths, some requeues and delays in
// the middle, one slow handler: every message's effect is applied once,
// nothing is redelivered, no tag is unknown, and acks are coalesced.
func testCoalescedAcks(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	var acks ackCounter
	acks.observe(f)
	const n = 1000
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		calls := j.record(d)
		var i int
		fmt.Sscanf(d.MessageId, "c%d", &i)
		switch {
		case i == 100 && calls == 1:
			time.Sleep(50 * time.Millisecond) // behind it, acks are held
		case i%10 == 3 && calls == 1:
			return errBoom // a nack with requeue
		case i%25 == 7 && calls == 1:
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond) // an ack after a copy
		}
		time.Sleep(time.Duration(rand.IntN(500)) * time.Microsecond)
		return nil
	}), ConsumeOptions{Workers: 16, Prefetch: 32})
	for i := range n {
		f.publish(fmt.Sprint("c", i), []byte("x"), nil)
	}
	// Once, twice for the requeued (n/10) and the delayed (n/25).
	require.Eventually(t, func() bool { return j.totalCalls() == n+n/10+n/25 }, 60*time.Second, 10*time.Millisecond, "not every message handled")
	require.NoError(t, r.stop(t), "Consume after cancel")
	for i := range n {
		want := 1
		switch {
		case i == 100:
		case i%10 == 3, i%25 == 7:
			want = 2
		}
		assert.Equal(t, want, len(j.callsOf(fmt.Sprint("c", i))), "handler calls of c%d", i)
	}
	f.assertSettled(t)
	assert.Equal(t, 1, f.logs.Count("broker: consuming"), "consumer sessions")
	frames, deliveries, failed := acks.counts()
	assert.Equal(t, 0, failed, "acks that failed")
	assert.Equal(t, n+n/25, deliveries, "deliveries acked") // once, and the original of each delay
	if f.mem != nil {
		s := f.mem.Stats()
		assert.Equal(t, frames, s.AckFrames, "ack frames the memory server took")
		assert.Equal(t, deliveries, s.Acked, "deliveries it acked")
	}
	t.Logf("%d deliveries acked in %d ack frames: %.2f per frame", deliveries, frames, float64(deliveries)/float64(frames))
	if frames >= deliveries {
		t.Errorf("%d ack frames for %d deliveries; want fewer frames", frames, deliveries)
	}
}

// The held acks, held at the same time, go alone once they have waited
// maxHoldAck, and not before; the slow delivery's ack goes alone once it
// has waited as long.
func TestHeldAcksAtTheTimeBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		r, slow, j := behindSlow(t, f, 3)
		start := time.Now()
		assert.Equal(t, 4, j.effected(), "handled")
		assert.Equal(t, 4, f.mem.Unacked(f.q), "unacked while the acks are held")
		time.Sleep(maxHoldAck - time.Nanosecond)
		synctest.Wait()
		assert.Equal(t, 4, f.mem.Unacked(f.q), "unacked just before the bound")
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		assert.Equal(t, 1, f.mem.Unacked(f.q), "unacked at the bound")
		assert.Equal(t, maxHoldAck, time.Since(start), "held for")
		s := f.mem.Stats()
		assert.Equal(t, 3, s.AckFrames, "ack frames")
		slow.open()
		synctest.Wait()
		time.Sleep(maxHoldAck) // its ack is kept as long
		synctest.Wait()
		assert.Equal(t, 0, f.mem.Unacked(f.q), "unacked once the slow one is done")
		assert.Equal(t, 4, f.mem.Stats().AckFrames, "ack frames")
		require.NoError(t, r.stop(t), "Consume after cancel")
		f.assertSettled(t)
	})
}

// At the budget (three quarters of the prefetch count beyond the workers:
// 9 with 4 workers and a prefetch of 16; 12 with the defaults, 16 workers
// and a prefetch of 32, which Consume fills in before it makes the acker),
// before the time bound, the highest held ack goes alone, and only it;
// once the slow one is done, its ack and those held go in one multiple
// ack, at once, for they are as many as the budget again.
func TestHeldAcksAtTheBudget(t *testing.T) {
	for _, tt := range []struct {
		name    string
		opts    ConsumeOptions
		workers int // as Consume makes them
	}{
		{"4 workers, prefetch 16", ConsumeOptions{Workers: 4, Prefetch: 16}, 4},
		{"the defaults", ConsumeOptions{}, defaultWorkers},
	} {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := setup(t, backends[0], Topology{})
				budget := ackBudget(cmp.Or(tt.opts.Prefetch, 2*tt.workers), tt.workers)
				r, slow, _ := behindSlowWith(t, f, budget-1, tt.opts)
				assert.Equal(t, budget, f.mem.Unacked(f.q), "unacked with budget-1 acks held")
				assert.Equal(t, 0, f.mem.Stats().AckFrames, "ack frames with budget-1 acks held")
				f.publish(fmt.Sprint("f", budget-1), nil, nil)
				synctest.Wait()
				assert.Equal(t, budget, f.mem.Unacked(f.q), "unacked with budget acks held")
				assert.Equal(t, 1, f.mem.Stats().AckFrames, "ack frames with budget acks held")
				slow.open()
				synctest.Wait()
				assert.Equal(t, 0, f.mem.Unacked(f.q), "unacked once the slow one is done")
				s := f.mem.Stats()
				assert.Equal(t, 2, s.AckFrames, "ack frames")
				assert.Equal(t, budget+1, s.Acked, "deliveries acked")
				require.NoError(t, r.stop(t), "Consume after cancel")
				f.assertSettled(t)
			})
		})
	}
}

// With a prefetch count at or below the workers, or up to two above them
// (three quarters of the spare window is then less than two), no ack is
// kept: each goes at once, alone behind a gap, without waiting for the
// time bound.
func TestAcksAtTheWorkersGoAtOnce(t *testing.T) {
	for _, opts := range []ConsumeOptions{
		{Workers: 4, Prefetch: 4}, {Workers: 8, Prefetch: 4}, {Workers: 4, Prefetch: 5}, {Workers: 4, Prefetch: 6}, {Workers: 1, Prefetch: 1},
	} {
		t.Run(fmt.Sprintf("workers=%d/prefetch=%d", opts.Workers, opts.Prefetch), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := setup(t, backends[0], Topology{})
				fast := min(2, opts.Workers-1) // behind slow, in the other workers
				r, slow, _ := behindSlowWith(t, f, fast, opts)
				assert.Equal(t, 1, f.mem.Unacked(f.q), "unacked, the slow one's")
				assert.Equal(t, fast, f.mem.Stats().AckFrames, "ack frames of the fast ones")
				slow.open()
				synctest.Wait()
				assert.Equal(t, 0, f.mem.Unacked(f.q), "unacked once the slow one is done")
				assert.Equal(t, fast+1, f.mem.Stats().AckFrames, "ack frames")
				require.NoError(t, r.stop(t), "Consume after cancel")
				f.assertSettled(t)
			})
		})
	}
}

// A connection lost with acks held loses them: the server redelivers those
// messages (Dedup's duplicates), nothing is acked twice, nothing is lost,
// and the new session's tags start again.
func TestConnectionLostWithHeldAcks(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := setup(t, backends[0], Topology{})
		r, slow, j := behindSlow(t, f, 2)
		assert.Equal(t, 3, f.mem.Unacked(f.q), "unacked while the acks are held")

		f.mem.CloseConnections()
		time.Sleep(time.Second) // past the reconnection backoff
		synctest.Wait()
		assert.Equal(t, 2, f.logs.Count("broker: consuming"), "consumer sessions")
		for _, id := range []string{"slow", "f0", "f1"} {
			calls := j.callsOf(id)
			if assert.Equal(t, 2, len(calls), "handler calls of "+id) {
				assert.True(t, calls[1].d.Redelivered, "redelivered "+id)
				assert.True(t, calls[1].d.DeliveryTag < 4, "tag of the redelivery of "+id+" on the new channel below 4")
			}
		}
		slow.open() // its result comes after its session: not settled
		synctest.Wait()
		require.NoError(t, r.stop(t), "Consume after cancel")
		s := f.mem.Stats()
		assert.Equal(t, 3, s.Acked, "deliveries acked")
		assert.Equal(t, 3, s.RequeuedOnClose, "returned by the lost connection")
		f.assertSettled(t)
	})
}

// behindSlow consumes with 4 workers and a prefetch of 16 (see
// behindSlowWith).
func behindSlow(t *testing.T, f *fixture, fast int) (*run, *gate, *journal) {
	return behindSlowWith(t, f, fast, ConsumeOptions{Workers: 4, Prefetch: 16})
}

// behindSlowWith consumes with opts, publishes "slow", whose first
// delivery waits for the gate it returns, and then fast messages f0, f1,
// ... whose handlers finish at once, so that their acks are held behind
// slow's; it returns once all are in their handlers or done.
func behindSlowWith(t *testing.T, f *fixture, fast int, opts ConsumeOptions) (*run, *gate, *journal) {
	slow := newGate(t)
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) == 1 && d.MessageId == "slow" {
			<-slow.ch
		}
		return nil
	}), opts)
	f.publish("slow", nil, nil)
	synctest.Wait()
	for i := range fast {
		f.publish(fmt.Sprint("f", i), nil, nil)
	}
	synctest.Wait()
	return r, slow, j
}
