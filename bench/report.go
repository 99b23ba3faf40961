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
	fmt.Fprintf(w, "load average at end: %s\n\n", r.Machine.LoadEnd)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tprefetch\tworkers\tmsgs/s median\tmin–max\t× raw\tp50\tp99\tRedis cmds/msg\tstore req/msg\tRTT/msg mean\tmax\t")
	for _, s := range r.Summary {
		ratio := fmtRatio(s.RatioToRaw)
		mean, most := "–", "–"
		if m := s.perDelivery(); m.N > 0 {
			mean, most = fmt.Sprintf("%.2f", m.Mean), strconv.FormatInt(m.Max, 10)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s–%s\t%s\t%s\t%s\t%.2f\t%.2f\t%s\t%s\t\n",
			s.Contender, s.Prefetch, s.Workers, thousands(s.Median), thousands(s.Min), thousands(s.Max),
			ratio, fmtMicros(s.P50Micros), fmtMicros(s.P99Micros), s.CommandsPerMsg, s.RoundTripsPerMsg, mean, most)
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintf(w, "CPU ms per 1,000 delivered messages while consuming (the servers: server wide, so other clients' load counts; RabbitMQ's idle CPU, %.1f %% of a core, subtracted):\n", r.RabbitIdle*100)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "contender\tthis process\tRedis server\tRabbitMQ server\tPostgreSQL server\ttotal\t")
	for _, s := range r.Summary {
		c := s.CPU
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", s.Contender, fmtCPU(c.Self), fmtCPU(c.Redis), fmtCPU(c.Rabbit), fmtCPU(c.Postgres), fmtCPU(c.total()))
	}
	tw.Flush()
	fmt.Fprintln(w)
	fmt.Fprintln(w, "msgs/s: messages over the time from the first delivery to the last settlement; p50/p99: from the")
	fmt.Fprintln(w, "handler's start to the return of its ack; Redis cmds: INFO commandstats, server wide (commands run")
	fmt.Fprintln(w, "by Lua scripts count, and so would another client's); store req: requests sent by the contender's store")
	fmt.Fprintln(w, "client (Redis commands and pipelines; PostgreSQL statements, BEGIN and COMMIT included) per delivery;")
	fmt.Fprintln(w, "RTT/msg, per delivery acked or acked as a duplicate: mean, a request that carried k deliveries'")
	fmt.Fprintln(w, "commands (a batched pipeline) counting 1/k to each; max, the most requests one delivery's commands")
	fmt.Fprintln(w, "travelled in (what it waited for).")
	fmt.Fprintln(w)
	for _, s := range r.Summary {
		s.printDetail(w)
	}
	if r.Stack != nil {
		r.Stack.print(w)
	}
	printTargets(w, r.Targets)
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
		fmt.Fprintf(w, "  %-45s %9s  %2d allocs  %5d B\n", c.Name, fmtNanos(c.Ns), c.Allocs, c.Bytes)
	}
	fmt.Fprintln(w)
}

// printDetail prints what the table leaves out: outcomes, effects, the
// Redis commands by name, and any problem.
func (s summary) printDetail(w io.Writer) {
	fmt.Fprintf(w, "%s: %d deliveries (%s), %d effects of %d message ids",
		s.Contender, s.Deliveries, outcomes(s.Outcomes), s.Effects, s.UniqueEffects)
	if s.RTTAck.N > 0 || s.RTTDuplicate.N > 0 {
		fmt.Fprintf(w, "; store RTT per ack %.2f (max %d)", s.RTTAck.Mean, s.RTTAck.Max)
		if s.RTTDuplicate.N > 0 {
			fmt.Fprintf(w, ", per duplicate %.2f (max %d)", s.RTTDuplicate.Mean, s.RTTDuplicate.Max)
		}
	}
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
	for _, d := range s.Disturbed {
		fmt.Fprintf(w, "  NOTE: %s\n", d)
	}
}

func outcomes(m map[string]int64) string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		parts = append(parts, fmt.Sprintf("%d %s", m[k], k))
	}
	return strings.Join(parts, ", ")
}

// The targets' bounds.
const (
	cpuBound        = 1.25 // rabbitmw-redis's CPU per message, at most × raw's
	rawBound        = 0.8  // rabbitmw-redis's msgs/s, at least × raw's
	handBound       = 3    // rabbitmw-redis's msgs/s, at least × hand-written's
	handP1Bound     = 20   // the extra: at least × hand-written-p1's
	minTargetRounds = 5    // the rounds that a throughput ratio wants
)

// targets checks the figures against the targets of the performance issue,
// in its order, and adds an extra check that is not one of them.
func (r *compareResult) targets() []target {
	ss := r.Summary
	raw, redis := ss.find(rawName), ss.find(redisName)
	var stackNop, stackMem *stackCase
	if r.Stack != nil {
		stackNop, stackMem = r.Stack.find(stackNopNew), r.Stack.find(stackNew)
	}
	return []target{
		cpuTarget(redis, raw, r.Settings),
		rawTarget(redis, raw, ss.find(memoryName), r.Settings),
		watermillTarget(redis, ss.find(watermillName)),
		handTarget(redis, ss.find(handName)),
		stackTarget("whole recommended stack over a no-op store, new message: ≤ 1 µs and ≤ 3 allocs", stackNop, 1000, 3),
		stackTarget("whole recommended stack over the memory store, new message: ≤ 1.5 µs and ≤ 4 allocs", stackMem, 1500, 4),
		roundTripsTarget(redis),
		exactlyOnceTarget(ss),
		handP1Target(redis, ss.find(handP1Name), raw),
	}
}

// cpuTarget checks rabbitmw-redis's total CPU per message (this process,
// Redis and RabbitMQ, as the CPU table adds them) against raw's, at the
// broker's defaults.
func cpuTarget(redis, raw *summary, s settings) target {
	t := target{Name: "rabbitmw-redis at the defaults: CPU per 1,000 messages (consumer + Redis + RabbitMQ) ≤ 1.25 × raw's", Status: notMeasured, Detail: "needs raw and rabbitmw-redis"}
	if raw == nil || redis == nil {
		return t
	}
	a, b := redis.CPU.total(), raw.CPU.total()
	if a < 0 || b <= 0 {
		t.Detail = fmt.Sprintf("CPU unknown (rabbitmw-redis %s, raw %s ms per 1,000)", fmtCPU(a), fmtCPU(b))
		return t
	}
	ratio := a / b
	t.Status = verdict(ratio <= cpuBound)
	t.Detail = fmt.Sprintf("%.2f × (%s vs %s ms per 1,000 messages)", ratio, fmtCPU(a), fmtCPU(b))
	if !s.Defaults {
		t.Status = notMeasured
		t.Detail += notDefaults(s)
	}
	return t
}

// rawTarget checks rabbitmw-redis's median msgs/s against raw's; fewer
// rounds than minTargetRounds leave it not measured, with the figures.
func rawTarget(redis, raw, mem *summary, s settings) target {
	t := target{Name: "rabbitmw-redis ≥ 0.8 × raw's msgs/s (medians of ≥ 5 alternating rounds)", Status: notMeasured, Detail: "needs raw and rabbitmw-redis"}
	if raw == nil || redis == nil || raw.Median <= 0 {
		return t
	}
	ratio := redis.Median / raw.Median
	t.Status = verdict(ratio >= rawBound)
	t.Detail = fmt.Sprintf("%.2f × (%s vs %s msgs/s, medians of %d rounds)", ratio, thousands(redis.Median), thousands(raw.Median), s.Rounds)
	if mem != nil {
		t.Detail += fmt.Sprintf("; rabbitmw-memory %.2f ×", mem.Median/raw.Median)
	}
	if !s.Defaults {
		t.Detail += notDefaults(s)
	}
	if s.Rounds < minTargetRounds {
		t.Detail += fmt.Sprintf("; would be %s, but %d rounds are fewer than %d (-rounds)", t.Status, s.Rounds, minTargetRounds)
		t.Status = notMeasured
	}
	return t
}

// watermillTarget checks that rabbitmw-redis is faster than Watermill.
func watermillTarget(redis, wm *summary) target {
	t := target{Name: "rabbitmw-redis ahead of watermill in msgs/s", Status: notMeasured, Detail: "needs rabbitmw-redis and watermill"}
	if redis == nil || wm == nil || wm.Median <= 0 {
		return t
	}
	ratio := redis.Median / wm.Median
	t.Status = verdict(ratio > 1)
	t.Detail = fmt.Sprintf("%.2f × (%s vs %s msgs/s, medians)", ratio, thousands(redis.Median), thousands(wm.Median))
	return t
}

// handTarget checks rabbitmw-redis's msgs/s against the hand-written
// pattern's at the same prefetch and workers, and gives their CPU ratio.
func handTarget(redis, hand *summary) target {
	t := target{Name: "rabbitmw-redis ≥ 3 × hand-written's msgs/s at the same prefetch and workers", Status: notMeasured, Detail: "needs rabbitmw-redis and hand-written"}
	if redis == nil || hand == nil || hand.Median <= 0 {
		return t
	}
	ratio := redis.Median / hand.Median
	t.Status = verdict(ratio >= handBound)
	t.Detail = fmt.Sprintf("%.2f × at prefetch %d, workers %d (%s vs %s msgs/s)",
		ratio, redis.Prefetch, redis.Workers, thousands(redis.Median), thousands(hand.Median))
	if redis.Prefetch != hand.Prefetch || redis.Workers != hand.Workers {
		t.Status = notMeasured
		t.Detail += fmt.Sprintf("; hand-written ran at prefetch %d, workers %d", hand.Prefetch, hand.Workers)
	}
	if a, b := redis.CPU.total(), hand.CPU.total(); a >= 0 && b > 0 {
		t.Detail += fmt.Sprintf("; CPU per message %.2f × hand-written's (%s vs %s ms per 1,000)", a/b, fmtCPU(a), fmtCPU(b))
	}
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
	t.Detail = fmt.Sprintf("%s, %d allocs", fmtNanos(c.Ns), c.Allocs)
	return t
}

// roundTripsTarget checks rabbitmw-redis's store round trips per acked
// delivery.
func roundTripsTarget(redis *summary) target {
	t := target{Name: "rabbitmw-redis's store round trips per message on the happy path: mean < 2, max ≤ 2", Status: notMeasured, Detail: "needs rabbitmw-redis"}
	if redis == nil || redis.RTTAck.N == 0 {
		return t
	}
	a := redis.RTTAck
	t.Status = verdict(a.Mean < 2 && a.Max <= 2)
	t.Detail = fmt.Sprintf("mean %.2f, max %d (%d deliveries)", a.Mean, a.Max, a.N)
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

// handP1Target is not one of the targets: it compares
// rabbitmw-redis with the hand-written pattern as teams run it, at
// prefetch 1 and 1 worker.
func handP1Target(redis, handP1, raw *summary) target {
	t := target{Name: "extra, not the issue's: rabbitmw-redis ≥ 20 × hand-written at its own prefetch 1", Status: notMeasured, Detail: "needs rabbitmw-redis and hand-written-p1"}
	if redis == nil || handP1 == nil || handP1.Median <= 0 {
		return t
	}
	ratio := redis.Median / handP1.Median
	t.Status = verdict(ratio >= handP1Bound)
	t.Detail = fmt.Sprintf("%.1f × (%s vs %s msgs/s)", ratio, thousands(redis.Median), thousands(handP1.Median))
	if raw != nil {
		// The raw consumer bounds every contender: say how far the
		// bound itself is from the target.
		t.Detail += fmt.Sprintf("; raw, the ceiling, reaches %.1f × on this machine", raw.Median/handP1.Median)
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

// fmtRatio formats a ratio to raw, "–" when there is none.
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
