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
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const (
	crashMessages = 5000
	crashDups     = crashMessages / 5
	crashKills    = 6
	crashWorkers  = 8
)

// crash runs scenario 1 as scenario, over the PostgreSQL inbox at pgURL
// (with HandlerOptions.GroupCommit groupCommit) unless it is "", and
// returns the run, how it ended, and the consumers killed.
func crash(t *testing.T, scenario, pgURL string, groupCommit int) (*load, ending, []string) {
	t.Helper()
	ctx, r := startLoad(t, loadSpec{
		scenario: scenario,
		delays:   tiers,
		messages: crashMessages,
		dups:     crashDups,
		stream:   1,
		postgres: pgURL,
		opts: consumerOpts{
			workers: crashWorkers,
			// A short lease, so that the claims of a killed process free
			// soon; the handler's deadline well inside it.
			lease:       2 * time.Second,
			timeout:     time.Second,
			busy:        500 * time.Millisecond,
			unavailable: 500 * time.Millisecond,
			groupCommit: groupCommit,
			work:        time.Millisecond,
		},
		consumers: []string{scenario + "-1"},
	})
	p := r.procs[0]

	// Kill points: one at a random count of messages done in each of
	// kills equal stretches of the run, so that every kill hits a consumer
	// at work; then a random few milliseconds more.
	var killed []string
	var since int64 // messages done when p started
	lo, hi := len(r.ids)/20, len(r.ids)*9/10
	for i := range crashKills {
		require.NoError(t, r.waitAtWork(ctx, since, lo+(hi-lo)*i/crashKills, (hi-lo)/crashKills), "before kill %d", i+1)
		time.Sleep(time.Duration(r.rng.IntN(5000)) * time.Microsecond)
		p.kill()
		killed = append(killed, p.name)
		t.Logf("kill %d: SIGKILL %s at %d messages done", i+1, p.name, r.count(ctx, "distinct"))
		since = r.count(ctx, "distinct")
		p = r.startConsumer(fmt.Sprintf("%s-%d", scenario, i+2), r.opts)
	}
	return r, r.wrapUp(ctx, 3*time.Second, p), killed
}

func TestCrash(t *testing.T) {
	r, e, killed := crash(t, "crash", "", 0)
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
		if n > crashWorkers {
			t.Errorf("%d double effects cut by the kill of %s; want at most %d (its workers)", n, name, crashWorkers)
		}
	}
	if len(v.twice) > crashWorkers*crashKills {
		t.Errorf("%d messages applied twice; want at most %d (workers × kills)", len(v.twice), crashWorkers*crashKills)
	}
	t.Logf("double effects per killed process: %v; last consumer: %+v; took %v", perKill, e.stats[0], time.Since(r.began).Round(time.Millisecond))
	record(t, v.counted(row{
		Scenario:   "1 crash",
		Messages:   crashMessages,
		Duplicates: crashDups,
		Faults:     fmt.Sprintf("%d × SIGKILL + restart", crashKills),
		Note:       fmt.Sprintf("twice allowed: cut between effect and done, ≤ %d workers × %d kills = %d", crashWorkers, crashKills, crashWorkers*crashKills),
	}))
}
