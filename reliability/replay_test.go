//go:build reliability

package reliability_test

// Scenario 9, a replay of server dead-letters: messages that RabbitMQ
// itself dead-lettered out of the work queue (they expired there; they went
// past a quorum queue's delivery limit) are published back into it with
// their headers, as an operator or a shovel does, and fail once before they
// succeed. Their x-death names the work queue, and RabbitMQ drops a message
// whose x-death makes its dead-lettering look like a cycle: the copy sent
// to a delay queue must come back all the same. Each must have its effect
// once, none lost.

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
)

const replayMessages = 100 // per case

var replayDelays = []time.Duration{100 * time.Millisecond, time.Second}

func TestReplayOfServerDeadLetters(t *testing.T) {
	cases := []struct {
		name, reason string
		topo         broker.Topology
		faults       string
	}{
		{"expired", "expired", broker.Topology{Delays: replayDelays},
			"published with a 1 ms Expiration, expired in the work queue; replayed from the DLQ"},
		{"delivery limit", "delivery_limit", broker.Topology{Delays: replayDelays, Quorum: true, DeliveryLimit: 1},
			"quorum queue, delivery limit 1, each nacked until dead-lettered; replayed from the DLQ"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			began := time.Now()
			r := newRunWith(t, "replay", c.topo)
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
			defer cancel()

			var msgs []amqp.Publishing
			var ids []string
			for i := range replayMessages {
				id := fmt.Sprintf("replay-%03d", i)
				ids = append(ids, id)
				m := amqp.Publishing{MessageId: id, ContentType: "application/json", Body: order("once", 0)}
				if c.reason == "expired" {
					m.Expiration = "1"
				}
				msgs = append(msgs, m)
			}
			require.NoError(t, <-r.publishAsync(ctx, msgs, 8))
			if c.reason == "delivery_limit" {
				r.overDeliveryLimit(ctx)
			}
			dead := r.awaitDLQ(ctx, replayMessages)
			for _, d := range dead {
				if got := firstDeath(d); got != r.queue+" "+c.reason {
					t.Fatalf("%s in the DLQ with x-death %v; want its first record %q", d.MessageId, d.Headers["x-death"], r.queue+" "+c.reason)
				}
			}
			replays := make([]amqp.Publishing, len(dead))
			for i, d := range dead {
				replays[i] = amqp.Publishing{MessageId: d.MessageId, ContentType: d.ContentType, Headers: d.Headers, Body: d.Body}
			}
			require.NoError(t, <-r.publishAsync(ctx, replays, 8))

			p := r.startConsumer("replay", consumerOpts{mode: "poison", backoffMin: 50 * time.Millisecond, backoffMax: 100 * time.Millisecond, countDeliveries: true})
			quiet, cancelQuiet := context.WithTimeout(ctx, 20*time.Second)
			assert.NoError(t, r.awaitQuiet(quiet, replayMessages, 2*time.Second))
			cancelQuiet()
			e := r.end(ctx, ids, p)
			e.wantEachOnce(t)
			deliveries, calls := r.sum(ctx, "deliveries:", ids), r.sum(ctx, "attempts:", ids)
			t.Logf("%d replayed; consumer %+v; %d deliveries, %d handler calls; took %v",
				len(replays), e.stats[0], deliveries, calls, time.Since(began).Round(time.Millisecond))
			record(t, row{
				Scenario:     "9 replay of server dead-letters, " + c.name,
				Messages:     replayMessages,
				Faults:       c.faults,
				Once:         len(e.v.once),
				Twice:        len(e.v.twice),
				Lost:         len(e.v.lost),
				DeadLettered: len(e.dead),
				Note: fmt.Sprintf("x-death reason %s; the handler fails each at its first call, which goes to the %v delay queue: %d deliveries, %d handler calls",
					c.reason, replayDelays[0], deliveries, calls),
			})
		})
	}
}

// overDeliveryLimit takes the messages of the run's quorum queue and
// returns them, until the server has dead-lettered every one past the
// queue's delivery limit.
func (r *run) overDeliveryLimit(ctx context.Context) {
	r.t.Helper()
	for range 10 * replayMessages * (r.topo.DeliveryLimit + 1) {
		d, ok, err := r.b.Get(ctx, r.queue)
		require.NoError(r.t, err)
		if !ok {
			return
		}
		require.NoError(r.t, d.Nack(false, true))
	}
	r.t.Fatalf("%s not empty after %d returns", r.queue, 10*replayMessages*(r.topo.DeliveryLimit+1))
}

// awaitDLQ waits until the dead-letter queue holds n messages, and takes
// them out.
func (r *run) awaitDLQ(ctx context.Context, n int) []*amqp.Delivery {
	r.t.Helper()
	for {
		got, err := r.b.Len(ctx, r.queue+".dlq")
		require.NoError(r.t, err)
		if got >= n {
			break
		}
		select {
		case <-ctx.Done():
			r.t.Fatalf("the DLQ holds %d messages; want %d: %v", got, n, ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
	dead, err := r.drainDLQ(ctx)
	require.NoError(r.t, err)
	return dead
}

// firstDeath returns "queue reason" of d's first x-death record.
func firstDeath(d *amqp.Delivery) string {
	deaths, _ := d.Headers["x-death"].([]any)
	if len(deaths) == 0 {
		return ""
	}
	rec, _ := deaths[0].(amqp.Table)
	return fmt.Sprintf("%v %v", rec["queue"], rec["reason"])
}

// sum adds up the run's counters prefix<id> of ids.
func (r *run) sum(ctx context.Context, prefix string, ids []string) int64 {
	var n int64
	for _, id := range ids {
		v, err := r.rdb.Get(ctx, r.prefix+prefix+id).Result()
		if err != nil {
			continue // absent: none
		}
		i, _ := strconv.ParseInt(v, 10, 64)
		n += i
	}
	return n
}
