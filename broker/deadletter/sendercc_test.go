package deadletter

import (
	"bytes"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A dead letter that carries a CC or BCC header Publish refuses (here an
// array holding a number, which RabbitMQ takes and skips), put in the
// dead-letter queue by another client, or dead-lettered by RabbitMQ
// itself, is exported, imported and replayed: each copy carries the
// header in HeaderOriginalCC or HeaderOriginalBCC, never as CC or BCC.
func TestReplayAndImportOfADeadLetterWithASenderHeaderOfAnotherShape(t *testing.T) {
	f := setup(t, backends[1], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	conn, err := amqp.Dial(testenv.RabbitMQURL(t))
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	cc := []any{int32(7), []byte("b"), "rabbitmw-test-nowhere"}
	dlq := f.q + ".dlq"
	// Put there by another client, as if the broker had dead-lettered it.
	require.NoError(t, ch.Publish("", dlq, false, false, amqp.Publishing{MessageId: "put", Body: []byte("x"),
		Headers: amqp.Table{"CC": cc, broker.HeaderOriginalQueue: f.q}}))
	// Dead-lettered by RabbitMQ: rejected by a consumer of another client.
	require.NoError(t, ch.Publish("", f.q, false, false, amqp.Publishing{MessageId: "rejected", Body: []byte("x"),
		Headers: amqp.Table{"CC": cc}}))
	require.Eventually(t, func() bool {
		d, ok, err := ch.Get(f.q, false)
		return err == nil && ok && d.Reject(false) == nil
	}, 10*time.Second, 10*time.Millisecond)
	require.Eventually(t, func() bool { return f.length(dlq) == 2 }, 10*time.Second, 10*time.Millisecond)

	var buf bytes.Buffer
	n, err := f.in.Export(ctx, f.q, &buf, ExportOptions{})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	n, err = f.in.Import(ctx, f.q, &buf, ImportOptions{})
	require.NoError(t, err, "Import")
	require.Equal(t, 2, n)
	require.Equal(t, 4, f.length(dlq))

	res, err := f.in.Replay(ctx, f.q, ReplayOptions{To: f.q})
	require.NoError(t, err, "Replay")
	assert.Equal(t, 4, res.Replayed)
	assert.Zero(t, f.length(dlq))
	back := f.drain(f.q)
	require.Len(t, back, 4)
	for _, d := range back {
		assert.NotContains(t, d.Headers, "CC", "message %s", d.MessageId)
		t.Logf("%s: original CC %v", d.MessageId, d.Headers[broker.HeaderOriginalCC])
	}
}
