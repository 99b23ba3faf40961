package deadletter

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/frameproxy"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A message that Purge reports removed is gone, even when the connection
// drops right after its ack was written, before the server processed it.
func TestPurgeReportsOnlyWhatTheServerRemoved(t *testing.T) {
	f := setup(t, backends[1], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "b", "c")
	// The proxy cuts each connection when the client sends its first
	// basic.ack, without passing it on: the connection drops after the
	// ack was written and before the server processed it.
	var cuts atomic.Int32
	via := frameproxy.Start(t, testenv.RabbitMQURL(t), func(dir frameproxy.Direction, f frameproxy.Frame) frameproxy.Verdict {
		if dir == frameproxy.FromClient && f.IsMethod(60, 80) {
			cuts.Add(1)
			return frameproxy.Cut
		}
		return frameproxy.Pass
	})
	b := broker.New(via, broker.Options{ReconnectMin: 20 * time.Millisecond, ReconnectMax: 100 * time.Millisecond})
	t.Cleanup(func() { b.Close() })

	removed, err := New(b).Purge(ctx, f.q, PurgeOptions{})
	t.Logf("Purge: removed %v, error %v", ids(removed), err)
	require.EqualValues(t, 1, cuts.Load(), "the proxy cut the connection at an ack")
	require.Eventually(t, func() bool { return f.length(f.q+".dlq") == 3 }, 10*time.Second, 20*time.Millisecond,
		"the server requeues the three messages whose acks it never processed")
	assert.Error(t, err, "Purge with its connection lost")
	assert.Empty(t, ids(removed), "messages reported removed, and still in the dead-letter queue")
}

// Purge removes what it selects and leaves the rest in order.
func testPurgeSelected(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "typed-b", "c", "typed-d")
	removed, err := f.in.Purge(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*deadletter.typedErr"}, DryRun: true})
	require.NoError(t, err, "Purge dry run")
	assert.Equal(t, []string{"typed-b", "typed-d"}, ids(removed), "selected")
	assert.Equal(t, 4, f.length(f.q+".dlq"), "dead-letter queue after a dry run")
	removed, err = f.in.Purge(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*deadletter.typedErr"}})
	require.NoError(t, err, "Purge")
	assert.Equal(t, []string{"typed-b", "typed-d"}, ids(removed), "removed")
	assert.Equal(t, []string{"a", "c"}, deliveryIDs(f.drain(f.q+".dlq")), "left")
	f.assertSettled(t)
}

// A purge whose context ends (the command's Ctrl-C) removes nothing more,
// and returns every message it removed: the dead-letter queue holds the
// others. The context ends as the reading of the queue ends, before the
// first acknowledgement.
func TestPurgeInterrupted(t *testing.T) {
	f := setup(t, backends[1], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	const n = 2 * purgeBatch
	for i := range n {
		require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: fmt.Sprintf("m%d", i),
			Headers: amqp.Table{broker.HeaderOriginalQueue: f.q}}))
	}
	pctx, interrupt := context.WithCancel(ctx)
	defer interrupt()
	removed, err := f.in.Purge(pctx, f.q, PurgeOptions{ScanProgress: func(done, total int) {
		if done == total {
			interrupt()
		}
	}})
	require.ErrorIs(t, err, context.Canceled, "Purge")
	left := len(f.drain(f.q + ".dlq"))
	assert.Equal(t, n, len(removed)+left, "messages returned removed, and left in the dead-letter queue")
	f.assertSettled(t)
}
