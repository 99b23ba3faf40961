package e2e_test

import (
	"bytes"
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
)

// A message published with the "CC" header (RabbitMQ's sender-selected
// distribution) reached the queues it names when it was published. Its
// copies go through the default exchange, where every queue is bound by
// its name: a copy that carried the header would reach those queues
// again, once for each retry, dead-lettering, replay and import. So no
// copy carries it, and the handler still sees it on every attempt.
func TestCopiesRouteOnlyToTheirQueue(t *testing.T) {
	onCopyBackends(t, testCopiesRouteOnlyToTheirQueue)
}

func testCopiesRouteOnlyToTheirQueue(t *testing.T, b *broker.Broker) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	top := broker.Topology{Delays: []time.Duration{100 * time.Millisecond, time.Hour}}
	q, _ := declared(t, b, "rabbitmw-test-cc-", func(string) broker.Topology { return top })
	audit, _ := declared(t, b, "rabbitmw-test-cc-audit-", func(string) broker.Topology { return broker.Topology{} })
	cc := []any{audit}
	publish := func(id string) {
		t.Helper()
		msg := amqp.Publishing{MessageId: id, Headers: amqp.Table{"CC": cc}, Body: []byte(id)}
		require.NoError(t, b.Publish(ctx, "", q, msg))
	}

	var mu sync.Mutex
	seen := map[string][]amqp.Table{}
	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		seen[d.MessageId] = append(seen[d.MessageId], d.Headers)
		n := len(seen[d.MessageId])
		mu.Unlock()
		switch {
		case d.MessageId == "delayed":
			return rabbitmw.RetryAfter(errCopyTest, time.Hour)
		case d.MessageId == "failing" && n == 1:
			return rabbitmw.RetryAfter(errCopyTest, 100*time.Millisecond)
		case d.MessageId == "failing" && n == 2:
			return rabbitmw.Permanent(errCopyTest)
		}
		return nil
	})
	stop := consumeIn(t, b, q, top, h)
	publish("delayed")
	publish("failing")
	dlq := takeFrom(ctx, t, b, q+".dlq")
	stop()
	assert.NotContains(t, dlq.Headers, "CC", "the dead-letter copy")

	// The dead-letter copy, imported into the dead-letter queue and
	// replayed; then a record whose CC is not the array RabbitMQ asks
	// for, which RabbitMQ would refuse to route.
	export := func(d *amqp.Delivery) *bytes.Buffer {
		t.Helper()
		m, err := deadletter.ExportMessage(q+".dlq", d)
		require.NoError(t, err)
		var line bytes.Buffer
		require.NoError(t, json.NewEncoder(&line).Encode(m))
		return &line
	}
	_, err := deadletter.New(b).Import(ctx, q, export(dlq), deadletter.ImportOptions{})
	require.NoError(t, err)
	odd := delivery(amqp.Publishing{MessageId: "odd", Headers: amqp.Table{"CC": audit, "BCC": cc}, Body: []byte("odd")})
	_, err = deadletter.New(b).Import(ctx, q, export(odd), deadletter.ImportOptions{})
	assert.NoError(t, err, "import of a record with a CC header that is not an array")
	res, err := deadletter.New(b).Replay(ctx, q, deadletter.ReplayOptions{To: q})
	require.NoError(t, err)
	assert.Equal(t, 2, res.Replayed)
	stop = consumeIn(t, b, q, top, h)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen["failing"]) == 3 && len(seen["odd"]) == res.Replayed-1
	}, 20*time.Second, 20*time.Millisecond, "the replayed messages were not handled")
	stop()

	// The audit queue has the two messages published to it, and nothing
	// else; the delay copy waits in its queue.
	for _, id := range []string{"delayed", "failing"} {
		assert.Equal(t, id, takeFrom(ctx, t, b, audit).MessageId)
	}
	d, ok, err := b.Get(ctx, audit)
	require.NoError(t, err)
	assert.False(t, ok, "a copy reached the queue named in CC: %v", d)
	delayed := takeFrom(ctx, t, b, q+".delay.1h")
	assert.NotContains(t, delayed.Headers, "CC", "the delay copy")

	mu.Lock()
	defer mu.Unlock()
	for _, id := range []string{"delayed", "failing"} {
		for i, hs := range seen[id] {
			assert.Equal(t, cc, hs["CC"], "%s, attempt %d: the handler sees the message's CC", id, i+1)
		}
	}
	assert.Len(t, seen["failing"], 3)
	if assert.Len(t, seen["odd"], 1) {
		assert.Equal(t, audit, seen["odd"][0]["CC"], "the replayed record: its CC as it was")
	}
}

// takeFrom takes the next message of queue, waiting for it, and acks it.
func takeFrom(ctx context.Context, t *testing.T, b *broker.Broker, queue string) *amqp.Delivery {
	t.Helper()
	var d *amqp.Delivery
	require.Eventually(t, func() bool {
		var ok bool
		var err error
		d, ok, err = b.Get(ctx, queue)
		require.NoError(t, err)
		return ok
	}, 20*time.Second, 20*time.Millisecond, "nothing in %s", queue)
	require.NoError(t, d.Ack(false))
	return d
}
