//go:build reliability

package reliability_test

// Connection cuts while copies are in flight: most results are delays and
// dead-letters, so that at every cut the consumers are publishing delay
// and dead-letter copies and waiting for their confirms. A TCP proxy
// between two consumer processes and RabbitMQ closes their connections
// 40 ms after they consume again, 60 times, while messages keep coming.
// After every cut the consumers connect again and resume; messages
// published after the last cut are consumed; nothing is lost and no
// effect happens twice. Dead-letter copies may exist twice (a copy
// confirmed, then the ack of its original lost with the connection): they
// are counted.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/middleware"
)

func TestCutsWithCopiesInFlight(t *testing.T) {
	const (
		backlog  = 200 // published before the first cut
		batches  = 60  // one per cut
		perBatch = 8
		every    = 40 * time.Millisecond
		tail     = 100 // published after the last cut
		attempts = 4   // the consumer's Retry limit
	)
	rng := rand.New(rand.NewPCG(seed(t), 11))
	r := newRun(t, "cutcopies", 50*time.Millisecond)
	px, amqpURL := r.brokerProxy()
	opts := cutOpts(amqpURL, 64)
	opts.maxAttempts = attempts
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	// A "retry" order fails once and asks to be retried after a delay
	// longer than the one delay queue: it cycles through that queue,
	// unhandled, a copy every 50 ms or so, until it is due
	// (HeaderNotBefore); then it succeeds. The backlog's retry orders
	// cycle through most of the cuts, the later ones for a second. A
	// "poison" order is refused (a dead-letter copy); a "fail" order
	// always fails (three delay copies, then a dead-letter copy).
	var (
		effectIDs, deadIDs, all []string
		n                       int
	)
	next := func(kind, after string) amqp.Publishing {
		id := fmt.Sprintf("c-%05d", n)
		n++
		all = append(all, id)
		body := map[string]any{"kind": kind}
		switch kind {
		case "retry":
			body["fails"], body["after"] = 1, after
			effectIDs = append(effectIDs, id)
		case "ok":
			effectIDs = append(effectIDs, id)
		default:
			deadIDs = append(deadIDs, id)
		}
		b, _ := json.Marshal(body)
		return amqp.Publishing{MessageId: id, Body: b}
	}
	batch := func(size int, after string, kinds ...string) []amqp.Publishing {
		msgs := make([]amqp.Publishing, size)
		for i := range msgs {
			msgs[i] = next(kinds[rng.IntN(len(kinds))], after)
		}
		return msgs
	}
	c := startCuts(r, px, opts, nil, "cuts-A", "cuts-B")
	mix := []string{"retry", "retry", "retry", "poison", "fail"}
	c.publish(ctx, t, batch(backlog, "10s", mix...))
	// A batch, then a cut once every consumer is consuming again: every
	// cut finds copies in flight.
	for range batches {
		c.publish(ctx, t, batch(perBatch, "1s", mix...))
		c.cut(ctx, t, every)
	}

	// The consumers must resume after the last cut: these are consumed
	// only if they do.
	tailMsgs := batch(tail, "1s", "ok", "retry")
	e, atLastCut, endedIn := c.finish(ctx, t, all, tailMsgs)
	if n, want := c.consumes.Load(), int64(batches+1)*int64(len(c.procs)); n < want {
		t.Errorf("%d basic.consume sent in all; want %d, one per consumer before the first cut and after each", n, want)
	}
	v := e.v

	dlqCopies := map[string]int{}
	for _, d := range e.dead {
		if k, err := middleware.Key(d); err == nil {
			dlqCopies[k]++
		}
	}
	dlqTwice := 0
	for _, copies := range dlqCopies {
		if copies > 1 {
			dlqTwice++
		}
	}
	e.wantOrders(t, effectIDs, deadIDs)
	if after := r.count(ctx, "total"); after <= atLastCut {
		t.Errorf("effects: %d at the last cut, %d at the end; want more (the consumers resumed)", atLastCut, after)
	}
	lostConns := c.lostConnections()
	var settleErrors int64
	for i, p := range c.procs {
		if lostConns[i] == 0 {
			t.Errorf("consumer %s never logged a lost connection; want one for each cut that found it connected", p.name)
		}
		settleErrors += e.stats[i].SettleErrors
	}
	c.report(t, e, lostConns, endedIn)
	record(t, v.counted(row{
		Scenario: "13 connection cuts with copies in flight",
		Messages: len(all),
		Faults:   fmt.Sprintf("%d × proxy closes the consumers' connections, %v after they consume", batches, every),
		Note: fmt.Sprintf("2 consumers; lost connections logged %v; %d dead-lettered ids with two copies or more in the DLQ (%d copies in all); %d settlements failed",
			lostConns, dlqTwice, len(e.dead), settleErrors),
	}))
}
