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
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
	ctx, r := startLoad(t, loadSpec{
		scenario: "connloss",
		delays:   tiers,
		messages: messages,
		dups:     dups,
		stream:   2,
		opts: consumerOpts{
			workers:     workers,
			lease:       10 * time.Second,
			timeout:     5 * time.Second,
			busy:        500 * time.Millisecond,
			unavailable: 500 * time.Millisecond,
			// Slow enough that the run outlasts the closes.
			work: 30 * time.Millisecond,
		},
		consumers: []string{"conn-A", "conn-B"},
	})
	a, b := r.procs[0], r.procs[1]
	ids := r.ids

	// The closes start once a tenth of the messages is done, one every
	// two seconds, each on its own goroutine (rabbitmqctl itself takes a
	// second or two), so that all of them find the consumers at work.
	require.NoError(t, r.waitCount(ctx, "distinct", int64(len(ids)/10)))
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
	e := r.wrapUp(ctx, 3*time.Second, a, b)
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
	t.Logf("consumers: %+v; took %v", e.stats, time.Since(r.began).Round(time.Millisecond))
	record(t, v.counted(row{
		Scenario:   "2 broker connection loss",
		Messages:   messages,
		Duplicates: dups,
		Faults:     fmt.Sprintf("%d × close_all_connections, every %v", closes, every),
		Note:       fmt.Sprintf("2 consumers; %d settlements lost with their connection; the publisher's closed too", e.stats[0].SettleErrors+e.stats[1].SettleErrors),
	}))
}
