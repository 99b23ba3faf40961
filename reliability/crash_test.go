//go:build reliability

package reliability_test

// Scenario 1, crash: the consumer process is killed with SIGKILL at random
// moments while 5,000 messages (a fifth of them repeating an earlier id)
// flow, and restarted each time. Nothing may be lost. An effect may be
// applied twice only where a kill cut its handler between the effect and
// Dedup's "done" mark: the claim then stays with the dead process until its
// lease ends, and the message, redelivered by RabbitMQ, is processed again.
// There can be at most as many such messages per kill as the consumer has
// workers, and the first effect of each must be by a killed process.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

func TestCrash(t *testing.T) {
	const (
		messages = 5000
		dups     = messages / 5
		kills    = 6
		workers  = 8
	)
	rng := rand.New(rand.NewPCG(seed(t), 1))
	r := newRun(t, "crash", 250*time.Millisecond, time.Second, 2*time.Second)
	opts := consumerOpts{
		workers: workers,
		// A short lease, so that the claims of a killed process free soon;
		// the handler's deadline well inside it.
		lease:       2 * time.Second,
		timeout:     time.Second,
		busy:        500 * time.Millisecond,
		unavailable: 500 * time.Millisecond,
		work:        time.Millisecond,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	began := time.Now()

	msgs, ids := workload(rng, messages, dups)
	published := r.publishAsync(ctx, msgs, 16)
	p := r.startConsumer("crash-1", opts)

	// Kill points: one at a random count of messages done in each of
	// kills equal stretches of the run, so that every kill hits a consumer
	// at work; then a random few milliseconds more.
	var killed []string
	lo, hi := len(ids)/20, len(ids)*9/10
	for i := range kills {
		at := lo + (hi-lo)*i/kills + rng.IntN((hi-lo)/kills)
		if err := r.waitCount(ctx, "distinct", int64(at)); err != nil {
			t.Fatalf("before kill %d: %v", i+1, err)
		}
		time.Sleep(time.Duration(rng.IntN(5000)) * time.Microsecond)
		p.kill()
		killed = append(killed, p.name)
		t.Logf("kill %d: SIGKILL %s at %d messages done", i+1, p.name, r.count(ctx, "distinct"))
		p = r.startConsumer(fmt.Sprintf("crash-%d", i+2), opts)
	}
	if err := <-published; err != nil {
		t.Fatal(err)
	}
	if err := r.awaitQuiet(ctx, len(ids), 3*time.Second); err != nil {
		t.Fatal(err)
	}
	e := r.end(ctx, ids, p)
	v := e.v

	if len(v.lost) > 0 {
		t.Errorf("%d messages lost (no effect, not dead-lettered), first %v; want none", len(v.lost), first(v.lost))
	}
	if len(e.dead) > 0 || len(v.deadLettered) > 0 {
		t.Errorf("%d messages dead-lettered; want none", len(e.dead))
	}
	// Each double effect must be one that a kill explains: applied first
	// by a killed process, then once more; at most workers per kill.
	perKill := map[string]int{}
	for _, id := range v.twice {
		by := e.effects[id]
		if len(by) != 2 || !slices.Contains(killed, by[0]) {
			t.Errorf("message %s applied by %v; want at most twice, the first time by a killed process (%v)", id, by, killed)
			continue
		}
		perKill[by[0]]++
	}
	for name, n := range perKill {
		if n > workers {
			t.Errorf("%d double effects cut by the kill of %s; want at most %d (its workers)", n, name, workers)
		}
	}
	if len(v.twice) > workers*kills {
		t.Errorf("%d messages applied twice; want at most %d (workers × kills)", len(v.twice), workers*kills)
	}
	t.Logf("double effects per killed process: %v; last consumer: %+v; took %v", perKill, e.stats[0], time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "1 crash",
		Messages:     messages,
		Duplicates:   dups,
		Faults:       fmt.Sprintf("%d × SIGKILL + restart", kills),
		Once:         len(v.once),
		Twice:        len(v.twice),
		Lost:         len(v.lost),
		DeadLettered: len(v.deadLettered),
		Note:         fmt.Sprintf("twice allowed: cut between effect and done, ≤ %d workers × %d kills = %d", workers, kills, workers*kills),
	})
}
