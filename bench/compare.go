package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// figures are what a run of a contender and a summary of its runs both
// report, under the same JSON keys.
type figures struct {
	Contender string `json:"contender"`
	Prefetch  int    `json:"prefetch"`
	Workers   int    `json:"workers"`
	// Deliveries counts handler runs, redeliveries included.
	Deliveries int64            `json:"deliveries"`
	Outcomes   map[string]int64 `json:"outcomes"`
	// Effects counts business handler runs; UniqueEffects the message ids
	// that ran at least once.
	Effects       int64 `json:"effects"`
	UniqueEffects int64 `json:"unique_effects"`
	// The store's round trips per delivery, by outcome.
	RTTAck       rttSummary `json:"rtt_per_ack"`
	RTTDuplicate rttSummary `json:"rtt_per_duplicate"`
	// From the handler's start to the return of its ack.
	P50Micros float64  `json:"p50_us"`
	P99Micros float64  `json:"p99_us"`
	CPU       cpuUsage `json:"cpu"`
}

// runResult is what one contender did in one round.
type runResult struct {
	figures
	Round      int     `json:"round"`
	Messages   int     `json:"messages"`
	UniqueIDs  int     `json:"unique_ids"`
	Seconds    float64 `json:"seconds"` // first delivery to last settlement
	MsgsPerSec float64 `json:"msgs_per_sec"`
	// Redelivered counts deliveries that RabbitMQ marked redelivered: a
	// consumer's connection was lost during the run (on this machine,
	// usually another user's rabbitmqctl close_all_connections), so its
	// timing is disturbed.
	Redelivered       int64 `json:"redelivered"`
	FailedSettlements int64 `json:"failed_settlements"`
	// RepeatedEffects counts the message ids that ran more than once.
	RepeatedEffects int64 `json:"repeated_effects"`
	// RedisCommands is the rise of INFO commandstats' calls during the run:
	// server wide, so other clients of the server add to it.
	RedisCommands   int64            `json:"redis_commands"`
	RedisByCommand  map[string]int64 `json:"redis_by_command,omitempty"`
	RedisRoundTrips int64            `json:"redis_round_trips"` // by the contender's client
	// RedisSetupRoundTrips counts connection handshakes (not in the above).
	RedisSetupRoundTrips int64 `json:"redis_setup_round_trips"`
	// PostgresRoundTrips counts the statements sent by the contender's
	// pool (BEGIN and COMMIT included).
	PostgresRoundTrips int64 `json:"postgres_round_trips,omitempty"`
	LeftReady          int   `json:"left_in_queue"`
	LeftDead           int   `json:"left_in_dlq"`

	lat []int64
}

// rttSummary is the store's round trips (requests: Redis commands and
// pipelines, PostgreSQL statements) per delivery of one outcome.
type rttSummary struct {
	N int64 `json:"n"`
	// Mean is what a delivery cost: a request that carried the commands of
	// k deliveries (a batched pipeline) counts 1/k to each of them.
	Mean float64 `json:"mean"`
	// Max is the most requests that one delivery's commands travelled in:
	// what it waited for, shared or not.
	Max int64 `json:"max"`
}

func (t *rttTally) summary() rttSummary {
	s := rttSummary{N: t.n.Load(), Max: t.max.Load()}
	if s.N > 0 {
		s.Mean = float64(t.share.Load()) / shareUnit / float64(s.N)
	}
	return s
}

// problems lists what went wrong in r beyond its speed: a message whose
// effect did not happen exactly once, a message left behind, a failed
// settlement.
func (r runResult) problems() []string {
	var p []string
	if r.UniqueEffects != int64(r.UniqueIDs) {
		p = append(p, fmt.Sprintf("%d of %d message ids had their effect", r.UniqueEffects, r.UniqueIDs))
	}
	if r.RepeatedEffects > 0 {
		p = append(p, fmt.Sprintf("%d message ids had their effect more than once", r.RepeatedEffects))
	}
	if r.LeftReady > 0 || r.LeftDead > 0 {
		p = append(p, fmt.Sprintf("%d messages left in the queue, %d in its dead-letter queue", r.LeftReady, r.LeftDead))
	}
	if r.FailedSettlements > 0 {
		p = append(p, fmt.Sprintf("%d settlements failed", r.FailedSettlements))
	}
	if n := r.Outcomes[rabbitmw.DeadLetter.String()]; n > 0 {
		p = append(p, fmt.Sprintf("%d messages dead-lettered", n))
	}
	return p
}

// run runs c once, as runOnce does, and once more if that failed for a
// reason other than an interrupt, or if a connection was lost during the
// run (its timing is then disturbed): on a machine shared with other work,
// a server may refuse a publish or close connections now and then, and a
// long sweep should not be lost to it. The retry is reported on stderr.
func (e *env) run(ctx context.Context, c contender, round int, label string) (runResult, error) {
	r, err := e.runOnce(ctx, c, round, label)
	switch {
	case ctx.Err() != nil:
		return r, err
	case err != nil:
		fmt.Fprintf(os.Stderr, "round %d %s failed, trying it again once: %v\n", round, c.name, err)
	case r.Redelivered > 0:
		fmt.Fprintf(os.Stderr, "round %d %s had %d redeliveries (a connection was lost), trying it again once\n", round, c.name, r.Redelivered)
	default:
		return r, nil
	}
	return e.runOnce(ctx, c, round, label+".again")
}

// runOnce fills a fresh queue and consumes it with c. label names the
// queue and the Redis keys, after the run's prefix.
func (e *env) runOnce(ctx context.Context, c contender, round int, label string) (res runResult, err error) {
	gap := 0
	dup := 0.0
	if c.dup {
		// Far enough that a copy is delivered after its original was
		// settled: beyond the prefetch window and the workers in hand.
		dup, gap = e.cfg.dup, max(minDuplicatesGap, 4*c.prefetch+c.workers)
	}
	ids, unique := messageIDs(e.cfg.n, dup, gap)
	b := batch{
		queue:  e.runID + "." + label,
		prefix: e.runID + ":" + label + ":",
		ids:    ids,
		unique: unique,
	}
	defer func() {
		if derr := e.drop(b); derr != nil {
			err = errors.Join(err, fmt.Errorf("clean up: %w", derr))
		}
	}()
	if err := e.fill(ctx, b); err != nil {
		return res, err
	}
	rec := newRecorder(len(ids), c.prefetch)
	cl, err := e.openClients(ctx, c, b.prefix)
	if err != nil {
		return res, err
	}
	defer cl.close()
	before, err := e.commandStats(ctx)
	if err != nil {
		return res, err
	}
	var rttBefore, setupBefore, pgBefore int64
	if cl.rtt != nil {
		rttBefore, setupBefore = cl.rtt.n.Load(), cl.rtt.setup.Load()
	}
	if cl.pg != nil {
		pgBefore = cl.pg.rt.n.Load()
	}

	var pgPIDs []int
	if cl.pg != nil {
		pgPIDs = cl.pg.pids
	}
	cpuBefore := e.cpuTimes(ctx, pgPIDs)
	rctx, cancel := context.WithTimeout(ctx, e.cfg.timeout)
	err = c.consume(rctx, e, b, cl, rec)
	cancel()
	cpuAfter := e.cpuTimes(ctx, pgPIDs)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			err = fmt.Errorf("%w: %d of %d messages settled within -timeout %v", err, rec.final.Load(), len(ids), e.cfg.timeout)
		}
		return res, err
	}

	after, err := e.commandStats(ctx)
	if err != nil {
		return res, err
	}
	res = runResult{
		figures: figures{
			Contender:    c.name,
			Prefetch:     c.prefetch,
			Workers:      c.workers,
			Deliveries:   rec.deliveries.Load(),
			Outcomes:     make(map[string]int64),
			RTTAck:       rec.rttAck.summary(),
			RTTDuplicate: rec.rttDup.summary(),
			CPU:          cpuBefore.usage(cpuAfter, rec.deliveries.Load()),
		},
		Round:             round,
		Messages:          len(ids),
		UniqueIDs:         unique,
		Seconds:           rec.elapsed().Seconds(),
		Redelivered:       rec.redelivered.Load(),
		FailedSettlements: rec.failed.Load(),
		lat:               rec.latencies(),
	}
	res.MsgsPerSec = float64(len(ids)) / res.Seconds
	for o := rabbitmw.Ack; o <= rabbitmw.DeadLetter; o++ {
		if n := rec.outcomes[o].Load(); n > 0 {
			res.Outcomes[o.String()] = n
		}
	}
	res.Effects, res.UniqueEffects, res.RepeatedEffects = rec.effectCounts()
	res.RedisByCommand, res.RedisCommands = statsDelta(before, after)
	if cl.rtt != nil {
		res.RedisRoundTrips = cl.rtt.n.Load() - rttBefore
		res.RedisSetupRoundTrips = cl.rtt.setup.Load() - setupBefore
	}
	if cl.pg != nil {
		res.PostgresRoundTrips = cl.pg.rt.n.Load() - pgBefore
	}
	slices.Sort(res.lat)
	res.P50Micros = micros(percentile(res.lat, 50))
	res.P99Micros = micros(percentile(res.lat, 99))
	if res.LeftReady, res.LeftDead, err = e.leftovers(ctx, b.queue); err != nil {
		return res, err
	}
	return res, nil
}

// clients are the connections of one contender's run to the stores it
// uses.
type clients struct {
	redis *redis.Client // nil unless the contender uses Redis
	rtt   *roundTrips   // redis's round trips
	pg    *pgRun        // nil unless the contender uses PostgreSQL
}

// openClients opens the store clients that c uses, warmed up, the
// PostgreSQL tables named after prefix.
func (e *env) openClients(ctx context.Context, c contender, prefix string) (*clients, error) {
	cl := new(clients)
	if c.redis {
		var err error
		// The hand-written contender calls the client itself; the others
		// go through a store, whose client counts per command.
		if cl.redis, cl.rtt, err = e.newRedisClient(ctx, c.workers, c.kind != kindHand); err != nil {
			return nil, err
		}
		// A consumer that has been running has the store's scripts in
		// Redis's cache; a fresh Redis would charge the first deliveries
		// an extra round trip each (NOSCRIPT, then EVAL).
		if err := redisstore.New(cl.redis, redisstore.Options{}).Load(ctx); err != nil {
			cl.close()
			return nil, err
		}
		if cl.rtt.shares != nil {
			cl.rtt.shares.Clear()
		}
	}
	if c.pg {
		var err error
		if cl.pg, err = e.newPgRun(ctx, prefix, c.workers); err != nil {
			cl.close()
			return nil, err
		}
	}
	return cl, nil
}

func (cl *clients) close() {
	if cl.redis != nil {
		cl.redis.Close()
	}
	if cl.pg != nil {
		cl.pg.close()
	}
}

// inRoundOrder returns a copy of items in the order of round (from 1):
// forwards in odd rounds, backwards in even ones, so that a slow spell of
// the machine hurts all of them alike.
func inRoundOrder[T any](items []T, round int) []T {
	order := slices.Clone(items)
	if round%2 == 0 {
		slices.Reverse(order)
	}
	return order
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// runHeader opens each output of bench: where, which run, with what.
type runHeader struct {
	Machine  machine  `json:"machine"`
	RunID    string   `json:"run_id"`
	Settings settings `json:"settings"`
	// RabbitIdle is RabbitMQ's CPU per second while idle, subtracted from
	// its CPU figures; 0 when unknown.
	RabbitIdle float64 `json:"rabbitmq_idle_cpu_per_s"`
}

// compareResult is the output of a comparison run.
type compareResult struct {
	runHeader
	Summary summaries  `json:"summary"`
	Stack   *stackCost `json:"stack,omitempty"`
	Targets []target   `json:"targets"`
	Runs    []runResult
}

type settings struct {
	Messages   int     `json:"messages"`
	Size       int     `json:"size"`
	Dup        float64 `json:"dup"`
	Rounds     int     `json:"rounds"`
	Prefetch   int     `json:"prefetch"`
	Workers    int     `json:"workers"`
	Defaults   bool    `json:"defaults"` // prefetch and workers are the broker's defaults
	Persistent bool    `json:"persistent"`
}

// summaries are those of the contenders of one run, or of one cell of a
// sweep.
type summaries []summary

// find returns the summary of the contender name, or nil.
func (ss summaries) find(name string) *summary {
	for i := range ss {
		if ss[i].Contender == name {
			return &ss[i]
		}
	}
	return nil
}

// relateToRaw sets the RatioToRaw of each summary, when raw ran.
func (ss summaries) relateToRaw() {
	if raw := ss.find(rawName); raw != nil && raw.Median > 0 {
		median := raw.Median
		for i := range ss {
			ss[i].RatioToRaw = ss[i].Median / median
		}
	}
}

// summary is one contender over all rounds; its figures are those of the
// runs together (CPU weighted by deliveries).
type summary struct {
	figures
	Median float64 `json:"msgs_per_sec_median"`
	Min    float64 `json:"msgs_per_sec_min"`
	Max    float64 `json:"msgs_per_sec_max"`
	// RatioToRaw is Median over raw's median in the same run; 0 when raw
	// did not run.
	RatioToRaw float64 `json:"ratio_to_raw"`
	// Per delivered message (handler run).
	CommandsPerMsg   float64            `json:"redis_commands_per_msg"`
	RoundTripsPerMsg float64            `json:"redis_round_trips_per_msg"`
	ByCommandPerMsg  map[string]float64 `json:"redis_by_command_per_msg,omitempty"`
	Problems         []string           `json:"problems,omitempty"`
	Disturbed        []string           `json:"disturbed,omitempty"` // runs with redeliveries
}

// perDelivery is the store's round trips of every final delivery, acked
// or acked as a duplicate.
func (f figures) perDelivery() rttSummary { return mergeRTT(f.RTTAck, f.RTTDuplicate) }

// summarize folds the runs of one contender.
func summarize(name string, runs []runResult) summary {
	s := summary{figures: figures{Contender: name, Outcomes: make(map[string]int64)}, ByCommandPerMsg: make(map[string]float64)}
	var rates []float64
	var lat []int64
	var cmds, rtts int64
	var ack, dup rttSummary
	byCmd := make(map[string]int64)
	for _, r := range runs {
		s.Prefetch, s.Workers = r.Prefetch, r.Workers
		rates = append(rates, r.MsgsPerSec)
		lat = append(lat, r.lat...)
		cmds += r.RedisCommands
		rtts += r.RedisRoundTrips + r.PostgresRoundTrips
		s.Deliveries += r.Deliveries
		s.Effects += r.Effects
		s.UniqueEffects += r.UniqueEffects
		for k, v := range r.Outcomes {
			s.Outcomes[k] += v
		}
		for k, v := range r.RedisByCommand {
			byCmd[k] += v
		}
		ack = mergeRTT(ack, r.RTTAck)
		dup = mergeRTT(dup, r.RTTDuplicate)
		for _, p := range r.problems() {
			s.Problems = append(s.Problems, fmt.Sprintf("round %d: %s", r.Round, p))
		}
		if r.Redelivered > 0 {
			s.Disturbed = append(s.Disturbed, fmt.Sprintf("round %d: %d redeliveries (a connection was lost during the run; its timing is disturbed)", r.Round, r.Redelivered))
		}
	}
	if len(rates) == 0 {
		return s
	}
	s.CPU = meanCPU(runs)
	slices.Sort(rates)
	s.Median = median(rates)
	s.Min, s.Max = rates[0], rates[len(rates)-1]
	slices.Sort(lat)
	s.P50Micros = micros(percentile(lat, 50))
	s.P99Micros = micros(percentile(lat, 99))
	if s.Deliveries > 0 {
		s.CommandsPerMsg = float64(cmds) / float64(s.Deliveries)
		s.RoundTripsPerMsg = float64(rtts) / float64(s.Deliveries)
		for k, v := range byCmd {
			s.ByCommandPerMsg[k] = float64(v) / float64(s.Deliveries)
		}
	}
	s.RTTAck, s.RTTDuplicate = ack, dup
	return s
}

// meanCPU averages the CPU per message of runs, weighted by deliveries; a
// figure unknown in any run is unknown.
func meanCPU(runs []runResult) cpuUsage {
	var sum cpuUsage
	var n float64
	for _, r := range runs {
		w := float64(r.Deliveries)
		n += w
		for _, f := range [][2]*float64{{&sum.Self, &r.CPU.Self}, {&sum.Redis, &r.CPU.Redis}, {&sum.Rabbit, &r.CPU.Rabbit}, {&sum.Postgres, &r.CPU.Postgres}} {
			if *f[0] < 0 || *f[1] < 0 {
				*f[0] = -1
			} else {
				*f[0] += *f[1] * w
			}
		}
	}
	for _, f := range []*float64{&sum.Self, &sum.Redis, &sum.Rabbit, &sum.Postgres} {
		if *f >= 0 && n > 0 {
			*f /= n
		}
	}
	return sum
}

func mergeRTT(a, b rttSummary) rttSummary {
	n := a.N + b.N
	if n == 0 {
		return rttSummary{}
	}
	return rttSummary{N: n, Mean: (a.Mean*float64(a.N) + b.Mean*float64(b.N)) / float64(n), Max: max(a.Max, b.Max)}
}

func median(sorted []float64) float64 {
	n := len(sorted)
	if n%2 == 1 {
		return sorted[n/2]
	}
	return (sorted[n/2-1] + sorted[n/2]) / 2
}

// runCompare runs the chosen contenders over cfg.rounds rounds, forwards
// in odd rounds and backwards in even ones.
func runCompare(ctx context.Context, e *env, cfg config, prefetch, workers int, defaults bool) (*compareResult, error) {
	names := cfg.only
	if len(names) == 0 {
		names = defaultContenders
	}
	opts := broker.ConsumeOptions{Prefetch: cfg.prefetch, Workers: cfg.workers}
	var cs []contender
	for _, name := range contenderNames { // in table order, whatever the order of -only
		if slices.Contains(names, name) {
			cs = append(cs, newContender(name, prefetch, workers, opts))
		}
	}
	res := &compareResult{runHeader: runHeader{
		RunID:      e.runID,
		RabbitIdle: e.rabbitIdle,
		Settings: settings{
			Messages: cfg.n, Size: cfg.size, Dup: cfg.dup, Rounds: cfg.rounds,
			Prefetch: prefetch, Workers: workers, Defaults: defaults, Persistent: cfg.persistent,
		},
	}}
	res.Settings.print(os.Stdout, e.runID)
	byName := make(map[string][]runResult)
	for round := 1; round <= cfg.rounds; round++ {
		for _, c := range inRoundOrder(cs, round) {
			r, err := e.run(ctx, c, round, fmt.Sprintf("%s.r%d", c.name, round))
			if err != nil {
				return nil, fmt.Errorf("%s, round %d: %w", c.name, round, err)
			}
			progress(r)
			byName[c.name] = append(byName[c.name], r)
			res.Runs = append(res.Runs, r)
		}
	}
	if cfg.stack {
		fmt.Fprintln(os.Stderr, "measuring the stack in process (testing.Benchmark)...")
		sc := measureStack()
		res.Stack = &sc
	}
	for _, c := range cs {
		res.Summary = append(res.Summary, summarize(c.name, byName[c.name]))
	}
	res.Summary.relateToRaw()
	res.Targets = res.targets()
	e.machine.LoadEnd = loadAverage()
	return res, nil
}

// progress reports a finished run on stderr, to show that bench is alive.
func progress(r runResult) {
	fmt.Fprintf(os.Stderr, "round %d %-19s p%-4d w%-3d %9.0f msgs/s  p50 %7.0fµs  p99 %7.0fµs  load %s\n",
		r.Round, r.Contender, r.Prefetch, r.Workers, r.MsgsPerSec, r.P50Micros, r.P99Micros, loadAverage())
}
