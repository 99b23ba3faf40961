package broker

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
)

// memSession opens a raw session on a fresh Memory with queue q declared
// with args.
func memSession(t *testing.T, q string, args amqp.Table) (*Memory, *memConn) {
	t.Helper()
	m := NewMemory()
	t.Cleanup(m.Close)
	s, err := (&memTransport{m: m}).dial(context.Background(), "test")
	noErr(t, "dial", err)
	c := s.(*memConn)
	noErr(t, "declare", c.declare(context.Background(), []queueSpec{{name: q, args: args}}))
	return m, c
}

func TestMemoryAckAfterCloseAndUnknownTag(t *testing.T) {
	m, c := memSession(t, "q", nil)
	ctx := context.Background()
	noErr(t, "publish", c.publish(ctx, "", "q", amqp.Publishing{Body: []byte("x")}))
	d, ok, err := c.get(ctx, "q")
	if err != nil || !ok {
		t.Fatalf("get = %v, %t", err, ok)
	}
	noErr(t, "close", c.close())
	if err := d.Ack(false); !errors.Is(err, amqp.ErrClosed) {
		t.Errorf("Ack after close = %v; want amqp.ErrClosed", err)
	}
	equal(t, "requeued on close", m.stats().requeuedOnClose, 1)

	s, _ := (&memTransport{m: m}).dial(ctx, "test")
	c = s.(*memConn)
	d, _, _ = c.get(ctx, "q")
	equal(t, "Redelivered after the connection closed", d.Redelivered, true)
	noErr(t, "Ack", d.Ack(false))
	noErr(t, "second Ack (refused asynchronously, as on RabbitMQ)", d.Ack(false))
	select {
	case <-c.closed():
	default:
		t.Fatal("connection still open after an unknown delivery tag")
	}
	contains(t, "reason", c.reason().Error(), "unknown delivery tag 1")
	equal(t, "unknown tags", m.stats().unknownTags, 1)
}

func TestMemoryPrefetchAndMultiple(t *testing.T) {
	_, c := memSession(t, "q", nil)
	ctx := context.Background()
	for range 5 {
		noErr(t, "publish", c.publish(ctx, "", "q", amqp.Publishing{}))
	}
	ds, err := c.consume("q", "tag", 2)
	noErr(t, "consume", err)
	var got []amqp.Delivery
	for range 2 {
		got = append(got, <-ds)
	}
	select {
	case d := <-ds:
		t.Fatalf("third delivery %d with prefetch 2 and nothing settled", d.DeliveryTag)
	case <-time.After(50 * time.Millisecond):
	}
	n, _ := c.length(ctx, "q")
	equal(t, "ready with two unacked", n, 3)
	noErr(t, "Ack multiple", got[1].Ack(true))
	for range 2 {
		got = append(got, <-ds)
	}
	equal(t, "delivery tags", []uint64{got[0].DeliveryTag, got[1].DeliveryTag, got[2].DeliveryTag, got[3].DeliveryTag}, []uint64{1, 2, 3, 4})
	noErr(t, "Nack multiple with requeue", got[3].Nack(true, true))
	d := <-ds
	equal(t, "requeued message keeps its place", []any{d.DeliveryTag, d.Redelivered}, []any{uint64(5), true})
	noErr(t, "cancel", c.cancel("tag"))
	for range ds { // flushed, then closed
	}
}

func TestMemoryTTLDeadLettering(t *testing.T) {
	m, c := memSession(t, "work", nil)
	ctx := context.Background()
	noErr(t, "declare", c.declare(ctx, []queueSpec{{name: "delay", args: amqp.Table{
		"x-message-ttl": int64(30), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "work"}}}))
	for i := range 2 {
		noErr(t, "publish", c.publish(ctx, "", "delay", amqp.Publishing{MessageId: "m"}))
		eventually(t, 5*time.Second, "message not dead-lettered to work", func() bool { n, _ := c.length(ctx, "work"); return n == 1 })
		d, _, _ := c.get(ctx, "work")
		deaths := d.Headers["x-death"].([]any)
		equal(t, "x-death records", len(deaths), 1)
		death := deaths[0].(amqp.Table)
		equal(t, "x-death record", []any{death["queue"], death["reason"], death["exchange"], death["routing-keys"], death["count"]},
			[]any{"delay", "expired", "", []any{"delay"}, int64(1)})
		equal(t, "x-first-death-reason", d.Headers["x-first-death-reason"], "expired")
		equal(t, "routing key", d.RoutingKey, "work")
		if i == 0 {
			noErr(t, "Ack", d.Ack(false))
			continue
		}
		// Republish the delivered copy to the delay queue, as the broker
		// does: the count grows, the record stays single.
		noErr(t, "publish", c.publish(ctx, "", "delay", amqp.Publishing{MessageId: "m", Headers: d.Headers}))
		noErr(t, "Ack", d.Ack(false))
		eventually(t, 5*time.Second, "message not dead-lettered again", func() bool { n, _ := c.length(ctx, "work"); return n == 1 })
		d, _, _ = c.get(ctx, "work")
		deaths = d.Headers["x-death"].([]any)
		equal(t, "x-death records after a second hop", len(deaths), 1)
		equal(t, "x-death count after a second hop", deaths[0].(amqp.Table)["count"], int64(2))
	}
	_ = m
}

func TestMemoryDeclareEquivalence(t *testing.T) {
	_, c := memSession(t, "q", amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int32(5)})
	ctx := context.Background()
	noErr(t, "same arguments, other integer type", c.declare(ctx, []queueSpec{{name: "q", args: amqp.Table{"x-queue-type": "quorum", "x-message-ttl": int64(5)}}}))
	err := c.declare(ctx, []queueSpec{{name: "q", args: amqp.Table{"x-message-ttl": int64(5)}}})
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
		t.Fatalf("declare without x-queue-type = %v; want 406", err)
	}
	contains(t, "reason", ae.Reason, "inequivalent arg 'x-queue-type'")
	err = c.declare(ctx, []queueSpec{{name: "missing", passive: true}})
	if !errors.As(err, &ae) || ae.Code != amqp.NotFound {
		t.Errorf("passive declare of a missing queue = %v; want 404", err)
	}
	err = c.publish(ctx, "", "q", amqp.Publishing{UserId: "mallory"})
	if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
		t.Errorf("publish with another user id = %v; want 406", err)
	}
}

// Memory.Close ends every goroutine the server started: consumers' and the
// TTL clock.
func TestMemoryCloseEndsGoroutines(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	m := NewMemory()
	s, _ := (&memTransport{m: m}).dial(context.Background(), "test")
	c := s.(*memConn)
	ctx := context.Background()
	noErr(t, "declare", c.declare(ctx, []queueSpec{{name: "q"}, {name: "d", args: amqp.Table{"x-message-ttl": int64(time.Hour / time.Millisecond)}}}))
	noErr(t, "publish", c.publish(ctx, "", "d", amqp.Publishing{}))
	_, err := c.consume("q", "a", 0)
	noErr(t, "consume", err)
	_, err = c.consume("q", "b", 0) // never read from
	noErr(t, "consume", err)
	noErr(t, "publish", c.publish(ctx, "", "q", amqp.Publishing{}))
	noErr(t, "publish", c.publish(ctx, "", "q", amqp.Publishing{}))
	noErr(t, "cancel", c.cancel("a")) // cancelled with a delivery not taken
	noErr(t, "cancel", c.cancel("b"))
	noErr(t, "declare", c.declare(ctx, []queueSpec{{name: "q2"}}))
	_, err = c.consume("q2", "c", 0)
	noErr(t, "consume", err)
	noErr(t, "publish", c.publish(ctx, "", "q2", amqp.Publishing{}))
	noErr(t, "delete", c.delete(ctx, []string{"q2"})) // cancelled by the server, not read from
	m.Close()
	if _, err := (&memTransport{m: m}).dial(ctx, "test"); !errors.Is(err, ErrClosed) {
		t.Errorf("dial after Close = %v; want ErrClosed", err)
	}
}

// A dead-letter cycle without a reject is dropped, not spun forever.
func TestMemoryDeadLetterCycle(t *testing.T) {
	_, c := memSession(t, "a", amqp.Table{"x-message-ttl": int64(0), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "b"})
	ctx := context.Background()
	noErr(t, "declare", c.declare(ctx, []queueSpec{{name: "b", args: amqp.Table{
		"x-message-ttl": int64(0), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "a"}}}))
	noErr(t, "publish", c.publish(ctx, "", "a", amqp.Publishing{}))
	time.Sleep(50 * time.Millisecond)
	na, _ := c.length(ctx, "a")
	nb, _ := c.length(ctx, "b")
	equal(t, "messages left in the cycle", na+nb, 0)
}

// Many reconnects leave no goroutine behind while Consume keeps running:
// each session's pumps end with it, and each handler's goroutine with its
// handler.
func TestMemoryReconnectsLeakNothing(t *testing.T) {
	f := setupWith(t, backends[0], Topology{}, 20*time.Millisecond)
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return nil
	}), ConsumeOptions{Workers: 4})
	sessions := func() int { return f.logs.count("broker: consuming") }
	eventually(t, 10*time.Second, "not consuming", func() bool { return sessions() == 1 })
	settle := func() int {
		time.Sleep(20 * time.Millisecond)
		return runtime.NumGoroutine()
	}
	base := settle()
	for i := range 20 {
		f.mem.CloseConnections()
		eventually(t, 10*time.Second, "consumer did not reconnect", func() bool { return sessions() == i+2 })
		f.publish(fmt.Sprint("r", i), nil, nil)
	}
	eventually(t, 10*time.Second, "messages not handled", func() bool { return j.effected() == 20 })
	if n := settle(); n > base+2 {
		t.Errorf("goroutines after 20 reconnects = %d; want about %d, as before", n, base)
	}
	noErr(t, "Consume after cancel", r.stop(t))
}

// The cycle rule on x-death as the server leaves it, the new record first
// (the cases that a real server can run are in the DeadLetterCycleRule
// behaviour).
func TestMemoryDeadLetterCycleRule(t *testing.T) {
	rec := func(queue, reason string) amqp.Table {
		return amqp.Table{"queue": queue, "reason": reason, "count": int64(1)}
	}
	tests := []struct {
		name   string
		deaths any
		cycle  bool
	}{
		{"none", nil, false},
		{"not an array", "x", false},
		{"only other queues", []any{rec("q.delay.1s", "expired"), rec("other", "maxlen")}, false},
		{"the target, automatic", []any{rec("q.delay.1s", "expired"), rec("q", "delivery_limit")}, true},
		{"the target itself, at once", []any{rec("q", "expired")}, true},
		{"the target, rejected", []any{rec("q.delay.1s", "expired"), rec("q", "rejected")}, false},
		{"a reject on the way", []any{rec("q.delay.1s", "expired"), rec("other", "rejected"), rec("q", "expired")}, false},
		{"a reject before", []any{rec("q.delay.1s", "expired"), rec("q", "expired"), rec("other", "rejected")}, true},
		{"a string on the way", []any{rec("q.delay.1s", "expired"), "legacy", rec("q", "expired")}, false},
	}
	for _, tt := range tests {
		if got := deadLetterCycle(tt.deaths, "q"); got != tt.cycle {
			t.Errorf("deadLetterCycle(%s) = %v; want %v", tt.name, got, tt.cycle)
		}
	}
}
