//go:build reliability

package reliability_test

// The opening and the end that the load scenarios share (crash,
// connection loss, outages; over Redis and over the PostgreSQL inbox): a
// run, a workload of messages of which some repeat an earlier id,
// published from 16 goroutines while the first consumers start; then,
// once the scenario's faults are done, every publish confirmed, the run
// quiet and its consumers stopped.

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A loadSpec is a load scenario's opening.
type loadSpec struct {
	scenario       string
	delays         []time.Duration
	messages, dups int    // published; of them, repeating an earlier id
	stream         uint64 // of the scenario's random choices, with the seed
	postgres       string // the URL of the PostgreSQL inbox; "" for Redis
	opts           consumerOpts
	consumers      []string // started once the publishing has begun
}

// A load is a run under a loadSpec's workload.
type load struct {
	*run
	rng       *rand.Rand   // the workload was drawn from it; the scenario goes on
	opts      consumerOpts // the spec's, with the PostgreSQL inbox's store
	began     time.Time
	ids       []string // the distinct ids of the workload
	procs     []*proc  // the spec's consumers, in its order
	published <-chan error
}

// startLoad opens a load scenario as s says. The context it returns ends
// four minutes later, or with the test.
func startLoad(t *testing.T, s loadSpec) (context.Context, *load) {
	t.Helper()
	r := &load{rng: rand.New(rand.NewPCG(seed(t), s.stream))}
	r.run = newRun(t, s.scenario, s.delays...)
	r.opts = s.opts
	if s.postgres != "" {
		r.opts = r.usePostgres(s.postgres, s.opts)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 4*time.Minute)
	t.Cleanup(cancel)
	r.began = time.Now()

	msgs, ids := workload(r.rng, s.messages, s.dups)
	r.ids = ids
	r.published = r.publishAsync(ctx, msgs, 16)
	for _, name := range s.consumers {
		r.procs = append(r.procs, r.startConsumer(name, r.opts))
	}
	return ctx, r
}

// waitRandom waits until a random count of messages, from to from+width,
// is done.
func (r *load) waitRandom(ctx context.Context, from, width int) error {
	return r.waitCount(ctx, "distinct", int64(from+r.rng.IntN(width)))
}

// waitAtWork is waitRandom for a consumer started when since messages were
// done: it also waits until that consumer has done one of its own. A stop
// or kill then finds it at work, never still starting: the in-flight
// handlers of the process before it can carry the count past the next
// stop's point, and a SIGTERM that came before the new process installed
// its handler would end it without a graceful stop.
func (r *load) waitAtWork(ctx context.Context, since int64, from, width int) error {
	return r.waitCount(ctx, "distinct", max(int64(from+r.rng.IntN(width)), since+1))
}

// wantUnfinished fails the test if every message is done already, before
// event: the scenario's fault found no consumer at work.
func (r *load) wantUnfinished(ctx context.Context, event string) {
	r.t.Helper()
	if after := r.count(ctx, "distinct"); after >= int64(len(r.ids)) {
		r.t.Fatalf("all %d messages were done before %s; the scenario needs a slower handler", after, event)
	}
}

// wrapUp waits until every publish is confirmed and the run is quiet for
// window (see awaitQuiet), and ends the run with procs (see run.end).
func (r *load) wrapUp(ctx context.Context, window time.Duration, procs ...*proc) ending {
	r.t.Helper()
	require.NoError(r.t, <-r.published)
	require.NoError(r.t, r.awaitQuiet(ctx, len(r.ids), window))
	return r.end(ctx, r.ids, procs...)
}

// counted returns r with the counts of v.
func (v verdict) counted(r row) row {
	r.Once, r.Twice, r.Lost, r.DeadLettered = len(v.once), len(v.twice), len(v.lost), len(v.deadLettered)
	return r
}
