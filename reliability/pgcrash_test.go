//go:build reliability

package reliability_test

// Scenario 1 over the PostgreSQL inbox: as TestCrash (5,000 messages, a
// fifth repeating an earlier id, SIGKILLs at random moments, a restart
// after each), with the effect a row inserted in the transaction that
// commits the done mark. A kill between the effect and the done mark,
// which on Redis applies the effect a second time, cannot happen here:
// both commit, or neither. Required: no effect twice, nothing lost.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

func TestPostgresCrash(t *testing.T) {
	const (
		messages = 5000
		dups     = messages / 5
		kills    = 6
		workers  = 8
	)
	rng := rand.New(rand.NewPCG(seed(t), 1))
	url := testenv.PostgresURL(t)
	r := newRun(t, "pgcrash", 250*time.Millisecond, time.Second, 2*time.Second)
	opts := r.usePostgres(url, consumerOpts{
		workers:     workers,
		lease:       2 * time.Second,
		timeout:     time.Second,
		busy:        500 * time.Millisecond,
		unavailable: 500 * time.Millisecond,
		work:        time.Millisecond,
	})
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	began := time.Now()

	msgs, ids := workload(rng, messages, dups)
	published := r.publishAsync(ctx, msgs, 16)
	p := r.startConsumer("pgcrash-1", opts)
	lo, hi := len(ids)/20, len(ids)*9/10
	for i := range kills {
		at := lo + (hi-lo)*i/kills + rng.IntN((hi-lo)/kills)
		if err := r.waitCount(ctx, "distinct", int64(at)); err != nil {
			t.Fatalf("before kill %d: %v", i+1, err)
		}
		time.Sleep(time.Duration(rng.IntN(5000)) * time.Microsecond)
		p.kill()
		t.Logf("kill %d: SIGKILL %s at %d messages done", i+1, p.name, r.count(ctx, "distinct"))
		p = r.startConsumer(fmt.Sprintf("pgcrash-%d", i+2), opts)
	}
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if err := r.awaitQuiet(ctx, len(ids), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	e := r.end(ctx, ids, p)
	e.wantEachOnce(t)
	t.Logf("last consumer: %+v; took %v", e.stats[0], time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "1 crash, PostgreSQL inbox",
		Messages:     messages,
		Duplicates:   dups,
		Faults:       fmt.Sprintf("%d × SIGKILL + restart", kills),
		Once:         len(e.v.once),
		Twice:        len(e.v.twice),
		Lost:         len(e.v.lost),
		DeadLettered: len(e.v.deadLettered),
		Note:         "required: 0 twice (effect and done mark in one commit); Redis: see 1 crash",
	})
}
