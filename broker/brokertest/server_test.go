package brokertest

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// memSession opens a raw session on a fresh Server with queue q declared
// with args.
func memSession(t *testing.T, q string, args amqp.Table) (*Server, *memConn) {
	t.Helper()
	m := NewServer()
	t.Cleanup(m.Close)
	s, err := (dialer{m}).Dial(context.Background(), "test")
	require.NoError(t, err)
	c := s.(*memConn)
	require.NoError(t, c.Declare(context.Background(), []transport.QueueSpec{{Name: q, Args: args}}))
	return m, c
}

func TestAckAfterCloseAndUnknownTag(t *testing.T) {
	m, c := memSession(t, "q", nil)
	ctx := context.Background()
	require.NoError(t, c.Publish(ctx, "", "q", amqp.Publishing{Body: []byte("x")}))
	d, ok, err := c.Get(ctx, "q")
	if err != nil || !ok {
		t.Fatalf("get = %v, %t", err, ok)
	}
	require.NoError(t, c.Close())
	assert.ErrorIs(t, d.Ack(false), amqp.ErrClosed, "Ack after close")
	assert.Equal(t, 1, m.Stats().RequeuedOnClose, "requeued on close")

	s, _ := (dialer{m}).Dial(ctx, "test")
	c = s.(*memConn)
	d, _, _ = c.Get(ctx, "q")
	assert.Equal(t, true, d.Redelivered, "Redelivered after the connection closed")
	require.NoError(t, d.Ack(false))
	require.NoError(t, d.Ack(false))
	select {
	case <-c.Closed():
	default:
		t.Fatal("connection still open after an unknown delivery tag")
	}
	assert.Contains(t, c.Reason().Error(), "unknown delivery tag 1", "reason")
	assert.Equal(t, 1, m.Stats().UnknownTags, "unknown tags")
}

func TestPrefetchAndMultiple(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		_, c := memSession(t, "q", nil)
		ctx := context.Background()
		for range 5 {
			require.NoError(t, c.Publish(ctx, "", "q", amqp.Publishing{}))
		}
		ds, err := c.Consume("q", "tag", 2)
		require.NoError(t, err)
		var got []amqp.Delivery
		for range 2 {
			got = append(got, <-ds)
		}
		synctest.Wait() // the server's pump is idle: it has handed out all it may
		select {
		case d := <-ds:
			t.Fatalf("third delivery %d with prefetch 2 and nothing settled", d.DeliveryTag)
		default:
		}
		n, _ := c.Length(ctx, "q")
		assert.Equal(t, 3, n, "ready with two unacked")
		require.NoError(t, got[1].Ack(true))
		for range 2 {
			got = append(got, <-ds)
		}
		assert.Equal(t, []uint64{1, 2, 3, 4}, []uint64{got[0].DeliveryTag, got[1].DeliveryTag, got[2].DeliveryTag, got[3].DeliveryTag}, "delivery tags")
		require.NoError(t, got[3].Nack(true, true))
		d := <-ds
		assert.Equal(t, []any{uint64(5), true}, []any{d.DeliveryTag, d.Redelivered}, "requeued message keeps its place")
		require.NoError(t, c.Cancel("tag"))
		for range ds { // flushed, then closed
		}
	})
}

// A message leaves a queue with a TTL when the TTL has passed, not
// before, recorded in x-death; sent back, its record counts the hop.
func TestTTLDeadLettering(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		_, c := memSession(t, "work", nil)
		ctx := context.Background()
		require.NoError(t, c.Declare(ctx, []transport.QueueSpec{{Name: "delay", Args: amqp.Table{
			"x-message-ttl": int64(30), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "work"}}}))
		// expire publishes a message to the delay queue and returns it as it
		// comes out in the work queue, after the TTL.
		expire := func(msg amqp.Publishing) *amqp.Delivery {
			t.Helper()
			require.NoError(t, c.Publish(ctx, "", "delay", msg))
			time.Sleep(29 * time.Millisecond)
			synctest.Wait()
			if n, _ := c.Length(ctx, "work"); n != 0 {
				t.Fatalf("Length(work) 29ms after the publish = %d; want 0 (the TTL is 30ms)", n)
			}
			time.Sleep(time.Millisecond)
			synctest.Wait()
			if n, _ := c.Length(ctx, "work"); n != 1 {
				t.Fatalf("Length(work) 30ms after the publish = %d; want 1", n)
			}
			d, _, _ := c.Get(ctx, "work")
			return d
		}
		d := expire(amqp.Publishing{MessageId: "m"})
		deaths := d.Headers["x-death"].([]any)
		assert.Equal(t, 1, len(deaths), "x-death records")
		death := deaths[0].(amqp.Table)
		assert.Equal(t, []any{"delay", "expired", "", []any{"delay"}, int64(1)},
			[]any{death["queue"], death["reason"], death["exchange"], death["routing-keys"], death["count"]}, "x-death record")
		assert.Equal(t, "expired", d.Headers["x-first-death-reason"], "x-first-death-reason")
		assert.Equal(t, "work", d.RoutingKey, "routing key")
		// Republish the delivered copy to the delay queue, as the broker
		// does: the count grows, the record stays single.
		require.NoError(t, d.Ack(false))
		d = expire(amqp.Publishing{MessageId: "m", Headers: d.Headers})
		require.NoError(t, d.Ack(false))
		deaths = d.Headers["x-death"].([]any)
		assert.Equal(t, 1, len(deaths), "x-death records after a second hop")
		assert.Equal(t, int64(2), deaths[0].(amqp.Table)["count"], "x-death count after a second hop")
	})
}

func TestDeclareEquivalence(t *testing.T) {
	_, c := memSession(t, "q", amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int32(5)})
	ctx := context.Background()
	require.NoError(t, c.Declare(ctx, []transport.QueueSpec{{Name: "q", Args: amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int64(5)}}}))
	err := c.Declare(ctx, []transport.QueueSpec{{Name: "q", Args: amqp.Table{"x-message-ttl": int64(5)}}})
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
		t.Fatalf("declare without x-queue-type = %v; want 406", err)
	}
	assert.Contains(t, ae.Reason, "inequivalent arg 'x-queue-type'", "reason")
	err = c.Declare(ctx, []transport.QueueSpec{{Name: "missing", Passive: true}})
	if !errors.As(err, &ae) || ae.Code != amqp.NotFound {
		t.Errorf("passive declare of a missing queue = %v; want 404", err)
	}
	err = c.Publish(ctx, "", "q", amqp.Publishing{UserId: "mallory"})
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
		t.Errorf("publish with another user id = %v; want 406", err)
	}
}

// Server.Close ends every goroutine the server started: consumers' and the
// TTL clock.
func TestCloseEndsGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	m := NewServer()
	s, _ := (dialer{m}).Dial(context.Background(), "test")
	c := s.(*memConn)
	ctx := context.Background()
	require.NoError(t, c.Declare(ctx, []transport.QueueSpec{{Name: "q"}, {Name: "d", Args: amqp.Table{"x-message-ttl": int64(time.Hour / time.Millisecond)}}}))
	require.NoError(t, c.Publish(ctx, "", "d", amqp.Publishing{}))
	_, err := c.Consume("q", "a", 0)
	require.NoError(t, err)
	_, err = c.Consume("q", "b", 0) // never read from
	require.NoError(t, err)
	require.NoError(t, c.Publish(ctx, "", "q", amqp.Publishing{}))
	require.NoError(t, c.Publish(ctx, "", "q", amqp.Publishing{}))
	require.NoError(t, c.Cancel("a")) // cancelled with a delivery not taken
	require.NoError(t, c.Cancel("b"))
	require.NoError(t, c.Declare(ctx, []transport.QueueSpec{{Name: "q2"}}))
	_, err = c.Consume("q2", "c", 0)
	require.NoError(t, err)
	require.NoError(t, c.Publish(ctx, "", "q2", amqp.Publishing{}))
	require.NoError(t, c.Delete(ctx, []string{"q2"})) // cancelled by the server, not read from
	m.Close()
	if _, err := (dialer{m}).Dial(ctx, "test"); !errors.Is(err, transport.ErrClosed) {
		t.Errorf("dial after Close = %v; want ErrClosed", err)
	}
}

// A dead-letter cycle without a reject is dropped, not spun forever.
func TestDeadLetterCycle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		_, c := memSession(t, "a", amqp.Table{"x-message-ttl": int64(0), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "b"})
		ctx := context.Background()
		require.NoError(t, c.Declare(ctx, []transport.QueueSpec{{Name: "b", Args: amqp.Table{
			"x-message-ttl": int64(0), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "a"}}}))
		require.NoError(t, c.Publish(ctx, "", "a", amqp.Publishing{}))
		synctest.Wait() // the clock has run: at once, for a TTL of 0
		na, _ := c.Length(ctx, "a")
		nb, _ := c.Length(ctx, "b")
		assert.Equal(t, 0, na+nb, "messages left in the cycle")
	})
}

// Sender-selected distribution, as RabbitMQ 3.10 does it: the keys of the
// CC and BCC headers route a message as its routing key does, each queue
// gets one copy, and BCC is removed before delivery. Dead-lettering
// through a queue's routing key drops CC; without one, the message goes
// by all its keys. A header that is not an array of strings is refused
// before it is sent, as the broker's session refuses it (RabbitMQ would
// close the channel, or skip the element), and the session goes on.
func TestSenderSelectedDistribution(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		_, c := memSession(t, "q", nil)
		ctx := context.Background()
		for _, q := range []string{"cc", "bcc", "dlrk", "keys", "dead"} {
			require.NoError(t, c.Declare(ctx, []transport.QueueSpec{{Name: q}}))
		}
		require.NoError(t, c.Declare(ctx, []transport.QueueSpec{
			{Name: "ttl-dlrk", Args: amqp.Table{"x-message-ttl": int64(0), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "dead"}},
			{Name: "ttl", Args: amqp.Table{"x-message-ttl": int64(0), "x-dead-letter-exchange": ""}},
		}))
		take := func(q string) *amqp.Delivery {
			t.Helper()
			d, ok, err := c.Get(ctx, q)
			require.NoError(t, err)
			require.True(t, ok, "nothing in %s", q)
			require.NoError(t, d.Ack(false))
			return d
		}
		lengths := func() map[string]int {
			n := map[string]int{}
			for _, q := range []string{"q", "cc", "bcc", "dlrk", "keys", "dead", "ttl", "ttl-dlrk"} {
				n[q], _ = c.Length(ctx, q)
			}
			return n
		}

		require.NoError(t, c.Publish(ctx, "", "q", amqp.Publishing{Headers: amqp.Table{
			"CC": []any{"cc", "q", "nowhere"}, "BCC": []any{"bcc"}}}))
		assert.Equal(t, map[string]int{"q": 1, "cc": 1, "bcc": 1, "dlrk": 0, "keys": 0, "dead": 0, "ttl": 0, "ttl-dlrk": 0}, lengths())
		for _, q := range []string{"q", "cc", "bcc"} {
			d := take(q)
			assert.Equal(t, []any{"cc", "q", "nowhere"}, d.Headers["CC"], "%s: CC", q)
			assert.NotContains(t, d.Headers, "BCC", "%s: BCC", q)
		}

		require.NoError(t, c.Publish(ctx, "", "ttl-dlrk", amqp.Publishing{Headers: amqp.Table{"CC": []any{"cc"}}}))
		synctest.Wait()
		assert.Equal(t, map[string]int{"q": 0, "cc": 1, "bcc": 0, "dlrk": 0, "keys": 0, "dead": 1, "ttl": 0, "ttl-dlrk": 0}, lengths())
		take("cc")
		d := take("dead")
		assert.NotContains(t, d.Headers, "CC", "dead-lettered through a routing key")

		require.NoError(t, c.Publish(ctx, "", "ttl", amqp.Publishing{Headers: amqp.Table{"CC": []any{"keys"}, "BCC": []any{"bcc"}}}))
		synctest.Wait()
		assert.Equal(t, map[string]int{"q": 0, "cc": 0, "bcc": 2, "dlrk": 0, "keys": 2, "dead": 0, "ttl": 0, "ttl-dlrk": 0}, lengths())
		take("keys")
		d = take("keys")
		deaths := d.Headers["x-death"].([]any)
		assert.Equal(t, []any{"ttl", "keys"}, deaths[0].(amqp.Table)["routing-keys"], "x-death routing-keys: the key and CC's, not BCC's")
		assert.Equal(t, []any{"keys"}, d.Headers["CC"], "dead-lettered by its own keys")

		for _, h := range []amqp.Table{{"CC": "cc"}, {"BCC": []any{"bcc", int32(7)}}} {
			err := c.Publish(ctx, "", "q", amqp.Publishing{Headers: h})
			assert.ErrorIs(t, err, transport.ErrInvalidMessage, "%v", h)
		}
		require.NoError(t, c.Publish(ctx, "", "q", amqp.Publishing{}), "the session goes on")
		assert.Equal(t, map[string]int{"q": 1, "cc": 0, "bcc": 2, "dlrk": 0, "keys": 0, "dead": 0, "ttl": 0, "ttl-dlrk": 0}, lengths())
	})
}
