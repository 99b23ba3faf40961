package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"time"

	"github.com/rabbitmw/rabbitmw/broker"
)

// figures are what a run of a contender and a summary of its runs both
// report, under the same JSON keys.
type figures struct {
	Contender string `json:"contender"`
	Prefetch  int    `json:"prefetch"`
	Workers   int    `json:"workers"`
	// Deliveries counts the deliveries acked: the messages, duplicates
	// included.
	Deliveries int64 `json:"deliveries"`
	// Effects counts business handler runs; UniqueEffects the message ids
	// that ran at least once.
	Effects       int64    `json:"effects"`
	UniqueEffects int64    `json:"unique_effects"`
	CPU           cpuUsage `json:"cpu"`
}

// runResult is what one contender did in one round.
type runResult struct {
	figures
	Round      int     `json:"round"`
	Messages   int     `json:"messages"`
	UniqueIDs  int     `json:"unique_ids"`
	Seconds    float64 `json:"seconds"` // first effect to last ack
	MsgsPerSec float64 `json:"msgs_per_sec"`
	// Load is the 1-minute load average when the run started.
	Load float64 `json:"load"`
	// RabbitIdle is RabbitMQ's CPU per second just before the run,
	// subtracted from its CPU over the run.
	RabbitIdle float64 `json:"rabbitmq_idle_cpu_per_s"`
	// RepeatedEffects counts the message ids that ran more than once.
	RepeatedEffects int64 `json:"repeated_effects"`
	// RedisCommands is the rise of INFO commandstats' calls during the run:
	// server wide, so other clients of the server add to it.
	RedisCommands  int64            `json:"redis_commands"`
	RedisByCommand map[string]int64 `json:"redis_by_command,omitempty"`
	LeftReady      int              `json:"left_in_queue"`
	LeftDead       int              `json:"left_in_dlq"`
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
	return p
}

// run runs c once, as runOnce does, and once more if that failed for a
// reason other than an interrupt: on a machine shared with other work, a
// server may refuse a publish or close connections now and then (another
// user's rabbitmqctl close_all_connections), and a long sweep should not
// be lost to it. The retry is reported on stderr.
func (e *env) run(ctx context.Context, c contender, round int, label string) (runResult, error) {
	r, err := e.runOnce(ctx, c, round, label)
	if err == nil || ctx.Err() != nil {
		return r, err
	}
	fmt.Fprintf(os.Stderr, "round %d %s failed, trying it again once: %v\n", round, c.name, err)
	return e.runOnce(ctx, c, round, label+".again")
}

// runOnce fills a fresh queue and consumes it with c in a child process;
// with c.procs > 1, as many queues of an equal share of the messages, each
// consumed by a process of its own, all at once. label names the queues,
// the Redis keys and the tables, after the run's prefix.
func (e *env) runOnce(ctx context.Context, c contender, round int, label string) (res runResult, err error) {
	gap := 0
	dup := 0.0
	if c.dup {
		// Far enough that a copy is delivered after its original was
		// settled: beyond the prefetch window and the workers in hand.
		dup, gap = e.cfg.dup, max(minDuplicatesGap, 4*c.prefetch+c.workers)
	}
	procs := max(c.procs, 1)
	batches := make([]batch, procs)
	unique := 0
	for i := range batches {
		ids, u := messageIDs(e.cfg.n/procs, dup, gap)
		name := label
		if procs > 1 {
			name += ".q" + strconv.Itoa(i)
		}
		batches[i] = batch{queue: e.runID + "." + name, prefix: e.runID + ":" + name + ":", ids: ids, unique: u}
		unique += u
	}
	messages := procs * (e.cfg.n / procs)
	defer func() {
		for _, b := range batches {
			if derr := e.drop(b); derr != nil {
				err = errors.Join(err, fmt.Errorf("clean up: %w", derr))
			}
		}
	}()
	for _, b := range batches {
		if err := e.fill(ctx, b); err != nil {
			return res, err
		}
	}
	rctx, cancel := context.WithTimeout(ctx, e.cfg.timeout+time.Minute)
	defer cancel()
	children := make([]*child, procs)
	var pgPIDs []int
	for i, b := range batches {
		ch, ready, err := startChild(rctx, e.childSpec(c, b, false))
		if err != nil {
			return res, err
		}
		defer ch.stop()
		children[i] = ch
		pgPIDs = append(pgPIDs, ready.PgPIDs...)
	}

	load := loadNow()
	before, err := e.commandStats(ctx)
	if err != nil {
		return res, err
	}
	// RabbitMQ's CPU while this run's consumers are connected but idle:
	// other users' load on the shared server, sampled just before the run
	// and subtracted from its CPU over the run.
	idle := idleCPU(ctx, e.rabbitPID, runIdleSample)
	cpuBefore := e.cpuTimes(ctx, pgPIDs)
	cpuBefore.rabbitIdle = idle
	for _, ch := range children {
		if err := ch.start(); err != nil {
			return res, err
		}
	}
	var first, last int64
	var self time.Duration
	for i, ch := range children {
		var done childDone
		if err := ch.read("done", &done); err != nil {
			return res, err
		}
		if i == 0 || done.First < first {
			first = done.First
		}
		last = max(last, done.Last)
		self += done.CPU
	}
	cpuAfter := e.cpuTimes(ctx, pgPIDs)
	after, err := e.commandStats(ctx)
	if err != nil {
		return res, err
	}
	var effects, uniqueEffects, repeated int64
	for _, ch := range children {
		var cr childResult
		if err := ch.read("result", &cr); err != nil {
			return res, err
		}
		if err := ch.wait(); err != nil {
			return res, fmt.Errorf("the child: %w", err)
		}
		if cr.Err != "" {
			return res, errors.New(cr.Err)
		}
		effects += cr.Effects
		uniqueEffects += cr.UniqueEffects
		repeated += cr.RepeatedEffects
	}
	cpuBefore.self, cpuAfter.self = 0, self
	res = runResult{
		figures: figures{
			Contender:     c.name,
			Prefetch:      c.prefetch,
			Workers:       c.workers,
			Deliveries:    int64(messages),
			Effects:       effects,
			UniqueEffects: uniqueEffects,
			CPU:           cpuBefore.usage(cpuAfter, int64(messages)),
		},
		Round:           round,
		RabbitIdle:      idle,
		Messages:        messages,
		UniqueIDs:       unique,
		Seconds:         time.Duration(last - first).Seconds(),
		Load:            load,
		RepeatedEffects: repeated,
	}
	res.MsgsPerSec = float64(messages) / res.Seconds
	res.RedisByCommand, res.RedisCommands = statsDelta(before, after)
	for _, b := range batches {
		ready, dead, err := e.leftovers(ctx, b.queue)
		if err != nil {
			return res, err
		}
		res.LeftReady += ready
		res.LeftDead += dead
	}
	return res, nil
}

// childSpec is what a child runs for c on b.
func (e *env) childSpec(c contender, b batch, latency bool) childSpec {
	return childSpec{
		Contender: c.name, Prefetch: c.prefetch, Workers: c.workers, Opts: c.opts,
		Queue: b.queue, Prefix: b.prefix, N: len(b.ids),
		AMQP: e.cfg.amqpURL, Redis: e.cfg.redisAddr, Postgres: e.cfg.postgresURL,
		Latency: latency, Timeout: e.cfg.timeout,
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
	// Loads is the 1-minute load average at the start of each round.
	Loads   []float64  `json:"loads"`
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

// relateToRaw sets the RatioToRaw of each summary, when plain ran.
func (ss summaries) relateToRaw() {
	if raw := ss.find(plainName); raw != nil && raw.Median > 0 {
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
	// RatioToRaw is Median over plain's median in the same run; 0 when
	// plain did not run.
	RatioToRaw float64 `json:"ratio_to_plain"`
	// LoadMin and LoadMax are the least and the most 1-minute load average
	// at the start of its runs.
	LoadMin float64 `json:"load_min"`
	LoadMax float64 `json:"load_max"`
	// Per delivered message.
	CommandsPerMsg  float64            `json:"redis_commands_per_msg"`
	ByCommandPerMsg map[string]float64 `json:"redis_by_command_per_msg,omitempty"`
	Problems        []string           `json:"problems,omitempty"`
}

// summarize folds the runs of one contender.
func summarize(name string, runs []runResult) summary {
	s := summary{figures: figures{Contender: name}, ByCommandPerMsg: make(map[string]float64)}
	var rates []float64
	var cmds int64
	byCmd := make(map[string]int64)
	for i, r := range runs {
		s.Prefetch, s.Workers = r.Prefetch, r.Workers
		rates = append(rates, r.MsgsPerSec)
		cmds += r.RedisCommands
		s.Deliveries += r.Deliveries
		s.Effects += r.Effects
		s.UniqueEffects += r.UniqueEffects
		for k, v := range r.RedisByCommand {
			byCmd[k] += v
		}
		for _, p := range r.problems() {
			s.Problems = append(s.Problems, fmt.Sprintf("round %d: %s", r.Round, p))
		}
		if i == 0 || r.Load < s.LoadMin {
			s.LoadMin = r.Load
		}
		s.LoadMax = max(s.LoadMax, r.Load)
	}
	if len(rates) == 0 {
		return s
	}
	s.CPU = meanCPU(runs)
	slices.Sort(rates)
	s.Median = median(rates)
	s.Min, s.Max = rates[0], rates[len(rates)-1]
	if s.Deliveries > 0 {
		s.CommandsPerMsg = float64(cmds) / float64(s.Deliveries)
		for k, v := range byCmd {
			s.ByCommandPerMsg[k] = float64(v) / float64(s.Deliveries)
		}
	}
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
		res.Loads = append(res.Loads, loadNow())
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
	fmt.Fprintf(os.Stderr, "round %d %-24s p%-4d w%-3d %9.0f msgs/s  CPU/1,000 %s ms  load %.2f\n",
		r.Round, r.Contender, r.Prefetch, r.Workers, r.MsgsPerSec, fmtCPU(r.CPU.total()), r.Load)
}
