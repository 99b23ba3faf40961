//go:build reliability

package reliability_test

// Scenario 11, graceful stops mid-stream: a consumer is stopped with
// SIGTERM six times while it works through a stream of orders, and
// restarted after each stop. Its handlers (400 ms, finishing their effect
// whatever their context says) outlive its ShutdownTimeout (200 ms), and
// its store answers late (through a proxy): at each stop the
// handlers' context is cancelled while some of them are writing their done
// marks, releases and failure counts. Each must still be written: a done
// mark cut there makes the redelivery wait out the lease, find the claim
// abandoned, and apply the effect again. Required: 0 twice, 0 lost; on
// Redis and on the PostgreSQL inbox.

import (
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/stretchr/testify/require"
)

const (
	stopRounds  = 6
	stopWorkers = 16
)

// gracefulStops plays the scenario with messages orders (a fifth of them
// repeating an earlier id), the store's answers lag late.
func gracefulStops(t *testing.T, scenario, pgURL string, messages int, lag time.Duration) {
	ctx, r := startLoad(t, loadSpec{
		scenario: scenario,
		delays:   tiers,
		messages: messages,
		dups:     messages / 5,
		stream:   4,
		postgres: pgURL,
		opts: consumerOpts{
			workers: stopWorkers,
			// A short lease, so that a claim left behind by a stop frees
			// (and its message runs again) within the run.
			lease:                2 * time.Second,
			timeout:              time.Second,
			busy:                 200 * time.Millisecond,
			unavailable:          200 * time.Millisecond,
			mode:                 "stubborn",
			hold:                 400 * time.Millisecond,
			shutdownTimeout:      200 * time.Millisecond,
			storeContextTimeouts: true,
		},
	})
	// The store, through a proxy whose answers come late.
	if pgURL == "" {
		px := startProxy(t, r.redisAddr)
		px.slow(lag)
		r.opts.storeAddr = px.addr
	} else {
		u, err := url.Parse(r.opts.storeAddr)
		require.NoError(t, err)
		px := startProxy(t, u.Host)
		px.slow(lag)
		u.Host = px.addr
		r.opts.storeAddr = u.String()
	}

	p := r.startConsumer(scenario+"-1", r.opts)
	var cancelled, settleErrors int64
	var since int64 // messages done when p started
	lo, hi := len(r.ids)/10, len(r.ids)*8/10
	for i := range stopRounds {
		require.NoError(t, r.waitAtWork(ctx, since, lo+(hi-lo)*i/stopRounds, (hi-lo)/stopRounds), "before stop %d", i+1)
		at := r.count(ctx, "distinct")
		st, err := p.stop(30 * time.Second)
		require.NoError(t, err, "stop %d", i+1)
		cancelled += int64(p.logCount("context canceled"))
		settleErrors += st.SettleErrors
		t.Logf("stop %d at %d messages done: %+v", i+1, at, st)
		since = r.count(ctx, "distinct")
		p = r.startConsumer(fmt.Sprintf("%s-%d", scenario, i+2), r.opts)
	}
	e := r.wrapUp(ctx, 3*time.Second, p)
	e.wantEachOnce(t)
	t.Logf("log lines with a cancelled context: %d; settlements failed: %d; last consumer: %+v; took %v",
		cancelled, settleErrors, e.stats[0], time.Since(r.began).Round(time.Millisecond))
	name, note := "11 graceful stops mid-stream", "required: 0 twice, 0 lost: a handler that returned has its done mark, release and count written after the cancellation"
	if pgURL != "" {
		name += ", PostgreSQL inbox"
	}
	record(t, e.v.counted(row{
		Scenario:   name,
		Messages:   messages,
		Duplicates: messages / 5,
		Faults: fmt.Sprintf("%d × SIGTERM + restart; %d handlers of %v, ShutdownTimeout %v; store answers %v late",
			stopRounds, stopWorkers, 400*time.Millisecond, 200*time.Millisecond, lag),
		Note: note,
	}))
}

func TestGracefulStops(t *testing.T) { gracefulStops(t, "stops", "", 800, 50*time.Millisecond) }

// Over PostgreSQL a delivery makes five round trips to the store (the
// claim, and the transaction's begin, effect, done mark and commit) on a
// pool of four connections: fewer orders, and a shorter lag, keep the run
// as long as Redis's.
func TestPostgresGracefulStops(t *testing.T) {
	gracefulStops(t, "pgstops", testenv.PostgresURL(t), 400, 20*time.Millisecond)
}
