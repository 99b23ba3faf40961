//go:build reliability

package reliability_test

// Connection cuts while copies are in flight: most results are delays and
// dead-letters, so that at every cut the consumer is publishing delay and
// dead-letter copies and waiting for their confirms. A TCP proxy between
// the consumer process and RabbitMQ closes the consumer's connections
// 200 ms after each reconnection, while messages keep coming. After every cut the consumer
// connects again and resumes; messages published after the last cut are
// consumed; nothing is lost and no effect happens twice. Dead-letter
// copies may exist twice (a copy confirmed, then the ack of its original
// lost with the connection): they are counted.

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/middleware"
)

func TestCutsWithCopiesInFlight(t *testing.T) {
	const (
		backlog   = 200 // published before the first cut
		batches   = 40  // one per cut
		perBatch  = 15
		every     = 200 * time.Millisecond
		tail      = 100 // published after the last cut
		attempts  = 4   // the consumer's Retry limit
		retryFail = 1   // failed calls of a "retry" order before it succeeds
	)
	rng := rand.New(rand.NewPCG(seed(t), 11))
	r := newRun(t, "cutcopies", 50*time.Millisecond)
	uri, err := amqp.ParseURI(r.amqpURL)
	if err != nil {
		t.Fatal(err)
	}
	px := startProxy(t, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	host, port, _ := net.SplitHostPort(px.addr)
	uri.Host = host
	uri.Port, _ = strconv.Atoi(port)
	opts := consumerOpts{
		amqpURL:     uri.String(),
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
		// Longer than the one delay queue: a failed "retry" order cycles
		// through it, unhandled, until it is due (HeaderNotBefore), a
		// copy every 50 ms or so.
		retryAfter: 3 * time.Second,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	began := time.Now()

	// Three orders in five succeed after one retry, three seconds later
	// (dozens of delay copies each), one is refused (a dead-letter copy),
	// one always fails (three delay copies, then a dead-letter copy).
	var (
		effectIDs, deadIDs, all []string
		n                       int
	)
	next := func(kind string) amqp.Publishing {
		id := fmt.Sprintf("c-%05d", n)
		n++
		all = append(all, id)
		body := map[string]any{"kind": kind}
		switch kind {
		case "retry":
			body["fails"] = retryFail
			effectIDs = append(effectIDs, id)
		case "ok":
			effectIDs = append(effectIDs, id)
		default:
			deadIDs = append(deadIDs, id)
		}
		b, _ := json.Marshal(body)
		return amqp.Publishing{MessageId: id, Body: b}
	}
	batch := func(size int, kinds ...string) []amqp.Publishing {
		msgs := make([]amqp.Publishing, size)
		for i := range msgs {
			msgs[i] = next(kinds[rng.IntN(len(kinds))])
		}
		return msgs
	}
	publish := func(msgs []amqp.Publishing) {
		t.Helper()
		if err := <-r.publishAsync(ctx, msgs, 8); err != nil {
			t.Fatal(err)
		}
	}

	p := r.startConsumer("cuts-A", opts)
	mix := []string{"retry", "retry", "retry", "poison", "fail"}
	publish(batch(backlog, mix...))
	if err := r.waitCount(ctx, "distinct", 1); err != nil {
		t.Fatal(err)
	}
	// A batch, then a cut once the consumer has been connected for
	// a while: every cut finds a session at work, with copies in flight.
	var progress []int64
	for range batches {
		publish(batch(perBatch, mix...))
		cctx, ccancel := context.WithTimeout(ctx, 20*time.Second)
		err := px.awaitConn(cctx)
		ccancel()
		if err != nil {
			t.Fatalf("the consumer did not connect again within 20s of cut %d (%d effects then): %v", len(progress), r.count(ctx, "total"), err)
		}
		time.Sleep(every)
		px.heal() // closes every connection through the proxy
		progress = append(progress, r.count(ctx, "total"))
	}
	lastCut := time.Now()
	atLastCut := r.count(ctx, "total")

	// The consumer must resume after the last cut: these are consumed
	// only if it does.
	publish(batch(tail, "ok", "retry"))
	qctx, qcancel := context.WithTimeout(ctx, 40*time.Second)
	defer qcancel()
	if err := r.awaitQuiet(qctx, len(all), 2*time.Second); err != nil {
		t.Fatalf("after the last cut (%d effects then): %v", atLastCut, err)
	}
	resumedIn := time.Since(lastCut)
	e := r.end(ctx, all, p)
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
	dead := map[string]bool{}
	for _, id := range v.deadLettered {
		dead[id] = true
	}
	once := map[string]bool{}
	for _, id := range v.once {
		once[id] = true
	}
	var notDead, noEffect []string
	for _, id := range deadIDs {
		if !dead[id] {
			notDead = append(notDead, id)
		}
	}
	for _, id := range effectIDs {
		if !once[id] {
			noEffect = append(noEffect, id)
		}
	}
	if len(v.lost) > 0 || len(v.twice) > 0 || len(notDead) > 0 || len(noEffect) > 0 {
		t.Errorf("%d lost (first %v), %d applied twice (first %v), %d refused orders not dead-lettered (first %v), %d orders without exactly one effect (first %v); want none",
			len(v.lost), first(v.lost), len(v.twice), first(v.twice), len(notDead), first(notDead), len(noEffect), first(noEffect))
	}
	if after := r.count(ctx, "total"); after <= atLastCut {
		t.Errorf("effects: %d at the last cut, %d at the end; want more (the consumer resumed)", atLastCut, after)
	}
	lostConns := p.logCount(`msg="broker: connection lost"`)
	if lostConns == 0 {
		t.Errorf("the consumer never logged a lost connection; want one for each cut that found it connected")
	}
	t.Logf("effects after each cut: %v", progress)
	t.Logf("consumer: %+v; %d lost connections logged for %d cuts; the run ended %v after the last cut; took %v",
		e.stats[0], lostConns, batches, resumedIn.Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "cuts with copies in flight",
		Messages:     len(all),
		Faults:       fmt.Sprintf("%d × proxy closes the consumer's connection, %v after it connected", batches, every),
		Once:         len(v.once),
		Twice:        len(v.twice),
		Lost:         len(v.lost),
		DeadLettered: len(v.deadLettered),
		Note: fmt.Sprintf("%d lost connections logged; %d dead-lettered ids with two copies or more in the DLQ (%d copies in all); %d settlements failed",
			lostConns, dlqTwice, len(e.dead), e.stats[0].SettleErrors),
	})
}

// awaitConn waits until a connection goes through p, or ctx is done.
func (p *proxy) awaitConn(ctx context.Context) error {
	for {
		p.mu.Lock()
		n := len(p.conns)
		p.mu.Unlock()
		if n > 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(5 * time.Millisecond):
		}
	}
}
