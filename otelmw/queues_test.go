package otelmw_test

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/header"
	"github.com/rabbitmw/rabbitmw/otelmw"
)

// gauge returns the value of the gauge name whose attributes hold kvs, and
// whether there is one.
func gauge[N int64 | float64](rm metricdata.ResourceMetrics, name string, kvs ...attribute.KeyValue) (N, bool) {
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			if g, ok := m.Data.(metricdata.Gauge[N]); ok {
				for _, p := range g.DataPoints {
					if has(p.Attributes, kvs) {
						return p.Value, true
					}
				}
			}
		}
	}
	return 0, false
}

func destination(q string) attribute.KeyValue {
	return attribute.String("messaging.destination.name", q)
}

// The gauges report each queue's depth and the age of the dead-letter
// queue's head, follow the queues as they change, and leave the head in
// its place.
func TestWatchQueues(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			b := be.open(t, broker.Options{})
			q := queueName(t)
			top := broker.Topology{Delays: []time.Duration{time.Hour, 2 * time.Hour}}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			require.NoError(t, b.Declare(ctx, q, top))
			t.Cleanup(func() { b.Delete(context.Background(), q, top) })
			names, err := top.Queues(q)
			require.NoError(t, err)

			r := newRig(t, otelmw.Options{Queue: q})
			wctx, stop := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() {
				done <- r.tel.WatchQueues(wctx, b, otelmw.QueueOptions{Topology: top, Interval: 20 * time.Millisecond})
			}()
			defer func() {
				stop()
				require.NoError(t, <-done)
			}()

			// Empty queues: every depth 0, and the age 0.
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				rm := r.metrics(t)
				for _, name := range append([]string{names.Work, names.DeadLetter}, names.Delays...) {
					n, ok := gauge[int64](rm, "rabbitmw.queue.depth", destination(name))
					assert.True(c, ok, name)
					assert.Zero(c, n, name)
				}
				age, ok := gauge[float64](rm, "rabbitmw.dead_letter.oldest.age", destination(names.DeadLetter))
				assert.True(c, ok)
				assert.Zero(c, age)
			}, 20*time.Second, 20*time.Millisecond)

			// Two messages in the work queue, one in the second delay
			// tier, two dead letters: the first failed an hour ago, the
			// second a minute ago.
			failed := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
			for _, p := range []struct {
				queue string
				msg   amqp.Publishing
			}{
				{names.Work, amqp.Publishing{MessageId: "w1"}},
				{names.Work, amqp.Publishing{MessageId: "w2"}},
				{names.Delays[1], amqp.Publishing{MessageId: "d1"}},
				{names.DeadLetter, amqp.Publishing{MessageId: "x1", Headers: amqp.Table{broker.HeaderFailedAt: failed}}},
				{names.DeadLetter, amqp.Publishing{MessageId: "x2", Headers: amqp.Table{broker.HeaderFailedAt: time.Now().Add(-time.Minute).UTC()}}},
			} {
				require.NoError(t, b.Publish(ctx, "", p.queue, p.msg))
			}
			require.EventuallyWithT(t, func(c *assert.CollectT) {
				rm := r.metrics(t)
				for name, want := range map[string]int64{names.Work: 2, names.Delays[0]: 0, names.Delays[1]: 1, names.DeadLetter: 2} {
					n, _ := gauge[int64](rm, "rabbitmw.queue.depth", destination(name))
					assert.Equal(c, want, n, name)
				}
				role, _ := gauge[int64](rm, "rabbitmw.queue.depth", attribute.String("rabbitmw.queue.role", "dead_letter"))
				assert.Equal(c, int64(2), role)
				age, _ := gauge[float64](rm, "rabbitmw.dead_letter.oldest.age", destination(names.DeadLetter))
				assert.InDelta(c, time.Since(failed).Seconds(), age, 30)
			}, 20*time.Second, 20*time.Millisecond)

			// The peeks left the head in its place.
			stop()
			require.NoError(t, <-done)
			done <- nil
			d, ok, err := b.Get(ctx, names.DeadLetter)
			require.NoError(t, err)
			require.True(t, ok)
			assert.Equal(t, "x1", d.MessageId)
			require.NoError(t, d.Nack(false, true))

			// Once stopped, the callback is gone: nothing is reported.
			_, ok = gauge[int64](r.metrics(t), "rabbitmw.queue.depth")
			assert.False(t, ok, "a depth reported after WatchQueues returned")
		})
	}
}

// A quorum dead-letter queue counts every return of a message, and drops
// (or dead-letters) it once the count passes its delivery limit, which
// RabbitMQ 4.0 sets to 20 by default: a peek at its head every poll would
// drop the oldest dead letter within minutes. So its head is not peeked
// when the topology says it is a quorum queue, and not again once a peek
// found the count (a dead-letter queue declared as a quorum queue
// elsewhere); the age is then left out while the queue holds messages.
func TestWatchQueuesQuorumDeadLetterQueue(t *testing.T) {
	for _, c := range []struct {
		name     string
		told     bool  // the watcher's topology says QuorumSupport
		maxCount int64 // the head's count after many polls
	}{
		// 0: never peeked.
		{"topology says so", true, 0},
		// One peek finds the count (RabbitMQ 3.10 writes it from the
		// first delivery, 0; a later version may write it from the
		// second): at most two returns.
		{"found by a peek", false, 2},
	} {
		for _, be := range backends {
			t.Run(c.name+"/"+be.name, func(t *testing.T) { testWatchQuorumDLQ(t, be.open, c.told, c.maxCount) })
		}
	}
}

func testWatchQuorumDLQ(t *testing.T, open func(*testing.T, broker.Options) *broker.Broker, told bool, maxCount int64) {
	b := open(t, broker.Options{})
	q := queueName(t)
	top := broker.Topology{QuorumSupport: true, Delays: []time.Duration{time.Hour}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, b.Declare(ctx, q, top))
	t.Cleanup(func() { b.Delete(context.Background(), q, top) })
	names, err := top.Queues(q)
	require.NoError(t, err)
	failed := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	require.NoError(t, b.Publish(ctx, "", names.DeadLetter, amqp.Publishing{MessageId: "x1", Headers: amqp.Table{broker.HeaderFailedAt: failed}}))

	watched := top
	watched.QuorumSupport = told
	r := newRig(t, otelmw.Options{Queue: q})
	wctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- r.tel.WatchQueues(wctx, b, otelmw.QueueOptions{Topology: watched, Interval: 20 * time.Millisecond})
	}()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		n, _ := gauge[int64](r.metrics(t), "rabbitmw.queue.depth", destination(names.DeadLetter))
		assert.Equal(c, int64(1), n)
	}, 20*time.Second, 20*time.Millisecond)
	// Some 25 polls, none of which reports an age once the
	// queue is known to count.
	assert.Never(t, func() bool {
		_, ok := gauge[float64](r.metrics(t), "rabbitmw.dead_letter.oldest.age", destination(names.DeadLetter))
		return ok && told
	}, 500*time.Millisecond, 20*time.Millisecond, "an age read by a peek at a queue that counts returns")
	stop()
	require.NoError(t, <-done)

	d, ok, err := b.Get(ctx, names.DeadLetter)
	require.NoError(t, err)
	require.True(t, ok, "the dead letter is still in its queue")
	assert.Equal(t, "x1", d.MessageId)
	n, ok := header.Integer(d.Headers["x-delivery-count"])
	require.True(t, ok, "a quorum queue's delivery carries x-delivery-count")
	assert.LessOrEqual(t, n, maxCount, "returns counted against the dead letter's delivery limit")
	require.NoError(t, d.Nack(false, true))
}

// A Telemetry without a queue has nothing to watch.
func TestWatchQueuesNeedsQueue(t *testing.T) {
	r := newRig(t, otelmw.Options{})
	err := r.tel.WatchQueues(context.Background(), nil, otelmw.QueueOptions{})
	require.ErrorContains(t, err, "Options.Queue")
}
