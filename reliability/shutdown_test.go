//go:build reliability

package reliability_test

// Scenario 11, shutdown past its deadline: a consumer holds 16 slow orders
// (one per worker) when it gets SIGTERM. Its ShutdownTimeout (300 ms)
// passes, the handlers' context is cancelled, and each returns its result
// all the same: a delay, whose copy goes to the delay queue, or a
// dead-letter, whose copy goes to the dead-letter queue. Each must be
// settled once: the copy confirmed, then the original acked. Three rounds,
// a new consumer and a SIGTERM each; the orders a consumer had received
// but not started go back to the work queue for the next one.
//
// The figure is the number of messages that exist twice: in the work queue
// and in a delay queue or the dead-letter queue, or twice in one of them.
// The window in which that can still happen (a copy confirmed, then the
// ack of its original lost with the connection) needs a lost connection,
// and none is lost here: the figure must be 0.

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

func TestShutdownPastDeadline(t *testing.T) {
	const (
		rounds  = 3
		workers = 16
		orders  = 200
	)
	// One long tier: a delayed copy stays in its delay queue until the
	// test has counted it.
	r := newRun(t, "shutdown", 5*time.Minute)
	opts := consumerOpts{
		workers:         workers,
		prefetch:        2 * workers,
		mode:            "poison",
		hold:            20 * time.Second,
		timeout:         time.Minute,
		shutdownTimeout: 300 * time.Millisecond,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()

	var ids []string
	for i := range orders {
		kind := "slow-later"
		if i%2 == 1 {
			kind = "slow-poison"
		}
		id := fmt.Sprintf("s-%03d", i)
		ids = append(ids, id)
		body, _ := json.Marshal(map[string]string{"kind": kind})
		require.NoError(t, r.b.Publish(ctx, "", r.queue, amqp.Publishing{MessageId: id, Body: body}), "publish %s", id)
	}
	var settleErrors int64
	for i := range rounds {
		p := r.startConsumer(fmt.Sprintf("shutdown-%d", i+1), opts)
		// Every worker holds an order.
		want := int64((i + 1) * workers)
		for {
			n, err := r.rdb.LLen(ctx, r.prefix+"events").Result()
			require.NoError(t, err)
			if n >= want {
				break
			}
			require.NoError(t, r.procsAlive())
			select {
			case <-ctx.Done():
				t.Fatalf("round %d: %d handlers started; want %d", i+1, n, want)
			case <-time.After(5 * time.Millisecond):
			}
		}
		st, err := p.stop(30 * time.Second)
		require.NoError(t, err, "round %d", i+1)
		settleErrors += st.SettleErrors
		t.Logf("round %d: %+v", i+1, st)
	}

	// Where each order is now.
	queues := append([]string{r.queue}, r.delayQueues()...)
	queues = append(queues, r.queue+".dlq")
	copies := map[string][]string{}
	for _, q := range queues {
		for {
			d, ok, err := r.b.Get(ctx, q)
			require.NoError(t, err, "get from %s", q)
			if !ok {
				break
			}
			copies[d.MessageId] = append(copies[d.MessageId], q)
			require.NoError(t, d.Ack(false))
		}
	}
	var once, twice, extra, lost, dead int
	var examples []string
	for _, id := range ids {
		switch n := len(copies[id]); {
		case n == 0:
			lost++
		case n == 1:
			once++
		default:
			twice++
			extra += n - 1
			if len(examples) < 3 {
				examples = append(examples, fmt.Sprintf("%s in %v", id, copies[id]))
			}
		}
		for _, q := range copies[id] {
			if q == r.queue+".dlq" {
				dead++
				break
			}
		}
	}
	r.checkLogs()
	if lost > 0 {
		t.Errorf("%d orders in no queue; want none", lost)
	}
	if twice > 0 {
		t.Errorf("%d orders exist twice or more, %d copies too many (first: %v); want none", twice, extra, examples)
	}
	t.Logf("%d orders: %d in one place, %d twice or more (%d copies too many), %d lost; %d settlements failed; took %v",
		orders, once, twice, extra, lost, settleErrors, time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "11 shutdown past its deadline",
		Messages:     orders,
		Faults:       fmt.Sprintf("%d × SIGTERM with %d slow handlers, ShutdownTimeout 300 ms", rounds, workers),
		Once:         once,
		Twice:        twice,
		Lost:         lost,
		DeadLettered: dead,
		Note:         fmt.Sprintf("once/twice count copies, not effects, of results (delay, dead-letter) returned after the deadline: %d messages existed twice or more, %d copies too many", twice, extra),
	})
}
