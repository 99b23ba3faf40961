package deadletter

import (
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/rabbitnode"
)

// RabbitMQ closes a channel that holds a delivery unacknowledged past its
// consumer_timeout (30 minutes by default), basic.get ones included. A
// replay slower than that, by its rate or the size of the queue, holds
// no message that long: it works in rounds, each within HoldLimit, and
// puts back what it has not replayed between them. On a node of the
// test's own with a consumer_timeout of 2 s (checked every 200 ms), a
// replay of 8 messages at 2 a second takes 4 s.
func TestReplayOutlastsConsumerTimeout(t *testing.T) {
	dir := rabbitnode.Dir(t)
	node := rabbitnode.Start(t, dir, rabbitnode.Config{Name: "rmwctimeout",
		Conf:     "consumer_timeout = 2000\n",
		Advanced: "[{rabbit, [{channel_tick_interval, 200}]}].\n"})
	b := broker.New(node.URL(), broker.Options{ReconnectMin: 20 * time.Millisecond, ReconnectMax: 200 * time.Millisecond})
	t.Cleanup(func() { b.Close() })
	ctx := testContext(t, 60*time.Second)
	q := queueName(t)
	require.NoError(t, b.Declare(ctx, q, broker.Topology{}))
	var want []string
	for i := range 8 {
		id := fmt.Sprintf("m%d", i)
		want = append(want, id)
		require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: id, Headers: amqp.Table{
			broker.HeaderOriginalQueue: q, broker.HeaderError: "boom", broker.HeaderErrorType: "error",
			broker.HeaderFailedAt: time.Now().UTC().Truncate(time.Second), rabbitmw.HeaderAttempts: int64(1),
		}}))
	}

	start := time.Now()
	res, err := New(b).Replay(ctx, q, ReplayOptions{Rate: 2, HoldLimit: time.Second})
	t.Logf("replay: %d of %d in %v, error %v", res.Replayed, len(res.Selected), time.Since(start).Round(time.Millisecond), err)
	require.NoError(t, err, "Replay")
	assert.Equal(t, 8, res.Replayed, "replayed")
	assert.Equal(t, want, ids(res.Selected), "selected")
	n, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err)
	assert.Equal(t, 0, n, "messages left in the dead-letter queue")
	var got []string
	for {
		d, ok, err := b.Get(ctx, q)
		require.NoError(t, err)
		if !ok {
			break
		}
		got = append(got, d.MessageId)
		require.NoError(t, d.Ack(false))
	}
	assert.Equal(t, want, got, "the work queue holds each message once, in order")
}

// A replay in rounds replays each selected message once, in order, and
// leaves a message that came into the dead-letter queue meanwhile.
func TestReplayRounds(t *testing.T) {
	f := setup(t, backends[0], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	want := []string{"a", "b", "c", "d", "e"}
	f.deadLetter(t, false, nil, want...)
	late := false
	res, err := f.in.Replay(ctx, f.q, ReplayOptions{Rate: 25, HoldLimit: 50 * time.Millisecond, Progress: func(done, total int) {
		if !late {
			late = true
			assert.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: "late", Headers: amqp.Table{broker.HeaderOriginalQueue: f.q}}))
		}
	}})
	require.NoError(t, err)
	assert.Equal(t, 5, res.Replayed)
	assert.Equal(t, want, ids(res.Selected))
	var got []string
	for {
		d, ok, err := f.b.Get(ctx, f.q)
		require.NoError(t, err)
		if !ok {
			break
		}
		got = append(got, d.MessageId)
		require.NoError(t, d.Ack(false))
	}
	assert.Equal(t, want, got, "the work queue holds each message once, in order")
	left, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err)
	assert.Equal(t, []string{"late"}, ids(left), "the dead-letter queue keeps what came in meanwhile")
}
