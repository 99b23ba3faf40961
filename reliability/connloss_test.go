//go:build reliability

package reliability_test

// Scenario 2, broker connection loss: under the load of scenario 1, with
// two consumer processes, RabbitMQ closes every client connection
// (rabbitmqctl close_all_connections) every two seconds. Handlers in
// flight finish, their settlements fail, RabbitMQ redelivers those
// messages, and Dedup acknowledges them as duplicates: nothing is lost and
// nothing is done twice. The publisher's connection is closed too, and it
// publishes again what was not confirmed.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

func TestConnectionLoss(t *testing.T) {
	requireCtl(t)
	const (
		messages = 5000
		dups     = messages / 5
		closes   = 5
		every    = 2 * time.Second
		workers  = 4
	)
	rng := rand.New(rand.NewPCG(seed(t), 2))
	r := newRun(t, "connloss", 250*time.Millisecond, time.Second, 2*time.Second)
	opts := consumerOpts{
		workers:     workers,
		lease:       10 * time.Second,
		timeout:     5 * time.Second,
		busy:        500 * time.Millisecond,
		unavailable: 500 * time.Millisecond,
		// Slow enough that the run outlasts the closes.
		work: 30 * time.Millisecond,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	began := time.Now()

	msgs, ids := workload(rng, messages, dups)
	published := r.publishAsync(ctx, msgs, 16)
	a := r.startConsumer("conn-A", opts)
	b := r.startConsumer("conn-B", opts)

	// The closes start once a tenth of the messages is done, one every
	// two seconds, each on its own goroutine (rabbitmqctl itself takes a
	// second or two), so that all of them find the consumers at work.
	if err := r.waitCount(ctx, "distinct", int64(len(ids)/10)); err != nil {
		t.Fatal(err)
	}
	var (
		wg      sync.WaitGroup
		errs    = make([]error, closes)
		doneAt  = make([]int64, closes)
		started = make([]int64, closes)
	)
	for i := range closes {
		if i > 0 {
			time.Sleep(every)
		}
		started[i] = r.count(ctx, "distinct")
		wg.Add(1)
		go func() { // ends when rabbitmqctl does
			defer wg.Done()
			errs[i] = closeAllConnections(ctx)
			doneAt[i] = r.count(ctx, "distinct")
		}()
	}
	wg.Wait()
	for i := range closes {
		if errs[i] != nil {
			t.Fatalf("close %d: %v", i+1, errs[i])
		}
		t.Logf("close %d: all connections closed between %d and %d messages done", i+1, started[i], doneAt[i])
		if doneAt[i] >= int64(len(ids)) {
			t.Fatalf("close %d: all %d messages were done before it took effect; the scenario needs a slower handler", i+1, doneAt[i])
		}
	}
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if err := r.awaitQuiet(ctx, len(ids), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	e := r.end(ctx, ids, a, b)
	e.wantEachOnce(t)
	v := e.v
	// Both consumers lost their connections, and came back.
	for _, p := range []*proc{a, b} {
		if n := p.logCount(`msg="broker: connection lost"`); n == 0 {
			t.Errorf("consumer %s never logged a lost connection; want one per close", p.name)
		} else {
			t.Logf("consumer %s lost its connection %d times", p.name, n)
		}
	}
	t.Logf("consumers: %+v; took %v", e.stats, time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "2 broker connection loss",
		Messages:     messages,
		Duplicates:   dups,
		Faults:       fmt.Sprintf("%d × close_all_connections, every %v", closes, every),
		Once:         len(v.once),
		Twice:        len(v.twice),
		Lost:         len(v.lost),
		DeadLettered: len(v.deadLettered),
		Note:         fmt.Sprintf("2 consumers; %d settlements lost with their connection; the publisher's closed too", e.stats[0].SettleErrors+e.stats[1].SettleErrors),
	})
}
