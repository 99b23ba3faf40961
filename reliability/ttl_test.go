//go:build reliability

package reliability_test

// Scenario 16, dead letters with a per-message TTL: messages published
// with an Expiration are dead-lettered (half at once, refused; half after
// their retries through the delay queues), and the dead-letter queue is
// listed after their TTL has passed. Nothing in a dead-letter queue may
// expire: each must still be there, without an Expiration, its original
// kept in a header.

import (
	"context"
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
)

const (
	ttlMessages = 100
	ttl         = 3 * time.Second
)

func TestDeadLettersOutliveTheirTTL(t *testing.T) {
	began := time.Now()
	r := newRun(t, "ttl", tiers...)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	p := r.startConsumer("ttl", consumerOpts{mode: "poison", maxAttempts: 3, backoffMin: 50 * time.Millisecond, backoffMax: 100 * time.Millisecond})
	var msgs []amqp.Publishing
	var ids []string
	for i := range ttlMessages {
		kind := "poison" // refused: dead-lettered at its first attempt
		if i%2 == 1 {
			kind = "fail" // dead-lettered after 3 attempts
		}
		id := fmt.Sprintf("ttl-%s-%03d", kind, i)
		ids = append(ids, id)
		msgs = append(msgs, amqp.Publishing{MessageId: id, ContentType: "application/json",
			Expiration: fmt.Sprint(ttl.Milliseconds()), Body: order(kind, 0)})
	}
	require.NoError(t, <-r.publishAsync(ctx, msgs, 8))
	deadline, _ := ctx.Deadline()
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		n, err := r.b.Len(ctx, r.queue+".dlq")
		assert.NoError(c, err)
		assert.GreaterOrEqual(c, n, ttlMessages, "messages in the DLQ")
	}, time.Until(deadline), 50*time.Millisecond)
	full := time.Now()
	time.Sleep(ttl + time.Second) // the server's expiry is real time
	dls, err := deadletter.New(r.b).List(ctx, r.queue, deadletter.ListOptions{})
	require.NoError(t, err)
	listed := map[string]bool{}
	kept := 0 // without an Expiration, the original in its header
	for _, dl := range dls {
		listed[dl.ID] = true
		d := dl.Delivery
		if d.Expiration == "" && d.Headers[broker.HeaderOriginalExpiration] == fmt.Sprint(ttl.Milliseconds()) {
			kept++
		} else {
			t.Errorf("%s in the DLQ with Expiration %q and %s %v; want none and %d",
				dl.ID, d.Expiration, broker.HeaderOriginalExpiration, d.Headers[broker.HeaderOriginalExpiration], ttl.Milliseconds())
		}
	}
	var missing []string
	for _, id := range ids {
		if !listed[id] {
			missing = append(missing, id)
		}
	}
	if len(missing) > 0 {
		t.Errorf("%d of %d dead letters gone from the DLQ %v after it held them all (first %v)",
			len(missing), ttlMessages, time.Since(full).Round(time.Millisecond), first(missing))
	}
	e := r.end(ctx, ids, p)
	if len(e.v.lost) > 0 || len(e.v.once)+len(e.v.twice) > 0 || len(e.dead) != ttlMessages {
		t.Errorf("%d lost (first %v), %d applied, %d dead-lettered; want 0 lost, 0 applied, %d dead-lettered",
			len(e.v.lost), first(e.v.lost), len(e.v.once)+len(e.v.twice), len(e.dead), ttlMessages)
	}
	t.Logf("listed %d of %d dead letters %v after the DLQ held them all; took %v",
		len(dls), ttlMessages, time.Since(full).Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "16 dead letters with a per-message TTL",
		Messages:     ttlMessages,
		Faults:       fmt.Sprintf("published with Expiration %v; half refused at once, half failing 3 attempts; DLQ listed %v after it held them all", ttl, ttl+time.Second),
		Once:         len(e.v.once),
		Twice:        len(e.v.twice),
		Lost:         len(e.v.lost),
		DeadLettered: len(e.dead),
		Note: fmt.Sprintf("%d of %d listed after their TTL; %d without an Expiration, the original in %s",
			len(dls), ttlMessages, kept, broker.HeaderOriginalExpiration),
	})
}
