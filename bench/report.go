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

// A target is one of the targets of the benchmark issue, checked against
// the figures of the run.
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
	fmt.Fprintln(w, "targets (issue 5):")
	for _, t := range r.Targets {
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

// targets checks the figures against the targets of issue 5.
func (r *compareResult) targets() []target {
	raw, redis, dup := r.Summary.find(rawName), r.Summary.find(redisName), r.Summary.find(redisDupName)
	handP1, hand := r.Summary.find(handP1Name), r.Summary.find(handName)
	var ts []target

	t := target{Name: "rabbitmw-redis ≥ 0.8 × raw msgs/s at the default settings", Status: notMeasured, Detail: "needs raw and rabbitmw-redis"}
	if raw != nil && redis != nil {
		ratio := redis.Median / raw.Median
		t.Status = verdict(ratio >= 0.8)
		t.Detail = fmt.Sprintf("%.2f (%s vs %s msgs/s, medians)", ratio, thousands(redis.Median), thousands(raw.Median))
		if mem := r.Summary.find(memoryName); mem != nil {
			t.Detail += fmt.Sprintf("; rabbitmw-memory %.2f", mem.Median/raw.Median)
		}
		if !r.Settings.Defaults {
			t.Detail += fmt.Sprintf("; at prefetch %d, workers %d, which are not the defaults", r.Settings.Prefetch, r.Settings.Workers)
		}
	}
	ts = append(ts, t)

	t = target{Name: "≤ 2 Redis round trips per delivered message on the happy path, ≤ 1 for a duplicate", Status: notMeasured, Detail: "needs rabbitmw-redis and rabbitmw-redis-dup"}
	if redis != nil || dup != nil {
		ack := rttSummary{}
		var parts []string
		ok := true
		for _, s := range []*summary{redis, dup} {
			if s != nil {
				ack = mergeRTT(ack, s.RTTAck)
			}
		}
		parts = append(parts, fmt.Sprintf("happy path %.2f per delivery (max %d, %d deliveries)", ack.Mean, ack.Max, ack.N))
		ok = ok && ack.N > 0 && ack.Max <= 2
		if dup != nil {
			parts = append(parts, fmt.Sprintf("duplicate %.2f (max %d, %d deliveries)", dup.RTTDuplicate.Mean, dup.RTTDuplicate.Max, dup.RTTDuplicate.N))
			ok = ok && dup.RTTDuplicate.N > 0 && dup.RTTDuplicate.Max <= 1
		} else {
			parts = append(parts, "duplicates not measured (rabbitmw-redis-dup did not run)")
		}
		t.Status, t.Detail = verdict(ok), strings.Join(parts, "; ")
		if ok && dup == nil { // half of the target was not measured
			t.Status = notMeasured
		}
	}
	ts = append(ts, t)

	t = target{Name: "whole stack over the memory store < 1 µs and < 10 allocs per delivery", Status: notMeasured, Detail: "run without -stack=false, or see BenchmarkChain"}
	if r.Stack != nil {
		n, d := r.Stack.find(stackNew), r.Stack.find(stackDuplicate)
		t.Status = verdict(n.Ns < 1000 && n.Allocs < 10 && d.Ns < 1000 && d.Allocs < 10)
		t.Detail = fmt.Sprintf("new message %s, %d allocs; duplicate %s, %d allocs", fmtNanos(n.Ns), n.Allocs, fmtNanos(d.Ns), d.Allocs)
	}
	ts = append(ts, t)

	t = target{Name: "rabbitmw-redis ≥ 20 × hand-written at its own prefetch 1", Status: notMeasured, Detail: "needs rabbitmw-redis and hand-written-p1"}
	if redis != nil && handP1 != nil {
		ratio := redis.Median / handP1.Median
		t.Status = verdict(ratio >= 20)
		t.Detail = fmt.Sprintf("%.1f × (%s vs %s msgs/s)", ratio, thousands(redis.Median), thousands(handP1.Median))
		if raw != nil {
			// The raw consumer bounds every contender: say how far the
			// bound itself is from the target.
			t.Detail += fmt.Sprintf("; raw, the ceiling, reaches %.1f × on this machine", raw.Median/handP1.Median)
		}
	}
	ts = append(ts, t)

	t = target{Name: "rabbitmw-redis ahead of hand-written at the same prefetch and workers", Status: notMeasured, Detail: "needs rabbitmw-redis and hand-written (and -sweep for every prefetch)"}
	if redis != nil && hand != nil {
		ratio := redis.Median / hand.Median
		t.Status = verdict(ratio > 1)
		t.Detail = fmt.Sprintf("%.2f × at prefetch %d, workers %d (%s vs %s msgs/s); other settings: -sweep",
			ratio, redis.Prefetch, redis.Workers, thousands(redis.Median), thousands(hand.Median))
	}
	ts = append(ts, t)

	t = target{Name: "with batching, store round trips per message: mean < 2, at most 2 on the happy path", Status: notMeasured, Detail: "needs rabbitmw-redis"}
	if batch := r.Summary.find(redisName); batch != nil && batch.RTTAck.N > 0 {
		a := batch.RTTAck
		t.Status = verdict(a.Mean < 2 && a.Max <= 2)
		t.Detail = fmt.Sprintf("%.2f per delivery, max %d (%d deliveries)", a.Mean, a.Max, a.N)
	}
	ts = append(ts, t)

	var problems []string
	for _, s := range r.Summary {
		for _, p := range s.Problems {
			problems = append(problems, s.Contender+" "+p)
		}
	}
	t = target{Name: "every message's effect exactly once, nothing left behind", Status: met, Detail: "all runs"}
	if len(problems) > 0 {
		t.Status, t.Detail = missed, strings.Join(problems, "; ")
	}
	ts = append(ts, t)
	return ts
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
