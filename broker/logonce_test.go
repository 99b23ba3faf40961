package broker

import (
	"context"
	"log/slog"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// A dead-letter is logged once at Warn or above: by the Log layer when the
// handler's result asks for it, by the broker when the broker decides it
// itself (a handler that never ran, here for a not-before header beyond
// the bound). The broker's record of a copy confirmed in the dead-letter
// queue is at Debug.
func TestDeadLetterLoggedOnce(t *testing.T) {
	f := setup(t, backends[0], Topology{})
	logged := middleware.Log(slog.New(f.logs))
	r := f.consume(logged(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		return rabbitmw.Permanent(errBoom)
	})), ConsumeOptions{})
	f.publish("poison", []byte("x"), nil)
	f.publish("far", []byte("x"), amqp.Table{HeaderNotBefore: time.Now().Add(8 * 24 * time.Hour).UnixMilli()})
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 2 }, 20*time.Second, 10*time.Millisecond, "messages not dead-lettered")
	require.NoError(t, r.stop(t), "Consume after cancel")

	for _, c := range []struct {
		id, level, message string
	}{
		{"poison", "ERROR", "delivery"},
		{"far", "WARN", "broker: not-before header too far ahead"},
	} {
		id := `message_id="` + c.id + `"`
		warned := f.logs.Count("WARN", id) + f.logs.Count("ERROR", id)
		if warned != 1 || f.logs.Count(c.level+" "+c.message, id) != 1 {
			t.Errorf("message %s: %d records at Warn or above; want 1, at %s, %q:\n%q", c.id, warned, c.level, c.message, f.logs.All())
		}
		assert.Equal(t, 1, f.logs.Count("DEBUG broker: dead-letter copy confirmed", id), "records at Debug of the copy of "+c.id)
	}
	assert.Equal(t, 0, f.length(f.q), "Len(work queue)")
}
