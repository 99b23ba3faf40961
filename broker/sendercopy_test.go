package broker

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A message that another client published with a CC header that RabbitMQ
// takes but Publish refuses (an array holding a number, which RabbitMQ
// skips) is delayed and dead-lettered all the same: each copy carries the
// header in HeaderOriginalCC, never as CC, and the handler sees it as it
// came on every delivery.
func TestCopiesOfADeliveryWithASenderHeaderOfAnotherShape(t *testing.T) {
	var be backend
	for _, b := range backends {
		if b.real {
			be = b
		}
	}
	f := setup(t, be, Topology{})
	conn, err := amqp.Dial(testenv.RabbitMQURL(t))
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	cc := []any{int32(7), []byte("b"), "rabbitmw-test-nowhere"}
	require.NoError(t, ch.Publish("", f.q, false, false, amqp.Publishing{MessageId: "cc", Headers: amqp.Table{"CC": cc}, Body: []byte("x")}))

	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) == 1 {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		return rabbitmw.Permanent(errBoom)
	}), ConsumeOptions{})
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "not dead-lettered")
	require.NoError(t, r.stop(t))
	calls := j.callsOf("cc")
	require.Len(t, calls, 2)
	for i, c := range calls {
		assert.Equal(t, cc, c.d.Headers["CC"], "CC of delivery %d", i+1)
	}
	dead := f.onlyDeadLetter()
	assert.NotContains(t, dead.Headers, "CC")
	assert.Equal(t, cc, dead.Headers[HeaderOriginalCC])
	assert.Zero(t, f.logs.Count("cannot be sent"), "no copy refused")
}
