//go:build reliability

package reliability_test

// Scenario 12, a slow handler during a connection loss: the consumer
// reaches RabbitMQ through a TCP proxy. One order takes 20 s; two seconds
// into it, the proxy closes every connection through it, and an order is
// published right after. The consumer must connect again at once, not
// when the slow handler returns: the figure is the time from the cut to
// the effect of the new order. The slow handler finishes in the
// background; its result cannot be settled on the lost connection, so
// RabbitMQ redelivers its order, which Dedup finds busy (the slow handler
// holds the claim) and then done: each effect once.

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/url"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

func TestSlowHandlerConnectionCut(t *testing.T) {
	const hold = 20 * time.Second
	r := newRun(t, "slowcut", tiers...)
	u, err := url.Parse(r.amqpURL)
	require.NoError(t, err)
	target := u.Host
	if u.Port() == "" {
		target = net.JoinHostPort(u.Hostname(), "5672")
	}
	px := startProxy(t, target)
	u.Host = px.addr
	p := r.startConsumer("slowcut", consumerOpts{
		amqpURL: u.String(),
		workers: 4,
		mode:    "poison",
		hold:    hold,
		timeout: time.Minute,
		busy:    500 * time.Millisecond,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	publish := func(id, kind string) {
		body, _ := json.Marshal(map[string]string{"kind": kind})
		require.NoError(t, r.b.Publish(ctx, "", r.queue, amqp.Publishing{MessageId: id, Body: body}), "publish %s", id)
	}
	poll := func(what string, cond func() bool) time.Time {
		for !cond() {
			require.NoError(t, r.procsAlive())
			select {
			case <-ctx.Done():
				t.Fatalf("%s: %v", what, ctx.Err())
			case <-time.After(2 * time.Millisecond):
			}
		}
		return time.Now()
	}
	effects := func(id string) func() bool {
		return func() bool { n, _ := r.rdb.Get(ctx, r.prefix+"effect:"+id).Int(); return n > 0 }
	}

	publish("slow", "slow")
	started := poll("the slow order did not start", func() bool {
		n, _ := r.rdb.LLen(ctx, r.prefix+"events").Result()
		return n > 0
	})
	time.Sleep(2 * time.Second) // the fault comes two seconds into the handler
	px.heal()                   // not partitioned: it only closes the connections through it
	cut := time.Now()
	publish("new", "ok")
	handled := poll("the new order was never handled", effects("new"))
	resumed := handled.Sub(cut)
	poll("the slow order had no effect", effects("slow"))
	slowTook := time.Since(started)
	t.Logf("cut %v into the slow handler; the new order's effect came %v after the cut; the slow one's %v after its start",
		cut.Sub(started).Round(time.Millisecond), resumed.Round(time.Millisecond), slowTook.Round(time.Millisecond))

	ids := []string{"slow", "new"}
	require.NoError(t, r.awaitQuiet(ctx, len(ids), 3*time.Second))
	e := r.end(ctx, ids, p)
	e.wantEachOnce(t)
	if n := p.logCount(`msg="broker: connection lost"`); n != 1 {
		t.Errorf("consumer logged %d lost connections; want 1, the cut", n)
	}
	if limit := hold / 4; resumed > limit {
		t.Errorf("the first new delivery was handled %v after the cut; want well under the slow handler's %v (at most %v)", resumed, hold, limit)
	}
	t.Logf("consumer: %+v; took %v", e.stats[0], time.Since(began).Round(time.Millisecond))
	v := e.v
	record(t, v.counted(row{
		Scenario: "12 slow handler, connection cut",
		Messages: len(ids),
		Faults:   fmt.Sprintf("TCP proxy closes the connection %v into a %v handler", 2*time.Second, hold),
		Note:     fmt.Sprintf("first new delivery handled %v after the cut", resumed.Round(time.Millisecond)),
	}))
}
