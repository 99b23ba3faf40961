//go:build reliability

package reliability_test

// Scenario 3, Redis outage: the idempotency store is a Redis server of the
// test's own, with persistence on (appendonly yes, appendfsync always). It
// is shut down for 10 s mid-stream, then started again on the same port
// and data directory. The consumer keeps Dedup's defaults: fail closed, a
// 5-minute lease, 5 s before a message is tried again.
//
// While the store is down, no handler starts: a claim fails, and its
// message goes to a delay queue and comes back later (fail closed). A
// second consumer, started during the outage, shows it. A handler that had
// claimed its message before the outage applies its effect and then keeps
// its worker, trying to mark the message done until its lease would end;
// that succeeds once the store is back. The done marks survive the
// restart, so a duplicate that arrives afterwards is still recognised.
// Nothing is done twice, nothing is lost, and both consumers resume by
// themselves.

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRedisOutage(t *testing.T) {
	const (
		messages = 3000
		dups     = messages / 5
		outage   = 10 * time.Second
		workers  = 4
	)
	store := startRedisServer(t)
	ctx, r := startLoad(t, loadSpec{
		scenario: "outage",
		delays:   []time.Duration{time.Second, 5 * time.Second},
		messages: messages,
		dups:     dups,
		stream:   3,
		opts: consumerOpts{
			storeAddr: store.addr,
			workers:   workers,
			work:      5 * time.Millisecond,
			// lease, busy and unavailable delays: Dedup's defaults.
		},
		consumers: []string{"outage-A"},
	})
	pa := r.procs[0]
	var (
		pb     *proc
		before int64
	)
	atRestart := r.outage(ctx, t, serverOutage{
		what:   "the store",
		length: outage,
		count:  "total",
		stop: func() error {
			sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
			defer scancel()
			return store.shutdown(sctx)
		},
		start: store.restart,
		// A second consumer starts while the store is down: it must
		// process nothing until the store is back (fail closed), and then
		// resume.
		down: func() {
			before = r.count(ctx, "total")
			pb = r.startConsumer("outage-B", r.opts)
		},
	})
	during := atRestart - before
	t.Logf("%d effects applied while the store was down", during)
	// Only handlers that had claimed their message before the outage can
	// have applied an effect during it.
	if during > workers {
		t.Errorf("%d effects applied while the store was down; want at most %d (the claims taken before)", during, workers)
	}

	e := r.wrapUp(ctx, 6*time.Second, pa, pb)
	e.wantEachOnce(t)
	v := e.v
	byOrder, err := r.effectOrder(ctx)
	require.NoError(t, err)
	// The consumer started during the outage found the store down, and
	// applied effects only after it was back.
	if e.stats[1].Unavailable == 0 {
		t.Errorf("consumer %s never found the store unavailable (%+v); the outage did not reach it", pb.name, e.stats[1])
	}
	if n := slices.Index(byOrder, pb.name); n >= 0 && n < int(atRestart) {
		t.Errorf("consumer %s applied effect %d of the log while the store was down; want none before effect %d", pb.name, n+1, atRestart+1)
	}
	t.Logf("consumers: %+v; took %v", e.stats, time.Since(r.began).Round(time.Millisecond))
	record(t, v.counted(row{
		Scenario:   "3 Redis outage",
		Messages:   messages,
		Duplicates: dups,
		Faults:     fmt.Sprintf("store SHUTDOWN for %v, restarted (AOF)", outage),
		Note:       fmt.Sprintf("fail closed, 5 m lease; %d deliveries found the store down; %d effects during the outage (claimed before it)", e.stats[0].Unavailable+e.stats[1].Unavailable, during),
	}))
}

// A serverOutage is a server the consumers need (the store, the
// database) that goes away mid-stream and comes back on the same port and
// data.
type serverOutage struct {
	what   string        // the server, for the log and failures
	length time.Duration // how long it stays down
	count  string        // the count (see run.count) that says how far the run is
	// stop stops the server, and start starts it again.
	stop, start func() error
	// down, if not nil, runs once the server is down, and back once it
	// has been down for length, before it starts again.
	down, back func()
}

// outage stops o's server once a random fifth to two fifths of the
// messages are done, leaves it down for o.length, and starts it again;
// the run must not be finished by then. It returns the count o.count
// when the server came back.
func (r *load) outage(ctx context.Context, t *testing.T, o serverOutage) (atRestart int64) {
	t.Helper()
	require.NoError(t, r.waitRandom(ctx, len(r.ids)/5, len(r.ids)/5))
	t.Logf("%s stops at %d (%s)", o.what, r.count(ctx, o.count), o.count)
	require.NoError(t, o.stop())
	down := time.Now()
	if o.down != nil {
		o.down()
	}
	time.Sleep(o.length)
	if o.back != nil {
		o.back()
	}
	atRestart = r.count(ctx, o.count)
	require.NoError(t, o.start())
	t.Logf("%s back after %v", o.what, time.Since(down).Round(time.Millisecond))
	r.wantUnfinished(ctx, o.what+" came back")
	return atRestart
}
