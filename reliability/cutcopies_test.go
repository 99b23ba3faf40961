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
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

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
	opts := consumerOpts{
		amqpURL:     amqpURL,
		workers:     16,
		prefetch:    64,
		mode:        "poison",
		maxAttempts: attempts,
		backoffMin:  time.Millisecond,
		backoffMax:  2 * time.Millisecond,
		lease:       10 * time.Second,
		busy:        50 * time.Millisecond,
		unavailable: 50 * time.Millisecond,
		timeout:     5 * time.Second,
		// Reconnections within 100 ms, so that the cuts come fast: the
		// backoff never resets, each session lasting less than a second.
		reconnectMax: 100 * time.Millisecond,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	began := time.Now()

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
	publish := func(msgs []amqp.Publishing) {
		t.Helper()
		require.NoError(t, <-r.publishAsync(ctx, msgs, 8))
	}

	var consumes atomic.Int64 // basic.consume methods sent through the proxy
	px.onSent(func(b []byte) {
		if bytes.Contains(b, basicConsume) {
			consumes.Add(1)
		}
	})
	procs := []*proc{r.startConsumer("cuts-A", opts), r.startConsumer("cuts-B", opts)}
	mix := []string{"retry", "retry", "retry", "poison", "fail"}
	publish(batch(backlog, "10s", mix...))
	// A batch, then a cut once every consumer is consuming again (its
	// basic.consume went through the proxy) and has been for a moment:
	// every cut finds sessions at work, with copies in flight, and none
	// in its handshake.
	var progress []int64
	for range batches {
		publish(batch(perBatch, "1s", mix...))
		want := int64(len(progress)+1) * int64(len(procs))
		if err := awaitCount(ctx, &consumes, want, 20*time.Second); err != nil { // the count in the message is read after the wait
			t.Fatalf("the consumers did not all consume again within 20s of cut %d (%d effects then): %v", len(progress), r.count(ctx, "total"), err)
		}
		time.Sleep(every)
		px.heal() // closes every connection through the proxy
		progress = append(progress, r.count(ctx, "total"))
	}
	lastCut := time.Now()
	atLastCut := r.count(ctx, "total")

	// The consumers must resume after the last cut: these are consumed
	// only if they do.
	publish(batch(tail, "1s", "ok", "retry"))
	qctx, qcancel := context.WithTimeout(ctx, 40*time.Second)
	defer qcancel()
	require.NoError(t, r.awaitQuiet(qctx, len(all), 2*time.Second), "after the last cut (%d effects then)", atLastCut)
	endedIn := time.Since(lastCut)
	if n, want := consumes.Load(), int64(batches+1)*int64(len(procs)); n < want {
		t.Errorf("%d basic.consume sent in all; want %d, one per consumer before the first cut and after each", n, want)
	}
	e := r.end(ctx, all, procs...)
	v := e.v

	dlqCopies := map[string]int{}
	for _, d := range e.dead {
		if k, err := middleware.Key(d); err == nil {
			dlqCopies[k]++
		}
	}
	dlqTwice := 0
	for _, c := range dlqCopies {
		if c > 1 {
			dlqTwice++
		}
	}
	e.wantOrders(t, effectIDs, deadIDs)
	if after := r.count(ctx, "total"); after <= atLastCut {
		t.Errorf("effects: %d at the last cut, %d at the end; want more (the consumers resumed)", atLastCut, after)
	}
	var lostConns []int
	var settleErrors int64
	for i, p := range procs {
		n := p.logCount(`msg="broker: connection lost"`)
		if n == 0 {
			t.Errorf("consumer %s never logged a lost connection; want one for each cut that found it connected", p.name)
		}
		lostConns = append(lostConns, n)
		settleErrors += e.stats[i].SettleErrors
	}
	t.Logf("effects after each cut: %v", progress)
	t.Logf("consumers: %+v; lost connections logged %v for %d cuts; the run ended %v after the last cut; took %v",
		e.stats, lostConns, batches, endedIn.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	record(t, v.counted(row{
		Scenario: "13 connection cuts with copies in flight",
		Messages: len(all),
		Faults:   fmt.Sprintf("%d × proxy closes the consumers' connections, %v after they consume", batches, every),
		Note: fmt.Sprintf("2 consumers; lost connections logged %v; %d dead-lettered ids with two copies or more in the DLQ (%d copies in all); %d settlements failed",
			lostConns, dlqTwice, len(e.dead), settleErrors),
	}))
}

// basicConsume is the class and method id of basic.consume, as a method
// frame carries them.
var basicConsume = []byte{0, 60, 0, 20}

// awaitCount waits until n reaches want, for at most d.
func awaitCount(ctx context.Context, n *atomic.Int64, want int64, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for n.Load() < want {
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d: %w", n.Load(), want, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}
