//go:build reliability

package reliability_test

// Scenario 3 over the PostgreSQL inbox: the database, which holds both the
// store and the effects, is a cluster of the test's own. It is stopped at
// once (immediate shutdown, as a crash) mid-stream for a few seconds, then
// started again on the same port and data directory. Meanwhile claims
// fail (fail closed: the message goes to a delay queue), and the
// transactions in flight break before or after their commit: those that
// committed left their effect and done mark, the others neither. The
// consumer reconnects by itself. Nothing twice, nothing lost.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

func TestPostgresOutage(t *testing.T) {
	const (
		messages = 3000
		dups     = messages / 5
		outage   = 5 * time.Second
		workers  = 4
	)
	rng := rand.New(rand.NewPCG(seed(t), 3))
	db := startPostgresServer(t)
	r := newRun(t, "pgoutage", 250*time.Millisecond, time.Second, 2*time.Second)
	opts := r.usePostgres(db.url, consumerOpts{
		workers:     workers,
		work:        2 * time.Millisecond,
		busy:        500 * time.Millisecond,
		unavailable: 500 * time.Millisecond,
		lease:       5 * time.Second,
		timeout:     4 * time.Second,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	began := time.Now()

	msgs, ids := workload(rng, messages, dups)
	published := r.publishAsync(ctx, msgs, 16)
	p := r.startConsumer("pgoutage-A", opts)

	at := len(ids)/5 + rng.IntN(len(ids)/5)
	if err := r.waitCount(ctx, "distinct", int64(at)); err != nil {
		t.Fatal(err)
	}
	before := r.count(ctx, "distinct")
	if err := db.stop(); err != nil {
		t.Fatal(err)
	}
	down := time.Now()
	t.Logf("database stopped at %d messages done", before)
	time.Sleep(outage)
	if err := p.unexpectedExit(); err != nil {
		t.Fatalf("the consumer did not survive the outage: %v", err)
	}
	if err := db.start(); err != nil {
		t.Fatal(err)
	}
	t.Logf("database back after %v", time.Since(down).Round(time.Millisecond))
	if after := r.count(ctx, "distinct"); after >= int64(len(ids)) {
		t.Fatalf("all %d messages were done before the database came back; the scenario needs a slower handler", after)
	}
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if err := r.awaitQuiet(ctx, len(ids), 4*time.Second); err != nil {
		t.Fatal(err)
	}
	e := r.end(ctx, ids, p)
	e.wantEachOnce(t)
	if e.stats[0].Unavailable == 0 {
		t.Errorf("the consumer never found the database unavailable (%+v); the outage did not reach it", e.stats[0])
	}
	t.Logf("consumer: %+v; took %v", e.stats[0], time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "3 PostgreSQL outage, inbox",
		Messages:     messages,
		Duplicates:   dups,
		Faults:       fmt.Sprintf("database stopped (immediate) for %v, restarted", outage),
		Once:         len(e.v.once),
		Twice:        len(e.v.twice),
		Lost:         len(e.v.lost),
		DeadLettered: len(e.v.deadLettered),
		Note:         fmt.Sprintf("store and effects in one database; %d deliveries found it unavailable", e.stats[0].Unavailable),
	})
}
