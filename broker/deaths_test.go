package broker

import (
	"context"
	"maps"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
)

// RabbitMQ 3.10's rule for dead-letter cycles, and how it updates x-death,
// which the memory server must model: messages with hand-made x-death
// headers expire out of a delay queue into the work queue Q (or are
// rejected out of Q into Q.dlq), and either arrive or are dropped.
//
// The server first adds the new record to x-death: with x-death absent, it
// sets x-first-death-* (over any stale ones); with two records or more, it
// reverses their order on the way (it regroups them by queue and reason);
// a record of the same queue and reason keeps its time, exchange and
// routing keys, and counts one more. Then, unless the reason is rejected,
// it drops the message when the records, most recent first, reach one
// that names the target queue with no rejected record on the way.
func testDeadLetterCycleRule(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	delay := f.q + ".delay.50ms"
	old := time.Unix(1000000000, 0)
	rec := func(queue, reason string) amqp.Table {
		return amqp.Table{"count": int64(1), "reason": reason, "queue": queue, "time": old, "exchange": "", "routing-keys": []any{queue}}
	}
	stale := amqp.Table{"x-first-death-queue": "stale", "x-first-death-reason": "maxlen", "x-first-death-exchange": "stale-x"}
	// with returns h with x-death = deaths, or none if deaths is nil.
	with := func(h amqp.Table, deaths []any) amqp.Table {
		h = maps.Clone(h)
		if h == nil {
			h = amqp.Table{}
		}
		if deaths != nil {
			h["x-death"] = deaths
		}
		return h
	}
	cases := []struct {
		id      string
		headers amqp.Table
		arrives bool
	}{
		{"none", nil, true},
		{"empty", with(stale, []any{}), true},
		{"absent-stale-first", with(stale, nil), true},
		{"work-queue-expired", with(nil, []any{rec(f.q, "expired")}), false},
		{"work-queue-rejected", with(nil, []any{rec(f.q, "rejected")}), true},
		{"work-queue-then-reject", with(nil, []any{rec(f.q, "expired"), rec("elsewhere", "rejected")}), true},
		{"reject-then-work-queue", with(nil, []any{rec("elsewhere", "rejected"), rec(f.q, "expired")}), false},
		{"delay-again", with(nil, []any{amqp.Table{"count": int64(4), "reason": "expired", "queue": delay, "time": old, "exchange": "old-x", "routing-keys": []any{"old-k"}}, rec("elsewhere", "rejected")}), true},
	}
	ctx := testContext(t, 30*time.Second)
	for _, c := range cases {
		require.NoError(t, f.b.Publish(ctx, "", delay, amqp.Publishing{MessageId: c.id, Headers: c.headers}), "Publish "+c.id)
	}
	// The delay queue dead-letters in order: once the last one arrives,
	// every case has arrived or was dropped.
	require.NoError(t, f.b.Publish(ctx, "", delay, amqp.Publishing{MessageId: "end"}), "Publish end")
	got := map[string]*amqp.Delivery{}
	require.Eventually(t, func() bool {
		for _, d := range f.polledDrain(f.q) {
			got[d.MessageId] = d
		}
		return got["end"] != nil
	}, 20*time.Second, 10*time.Millisecond, "the last message did not arrive")
	for _, c := range cases {
		if _, ok := got[c.id]; ok != c.arrives {
			t.Errorf("%s arrived: %v; want %v", c.id, ok, c.arrives)
		}
	}
	first := func(d *amqp.Delivery) []any {
		if d == nil {
			return nil
		}
		return []any{d.Headers["x-first-death-queue"], d.Headers["x-first-death-reason"], d.Headers["x-first-death-exchange"]}
	}
	assert.Equal(t, []any{delay, "expired", ""}, first(got["none"]), "x-first-death-* set at the first death")
	assert.Equal(t, []any{"stale", "maxlen", "stale-x"}, first(got["empty"]), "x-first-death-* kept with an empty x-death")
	assert.Equal(t, []any{delay, "expired", ""}, first(got["absent-stale-first"]), "x-first-death-* rewritten without x-death")
	if d := got["work-queue-then-reject"]; d != nil {
		assert.Equal(t, []string{delay + " expired 1", "elsewhere rejected 1", f.q + " expired 1"}, fixtures.DeathKeys(d.Headers["x-death"]), "records of work-queue-then-reject")
	}
	if d := got["delay-again"]; d != nil {
		deaths, _ := d.Headers["x-death"].([]any)
		assert.Equal(t, []string{delay + " expired 5", "elsewhere rejected 1"}, fixtures.DeathKeys(deaths), "records of delay-again")
		if len(deaths) > 0 {
			r, _ := deaths[0].(amqp.Table)
			assert.Equal(t, []any{old, "old-x", []any{"old-k"}}, []any{r["time"], r["exchange"], r["routing-keys"]}, "a counted record keeps its time, exchange and routing keys")
		}
	}

	// A reject is never a cycle: rejected out of Q into Q.dlq, with a
	// record of Q.dlq in x-death.
	require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: "rejected", Headers: with(nil, []any{rec(f.q+".dlq", "expired")})}), "Publish")
	d, ok, err := f.b.Get(ctx, f.q)
	require.NoError(t, err, "Get")
	if !ok {
		t.Fatal("Get found no message")
	}
	require.NoError(t, d.Reject(false), "Reject")
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 10*time.Second, 10*time.Millisecond, "a rejected message whose x-death names the dead-letter queue was dropped")
	f.drain(f.q + ".dlq")
	f.assertSettled(t)
}

// Messages that the server dead-lettered out of the work queue because
// they expired there, replayed into it with their headers (as an operator
// or a shovel does), and failing once.
func testReplayExpired(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 20*time.Second)
	for _, id := range []string{"ok", "dead"} {
		require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: id, Body: []byte(id), Expiration: "1"}), "Publish")
	}
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 2 }, 20*time.Second, 10*time.Millisecond, "expired messages not dead-lettered")
	f.replay(t, "expired")
}

// The same for messages that a quorum queue dead-lettered past its
// delivery limit.
func testReplayDeliveryLimit(t *testing.T, be backend) {
	f := setup(t, be, Topology{Quorum: true, DeliveryLimit: 1})
	ctx := testContext(t, 20*time.Second)
	for _, id := range []string{"ok", "dead"} {
		f.publish(id, []byte(id), nil)
	}
	for range 20 {
		d, ok, err := f.b.Get(ctx, f.q)
		require.NoError(t, err, "Get")
		if !ok {
			break
		}
		require.NoError(t, d.Nack(false, true), "Nack")
	}
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 2 }, 20*time.Second, 10*time.Millisecond, "messages not dead-lettered by the delivery limit")
	f.replay(t, "delivery_limit")
}

// replay takes the messages "ok" and "dead" out of the dead-letter queue,
// where the server put them, leaving the work queue for reason, and
// publishes them back to the work queue with their headers. The handler
// asks for a retry at each one's first call; then "ok" succeeds, and "dead"
// fails for good. Each must come back from the delay queue; the handler sees
// x-death without the records of the work queue, which are in HeaderDeaths;
// the dead-lettered copy has them back in x-death. Then "dead" is replayed
// once more, with the same outcome, and its records count both rounds.
func (f *fixture) replay(t *testing.T, reason string) {
	t.Helper()
	ctx := testContext(t, 30*time.Second)
	delay := f.q + ".delay.50ms"
	for _, d := range f.drain(f.q + ".dlq") {
		assert.Equal(t, []string{f.q + " " + reason + " 1"}, fixtures.DeathKeys(d.Headers["x-death"]), d.MessageId+": records as the server dead-lettered it")
		require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: d.MessageId, Body: d.Body, Headers: d.Headers}), "replay")
	}
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		n := j.record(d)
		switch {
		case n == 1, d.MessageId == "dead" && n == 3:
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		case d.MessageId == "dead":
			return rabbitmw.Permanent(errBoom)
		}
		return nil
	}), ConsumeOptions{})
	require.Eventually(t, func() bool {
		return len(j.callsOf("ok")) == 2 && len(j.callsOf("dead")) == 2 && f.polledLength(f.q+".dlq") == 1
	}, 20*time.Second, 10*time.Millisecond, "replayed messages not handled after their retry")
	for _, id := range []string{"ok", "dead"} {
		d := j.callsOf(id)[1].d
		assert.Equal(t, []string{delay + " expired 1"}, fixtures.DeathKeys(d.Headers["x-death"]), id+": x-death after the delay hop")
		assert.Equal(t, []string{f.q + " " + reason + " 1"}, fixtures.DeathKeys(d.Headers[HeaderDeaths]), id+": "+HeaderDeaths+" after the delay hop")
		assert.Equal(t, f.q, d.Headers["x-first-death-queue"], id+": x-first-death-queue")
		assert.Equal(t, reason, d.Headers["x-first-death-reason"], id+": x-first-death-reason")
	}
	dead := f.onlyDeadLetter()
	assert.Equal(t, []string{delay + " expired 1", f.q + " " + reason + " 1"}, fixtures.DeathKeys(dead.Headers["x-death"]), "x-death of the dead-lettered copy")
	if v, ok := dead.Headers[HeaderDeaths]; ok {
		t.Errorf("%s = %v on the dead-lettered copy; want it back in x-death", HeaderDeaths, v)
	}
	assert.Equal(t, f.q, dead.Headers["x-first-death-queue"], "x-first-death-queue of the dead-lettered copy")

	// Replayed again, it fails again: one more hop counted.
	require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: dead.MessageId, Body: dead.Body, Headers: dead.Headers}), "replay")
	require.Eventually(t, func() bool {
		return len(j.callsOf("dead")) == 4 && f.polledLength(f.q+".dlq") == 1
	}, 20*time.Second, 10*time.Millisecond, "message replayed twice not handled after its retry")
	require.NoError(t, r.stop(t), "Consume after cancel")
	dead = f.onlyDeadLetter()
	assert.Equal(t, []string{delay + " expired 2", f.q + " " + reason + " 1"}, fixtures.DeathKeys(dead.Headers["x-death"]), "x-death of the message dead-lettered twice")
	assert.Equal(t, 2, len(j.callsOf("ok")), "handler calls of ok")
	f.assertSettled(t)
	for _, tr := range f.top.Delays {
		assert.Equal(t, 0, f.length(f.q+".delay."+tierName(tr)), "Len(delay queue "+tierName(tr)+")")
	}
}
