package broker

import (
	"context"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// The session's calls that wait for the server's answer (amqp091 watches
// no context once it has sent a method) return when their context is
// done, on a socket that stopped taking bytes; a message that an abandoned
// Get receives later is given back to its queue; and closing the session
// ends what is still waiting.
func TestRabbitMQServerCallsHonourTheirContextOnAStalledSocket(t *testing.T) {
	ctx := testContext(t, time.Minute)
	px, s := dialViaStallProxy(t, ctx, "rabbitmw test stalled calls")
	q := queueName(t)
	require.NoError(t, s.Declare(ctx, []queueSpec{{Name: q}}), "declare")
	t.Cleanup(func() {
		cctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		b := New(testenv.RabbitMQURL(t), Options{})
		defer b.Close()
		assert.NoError(t, b.Delete(cctx, q, Topology{}), "delete %q", q)
	})
	require.NoError(t, s.Publish(ctx, "", q, amqp.Publishing{MessageId: "m", Body: []byte("x")}), "publish")

	px.stall()
	calls := []struct {
		name string
		call func(ctx context.Context) error
	}{
		{"Get", func(ctx context.Context) error { _, _, err := s.Get(ctx, q); return err }},
		{"Get again", func(ctx context.Context) error { _, _, err := s.Get(ctx, q); return err }},
		{"SyncGets", s.SyncGets},
		{"Length", func(ctx context.Context) error { _, err := s.Length(ctx, q); return err }},
		{"Declare", func(ctx context.Context) error { return s.Declare(ctx, []queueSpec{{Name: q, Passive: true}}) }},
		{"DeclareExchanges", func(ctx context.Context) error {
			return s.DeclareExchanges(ctx, []exchangeSpec{{Name: "amq.direct", Kind: "direct", Durable: true, Passive: true}})
		}},
		{"Delete", func(ctx context.Context) error { return s.Delete(ctx, []string{q + "-none"}) }},
	}
	for _, c := range calls {
		cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		done := make(chan error, 1)
		go func() { done <- c.call(cctx) }()
		select {
		case err := <-done:
			assert.ErrorIs(t, err, context.DeadlineExceeded, "%s on a stalled socket", c.name)
		case <-time.After(10 * time.Second):
			t.Fatalf("%s on a stalled socket still blocked 10s after its 300ms context ended", c.name)
		}
		cancel()
	}

	// The server now reads the basic.get sent before: its message goes
	// back to the queue, not to a caller that left.
	px.resume()
	require.Eventually(t, func() bool {
		n, err := s.Length(ctx, q)
		return err == nil && n == 1
	}, 20*time.Second, 50*time.Millisecond, "the message of the abandoned Get is ready again")

	px.stall()
	go func() { _, _ = s.Length(context.Background(), q) }() // waits for ever
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case <-closed:
	case <-time.After(20 * time.Second):
		t.Fatal("closing a session with calls waiting did not return within 20s")
	}
}
