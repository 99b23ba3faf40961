package brokertest

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
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
	noErr(t, "dial", err)
	c := s.(*memConn)
	noErr(t, "declare", c.Declare(context.Background(), []transport.QueueSpec{{Name: q, Args: args}}))
	return m, c
}

func TestAckAfterCloseAndUnknownTag(t *testing.T) {
	m, c := memSession(t, "q", nil)
	ctx := context.Background()
	noErr(t, "publish", c.Publish(ctx, "", "q", amqp.Publishing{Body: []byte("x")}))
	d, ok, err := c.Get(ctx, "q")
	if err != nil || !ok {
		t.Fatalf("get = %v, %t", err, ok)
	}
	noErr(t, "close", c.Close())
	if err := d.Ack(false); !errors.Is(err, amqp.ErrClosed) {
		t.Errorf("Ack after close = %v; want amqp.ErrClosed", err)
	}
	equal(t, "requeued on close", m.Stats().RequeuedOnClose, 1)

	s, _ := (dialer{m}).Dial(ctx, "test")
	c = s.(*memConn)
	d, _, _ = c.Get(ctx, "q")
	equal(t, "Redelivered after the connection closed", d.Redelivered, true)
	noErr(t, "Ack", d.Ack(false))
	noErr(t, "second Ack (refused asynchronously, as on RabbitMQ)", d.Ack(false))
	select {
	case <-c.Closed():
	default:
		t.Fatal("connection still open after an unknown delivery tag")
	}
	contains(t, "reason", c.Reason().Error(), "unknown delivery tag 1")
	equal(t, "unknown tags", m.Stats().UnknownTags, 1)
}

func TestPrefetchAndMultiple(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		_, c := memSession(t, "q", nil)
		ctx := context.Background()
		for range 5 {
			noErr(t, "publish", c.Publish(ctx, "", "q", amqp.Publishing{}))
		}
		ds, err := c.Consume("q", "tag", 2)
		noErr(t, "consume", err)
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
		equal(t, "ready with two unacked", n, 3)
		noErr(t, "Ack multiple", got[1].Ack(true))
		for range 2 {
			got = append(got, <-ds)
		}
		equal(t, "delivery tags", []uint64{got[0].DeliveryTag, got[1].DeliveryTag, got[2].DeliveryTag, got[3].DeliveryTag}, []uint64{1, 2, 3, 4})
		noErr(t, "Nack multiple with requeue", got[3].Nack(true, true))
		d := <-ds
		equal(t, "requeued message keeps its place", []any{d.DeliveryTag, d.Redelivered}, []any{uint64(5), true})
		noErr(t, "cancel", c.Cancel("tag"))
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
		noErr(t, "declare", c.Declare(ctx, []transport.QueueSpec{{Name: "delay", Args: amqp.Table{
			"x-message-ttl": int64(30), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "work"}}}))
		// expire publishes a message to the delay queue and returns it as it
		// comes out in the work queue, after the TTL.
		expire := func(msg amqp.Publishing) *amqp.Delivery {
			t.Helper()
			noErr(t, "publish", c.Publish(ctx, "", "delay", msg))
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
		equal(t, "x-death records", len(deaths), 1)
		death := deaths[0].(amqp.Table)
		equal(t, "x-death record", []any{death["queue"], death["reason"], death["exchange"], death["routing-keys"], death["count"]},
			[]any{"delay", "expired", "", []any{"delay"}, int64(1)})
		equal(t, "x-first-death-reason", d.Headers["x-first-death-reason"], "expired")
		equal(t, "routing key", d.RoutingKey, "work")
		// Republish the delivered copy to the delay queue, as the broker
		// does: the count grows, the record stays single.
		noErr(t, "Ack", d.Ack(false))
		d = expire(amqp.Publishing{MessageId: "m", Headers: d.Headers})
		noErr(t, "Ack", d.Ack(false))
		deaths = d.Headers["x-death"].([]any)
		equal(t, "x-death records after a second hop", len(deaths), 1)
		equal(t, "x-death count after a second hop", deaths[0].(amqp.Table)["count"], int64(2))
	})
}

func TestDeclareEquivalence(t *testing.T) {
	_, c := memSession(t, "q", amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int32(5)})
	ctx := context.Background()
	noErr(t, "same arguments, other integer type", c.Declare(ctx, []transport.QueueSpec{{Name: "q", Args: amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int64(5)}}}))
	err := c.Declare(ctx, []transport.QueueSpec{{Name: "q", Args: amqp.Table{"x-message-ttl": int64(5)}}})
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
		t.Fatalf("declare without x-queue-type = %v; want 406", err)
	}
	contains(t, "reason", ae.Reason, "inequivalent arg 'x-queue-type'")
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
	noErr(t, "declare", c.Declare(ctx, []transport.QueueSpec{{Name: "q"}, {Name: "d", Args: amqp.Table{"x-message-ttl": int64(time.Hour / time.Millisecond)}}}))
	noErr(t, "publish", c.Publish(ctx, "", "d", amqp.Publishing{}))
	_, err := c.Consume("q", "a", 0)
	noErr(t, "consume", err)
	_, err = c.Consume("q", "b", 0) // never read from
	noErr(t, "consume", err)
	noErr(t, "publish", c.Publish(ctx, "", "q", amqp.Publishing{}))
	noErr(t, "publish", c.Publish(ctx, "", "q", amqp.Publishing{}))
	noErr(t, "cancel", c.Cancel("a")) // cancelled with a delivery not taken
	noErr(t, "cancel", c.Cancel("b"))
	noErr(t, "declare", c.Declare(ctx, []transport.QueueSpec{{Name: "q2"}}))
	_, err = c.Consume("q2", "c", 0)
	noErr(t, "consume", err)
	noErr(t, "publish", c.Publish(ctx, "", "q2", amqp.Publishing{}))
	noErr(t, "delete", c.Delete(ctx, []string{"q2"})) // cancelled by the server, not read from
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
		noErr(t, "declare", c.Declare(ctx, []transport.QueueSpec{{Name: "b", Args: amqp.Table{
			"x-message-ttl": int64(0), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "a"}}}))
		noErr(t, "publish", c.Publish(ctx, "", "a", amqp.Publishing{}))
		synctest.Wait() // the clock has run: at once, for a TTL of 0
		na, _ := c.Length(ctx, "a")
		nb, _ := c.Length(ctx, "b")
		equal(t, "messages left in the cycle", na+nb, 0)
	})
}

func noErr(t *testing.T, what string, err error) {
	t.Helper()
	if err != nil {
		t.Fatalf("%s = %v; want nil", what, err)
	}
}

func equal(t *testing.T, what string, got, want any) {
	t.Helper()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s = %#v; want %#v", what, got, want)
	}
}

func contains(t *testing.T, what, s, sub string) {
	t.Helper()
	if !strings.Contains(s, sub) {
		t.Errorf("%s = %q; want it to contain %q", what, s, sub)
	}
}
