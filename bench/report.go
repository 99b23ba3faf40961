package main

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
)

// A target is one of the targets of the performance issue, checked
// against the figures of the run.
type target struct {
	Name   string `json:"name"`
	Status string `json:"status"` // met, missed, or not measured
	Detail string `json:"detail"`
}

const (
	met         = "MET"
	missed      = "MISSED"
	notMeasured = "NOT MEASURED"
	// informational: figures set beside a target's bounds, not a target.
	informational = "INFO"
)

func verdict(ok bool) string {
	if ok {
		return met
	}
	return missed
}

func (s settings) print(w io.Writer, runID string) {
	common := fmt.Sprintf("prefetch %d, workers %d", s.Prefetch, s.Workers)
	if s.Defaults {
		common += " (the broker's defaults)"
	}
	fmt.Fprintf(w, "run %s: %d %s messages of %d bytes per run, %d rounds, dup %.0f%%; common setting: %s\n\n",
		runID, s.Messages, s.mode(), s.Size, s.Rounds, 100*s.Dup, common)
}

// mode says how the messages were published.
func (s settings) mode() string {
	if s.Persistent {
		return "persistent"
	}
	return "transient"
}

func (r *compareResult) print(w io.Writer) {
	fmt.Fprintf(w, "load average at end: %s; 1-minute load at the start of each round: %s\n\n", r.Machine.LoadEnd, fmtLoads(r.Loads))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tprefetch\tworkers\tmsgs/s median\tmin–max\t× plain\tCPU: consumer\tRedis\tRabbitMQ\tPostgreSQL\ttotal\t× plain\tRedis cmds/msg\tload\t")
	plain := r.Summary.find(plainName)
	for _, s := range r.Summary {
		cpuRatio := "–"
		if plain != nil && plain.CPU.total() > 0 && s.CPU.total() >= 0 {
			cpuRatio = fmt.Sprintf("%.2f", s.CPU.total()/plain.CPU.total())
		}
		c := s.CPU
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s–%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.2f\t%s\t\n",
			s.Contender, s.Prefetch, s.Workers, thousands(s.Median), thousands(s.Min), thousands(s.Max),
			fmtRatio(s.RatioToRaw), fmtCPU(c.Self), fmtCPU(c.Redis), fmtCPU(c.Rabbit), fmtCPU(c.Postgres), fmtCPU(c.total()),
			cpuRatio, s.CommandsPerMsg, s.loads())
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintf(w, "msgs/s: messages over the time from the first effect to the last ack, each contender in a process of\n")
	fmt.Fprintf(w, "its own with nothing on its per-delivery path but an atomic count; CPU: ms per 1,000 messages over\n")
	fmt.Fprintf(w, "that run, of the consumer's process, the Redis server, the RabbitMQ server (its CPU per second in the\n")
	fmt.Fprintf(w, "second before the run, other users' load, subtracted; %.1f %% of a core at start-up) and the PostgreSQL\n", r.RabbitIdle*100)
	fmt.Fprintf(w, "processes serving the run; the servers' figures are server wide,\n")
	fmt.Fprintf(w, "so other clients' load counts; Redis cmds: INFO commandstats, server wide; load: the 1-minute load\n")
	fmt.Fprintf(w, "average at the start of the contender's runs.\n\n")
	for _, s := range r.Summary {
		s.printDetail(w)
	}
	if r.Stack != nil {
		r.Stack.print(w)
	}
	printTargets(w, r.Targets)
}

// loads formats the range of the load averages of s's runs.
func (s summary) loads() string {
	if s.LoadMin == s.LoadMax {
		return fmt.Sprintf("%.1f", s.LoadMin)
	}
	return fmt.Sprintf("%.1f–%.1f", s.LoadMin, s.LoadMax)
}

func fmtLoads(ls []float64) string {
	var parts []string
	for _, l := range ls {
		parts = append(parts, fmt.Sprintf("%.2f", l))
	}
	return strings.Join(parts, ", ")
}

// printTargets prints one line per target: its status, the target, and
// the figures it was judged on.
func printTargets(w io.Writer, ts []target) {
	fmt.Fprintln(w, "targets:")
	for _, t := range ts {
		fmt.Fprintf(w, "  %-13s %s: %s\n", t.Status, t.Name, t.Detail)
	}
}

func (sc *stackCost) print(w io.Writer) {
	fmt.Fprintln(w, "the stack in process, per delivery (testing.Benchmark, median of 3):")
	for _, c := range sc.Cases {
		fmt.Fprintf(w, "  %-56s %9s (%9s CPU)  %2d allocs  %5d B\n", c.Name, fmtNanos(c.Ns), fmtNanos(c.CPUNs), c.Allocs, c.Bytes)
	}
	fmt.Fprintln(w)
}

// printDetail prints what the table leaves out: effects, the Redis
// commands by name, and any problem.
func (s summary) printDetail(w io.Writer) {
	fmt.Fprintf(w, "%s: %d deliveries acked, %d effects of %d message ids", s.Contender, s.Deliveries, s.Effects, s.UniqueEffects)
	if len(s.ByCommandPerMsg) > 0 {
		var parts []string
		for _, k := range slices.Sorted(maps.Keys(s.ByCommandPerMsg)) {
			if v := s.ByCommandPerMsg[k]; v >= 0.005 {
				parts = append(parts, fmt.Sprintf("%s %.2f", k, v))
			}
		}
		if len(parts) > 0 {
			fmt.Fprintf(w, "; Redis cmds/msg: %s", strings.Join(parts, ", "))
		}
	}
	fmt.Fprintln(w)
	for _, p := range s.Problems {
		fmt.Fprintf(w, "  PROBLEM: %s\n", p)
	}
}

// The targets' bounds.
const (
	redisRateBound  = 0.85 // rabbitmw-redis's msgs/s, at least × plain's
	redisCPUBound   = 1.0  // rabbitmw-redis's total CPU per message, at most × plain's
	pgRateBound     = 1.2  // rabbitmw-postgres's msgs/s, at least × hand-written-pg's
	pgCPUBound      = 0.9  // rabbitmw-postgres's total CPU per message, at most × hand-written-pg's
	stackNsBound    = 2000 // the stack, realistic handler, memory store: ns per new message
	stackAllocBound = 6    // and allocations
	minTargetRounds = 5    // the rounds that a throughput ratio wants
)

// targets checks the figures against the performance targets.
func (r *compareResult) targets() []target {
	ss := r.Summary
	plain, redis, wm := ss.find(plainName), ss.find(redisName), ss.find(watermillName)
	hand, pg, pgGroup := ss.find(handPgName), ss.find(postgresName), ss.find(postgresGroupName)
	var stackWaits *stackCase
	if r.Stack != nil {
		stackWaits = r.Stack.find(stackWaitsNew)
	}
	return []target{
		rateTarget("rabbitmw-redis at the defaults ≥ 0.85 × plain's msgs/s", redis, plain, redisRateBound, r.Settings),
		cpuTarget("rabbitmw-redis at the defaults: total CPU per message (consumer + Redis + RabbitMQ) ≤ 1.0 × plain's", redis, plain, redisCPUBound, r.Settings),
		watermillTarget(redis, wm),
		rateTarget("rabbitmw-postgres ≥ 1.2 × hand-written-pg's msgs/s", pg, hand, pgRateBound, r.Settings),
		cpuTarget("rabbitmw-postgres: total CPU per message (consumer + RabbitMQ + PostgreSQL) ≤ 0.9 × hand-written-pg's", pg, hand, pgCPUBound, r.Settings),
		groupCommitLine(pgGroup, hand, r.Settings),
		stackTarget("the stack over the memory store, new message, a handler that waits on its context: ≤ 2 µs and ≤ 6 allocs", stackWaits, stackNsBound, stackAllocBound),
		exactlyOnceTarget(ss),
	}
}

// rateTarget checks that a's median msgs/s is at least bound × b's; fewer
// rounds than minTargetRounds leave it not measured, with the figures.
func rateTarget(name string, a, b *summary, bound float64, s settings) target {
	t := target{Name: name + " (medians of ≥ 5 alternating rounds)", Status: notMeasured, Detail: "needs both contenders"}
	if a == nil || b == nil || b.Median <= 0 {
		return t
	}
	ratio := a.Median / b.Median
	t.Status = verdict(ratio >= bound)
	t.Detail = fmt.Sprintf("%.2f × (%s vs %s msgs/s, medians of %d rounds; load %s)", ratio, thousands(a.Median), thousands(b.Median), s.Rounds, a.loads())
	if !s.Defaults {
		t.Detail += notDefaults(s)
	}
	if s.Rounds < minTargetRounds {
		t.Detail += fmt.Sprintf("; would be %s, but %d rounds are fewer than %d (-rounds)", t.Status, s.Rounds, minTargetRounds)
		t.Status = notMeasured
	}
	return t
}

// cpuTarget checks that a's total CPU per message is at most bound × b's.
func cpuTarget(name string, a, b *summary, bound float64, s settings) target {
	t := target{Name: name, Status: notMeasured, Detail: "needs both contenders"}
	if a == nil || b == nil {
		return t
	}
	x, y := a.CPU.total(), b.CPU.total()
	if x < 0 || y <= 0 {
		t.Detail = fmt.Sprintf("CPU unknown (%s vs %s ms per 1,000)", fmtCPU(x), fmtCPU(y))
		return t
	}
	ratio := x / y
	t.Status = verdict(ratio <= bound)
	t.Detail = fmt.Sprintf("%.2f × (%s vs %s ms per 1,000 messages)", ratio, fmtCPU(x), fmtCPU(y))
	if !s.Defaults {
		t.Detail += notDefaults(s)
	}
	return t
}

// groupCommitLine sets the figures of rabbitmw-postgres-group, the inbox
// with group commit (an option), beside the bounds of the PostgreSQL
// targets, which are those of the default: informational.
func groupCommitLine(group, hand *summary, s settings) target {
	t := target{Name: "informational: rabbitmw-postgres-group (group commit, an option) against the same bounds", Status: notMeasured, Detail: "needs both contenders"}
	if group == nil || hand == nil {
		return t
	}
	rate, cpu := rateTarget("", group, hand, pgRateBound, s), cpuTarget("", group, hand, pgCPUBound, s)
	t.Status = informational
	t.Detail = fmt.Sprintf("msgs/s %s (%s); CPU per message %s (%s)", rate.Detail, rate.Status, cpu.Detail, cpu.Status)
	return t
}

// watermillTarget checks that rabbitmw-redis is ahead of Watermill in
// msgs/s and in total CPU per message.
func watermillTarget(redis, wm *summary) target {
	t := target{Name: "rabbitmw-redis ahead of watermill in msgs/s and in total CPU per message", Status: notMeasured, Detail: "needs rabbitmw-redis and watermill"}
	if redis == nil || wm == nil || wm.Median <= 0 {
		return t
	}
	rate := redis.Median / wm.Median
	a, b := redis.CPU.total(), wm.CPU.total()
	if a < 0 || b <= 0 {
		t.Detail = fmt.Sprintf("%.2f × in msgs/s; CPU unknown", rate)
		return t
	}
	t.Status = verdict(rate > 1 && a < b)
	t.Detail = fmt.Sprintf("%.2f × in msgs/s (%s vs %s), %.2f × in CPU (%s vs %s ms per 1,000)",
		rate, thousands(redis.Median), thousands(wm.Median), a/b, fmtCPU(a), fmtCPU(b))
	return t
}

// stackTarget checks one in-process measurement of the stack against
// bounds of ns per delivery and allocations per delivery.
func stackTarget(name string, c *stackCase, ns float64, allocs int64) target {
	t := target{Name: name, Status: notMeasured, Detail: "run without -stack=false, or see BenchmarkChain"}
	if c == nil {
		return t
	}
	t.Status = verdict(c.Ns <= ns && c.Allocs <= allocs)
	t.Detail = fmt.Sprintf("%s (%s of the thread's CPU), %d allocs (load %s)", fmtNanos(c.Ns), fmtNanos(c.CPUNs), c.Allocs, c.Load)
	return t
}

// exactlyOnceTarget checks that no run of any contender had a problem.
func exactlyOnceTarget(ss summaries) target {
	var problems []string
	for _, s := range ss {
		for _, p := range s.Problems {
			problems = append(problems, s.Contender+" "+p)
		}
	}
	t := target{Name: "every message's effect exactly once, nothing left behind", Status: met, Detail: "all runs"}
	if len(problems) > 0 {
		t.Status, t.Detail = missed, strings.Join(problems, "; ")
	}
	return t
}

// notDefaults says that a figure was not measured at the broker's
// defaults.
func notDefaults(s settings) string {
	return fmt.Sprintf("; at prefetch %d, workers %d, which are not the defaults", s.Prefetch, s.Workers)
}

// thousands formats v rounded, with thin separators: 12,345.
func thousands(v float64) string {
	s := strconv.FormatInt(int64(v+0.5), 10)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

func fmtMicros(us float64) string {
	switch {
	case us >= 10000:
		return fmt.Sprintf("%.1f ms", us/1000)
	case us >= 100:
		return fmt.Sprintf("%.0f µs", us)
	}
	return fmt.Sprintf("%.1f µs", us)
}

// fmtRatio formats a ratio to plain, "–" when there is none.
func fmtRatio(r float64) string {
	if r <= 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f", r)
}

func fmtCPU(us float64) string {
	if us < 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f", us)
}

func fmtNanos(ns float64) string {
	if ns >= 1000 {
		return fmt.Sprintf("%.2f µs", ns/1000)
	}
	return fmt.Sprintf("%.0f ns", ns)
}

// writeJSON writes v to path, if path is set.
func writeJSON(path string, v any) error {
	if path == "" {
		return nil
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
