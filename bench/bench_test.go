package main

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestMessageIDs(t *testing.T) {
	tests := []struct {
		n          int
		dup        float64
		gap        int
		wantUnique int
	}{
		{n: 10, dup: 0, gap: 4, wantUnique: 10},
		{n: 20000, dup: 0.2, gap: 1000, wantUnique: 16000},
		{n: 100, dup: 0.5, gap: 1000, wantUnique: 50}, // gap shrunk to n/2
		{n: 1, dup: 0.5, gap: 1000, wantUnique: 1},
	}
	for _, tc := range tests {
		ids, unique := messageIDs(tc.n, tc.dup, tc.gap)
		if len(ids) != tc.n || unique != tc.wantUnique {
			t.Errorf("messageIDs(%d, %v, %d) = %d ids, %d unique; want %d, %d", tc.n, tc.dup, tc.gap, len(ids), unique, tc.n, tc.wantUnique)
		}
		first := map[string]int{}
		for i, id := range ids {
			if j, seen := first[id]; seen {
				if gap := min(tc.gap, tc.n/2); i-j < gap {
					t.Errorf("messageIDs(%d, %v, %d): %s at %d and %d, less than %d apart", tc.n, tc.dup, tc.gap, id, j, i, gap)
				}
				continue
			}
			first[id] = i
		}
		if len(first) != unique {
			t.Errorf("messageIDs(%d, %v, %d): %d distinct ids; want %d", tc.n, tc.dup, tc.gap, len(first), unique)
		}
	}
}

func TestPercentile(t *testing.T) {
	sorted := []int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, tc := range []struct {
		p    float64
		want time.Duration
	}{{50, 5}, {99, 10}, {100, 10}, {10, 1}, {1, 1}} {
		if got := percentile(sorted, tc.p); got != tc.want {
			t.Errorf("percentile(1..10, %v) = %v; want %v", tc.p, got, tc.want)
		}
	}
	if got := percentile(nil, 50); got != 0 {
		t.Errorf("percentile(nil, 50) = %v; want 0", got)
	}
}

func TestThousands(t *testing.T) {
	for _, tc := range []struct {
		v    float64
		want string
	}{{0, "0"}, {999.4, "999"}, {1000, "1,000"}, {1234567.8, "1,234,568"}} {
		if got := thousands(tc.v); got != tc.want {
			t.Errorf("thousands(%v) = %q; want %q", tc.v, got, tc.want)
		}
	}
}

// The raw and hand-written contenders run with the settings that the
// broker reports in its log: if that record changes, this fails, rather
// than the benchmark comparing at different settings.
func TestBrokerSettings(t *testing.T) {
	ctx := context.Background()
	p, w, err := brokerSettings(ctx, 0, 0)
	if err != nil || p < 1 || w < 1 {
		t.Fatalf("brokerSettings(0, 0) = %d, %d, %v; want the defaults", p, w, err)
	}
	p, w, err = brokerSettings(ctx, 7, 3)
	if err != nil || p != 7 || w != 3 {
		t.Fatalf("brokerSettings(7, 3) = %d, %d, %v; want 7, 3, nil", p, w, err)
	}
}

func TestParseFlags(t *testing.T) {
	cfg, err := parseFlags([]string{"-n", "100", "-only", "raw, rabbitmw-redis", "-sweep-workers", "2,4"})
	require.NoError(t, err)
	if cfg.n != 100 || len(cfg.only) != 2 || cfg.only[1] != redisName || len(cfg.sweepWorkers) != 2 {
		t.Errorf("parseFlags = %+v; want n 100, only [raw rabbitmw-redis], sweep workers [2 4]", cfg)
	}
	for _, args := range [][]string{{"-only", "nope"}, {"-dup", "1"}, {"-n", "0"}, {"-sweep-prefetch", "0"}, {"extra"}} {
		if _, err := parseFlags(args); err == nil {
			t.Errorf("parseFlags(%q) = nil error; want one", args)
		}
	}
}

// The verdicts that bench prints, and BENCHMARKS.md quotes: each target
// met, missed, and not measured.
func TestTargets(t *testing.T) {
	cpu := func(self, redis, rabbit float64) cpuUsage {
		return cpuUsage{Self: self, Redis: redis, Rabbit: rabbit, Postgres: -1}
	}
	sum := func(name string, median float64, c cpuUsage) *summary {
		return &summary{figures: figures{Contender: name, Prefetch: 32, Workers: 16, CPU: c}, Median: median}
	}
	at := func(p, w int, s *summary) *summary { s.Prefetch, s.Workers = p, w; return s }
	withRTT := func(mean float64, max int64, n int64) *summary {
		s := sum(redisName, 0, cpuUsage{})
		s.RTTAck = rttSummary{N: n, Mean: mean, Max: max}
		return s
	}
	withProblem := func(p string) summaries {
		s := *sum(redisName, 0, cpuUsage{})
		s.Problems = []string{p}
		return summaries{*sum(rawName, 0, cpuUsage{}), s}
	}
	defaults := settings{Defaults: true, Rounds: 5, Prefetch: 32, Workers: 16}
	other := settings{Defaults: false, Rounds: 5, Prefetch: 8, Workers: 4}
	fewRounds := settings{Defaults: true, Rounds: 3, Prefetch: 32, Workers: 16}
	raw := sum(rawName, 1000, cpu(50, 0, 50))
	hand := sum(handName, 300, cpu(150, 100, 100))
	stack := func(ns float64, allocs int64) *stackCase { return &stackCase{Name: stackNew, Ns: ns, Allocs: allocs} }

	for _, tc := range []struct {
		name string
		got  target
		want string
	}{
		{"CPU at the bound", cpuTarget(sum(redisName, 0, cpu(75, 25, 25)), raw, defaults), met},
		{"CPU over the bound", cpuTarget(sum(redisName, 0, cpu(75, 26, 25)), raw, defaults), missed},
		{"CPU without raw", cpuTarget(sum(redisName, 0, cpu(1, 1, 1)), nil, defaults), notMeasured},
		{"CPU unknown", cpuTarget(sum(redisName, 0, cpu(1, -1, 1)), raw, defaults), notMeasured},
		{"CPU not at the defaults", cpuTarget(sum(redisName, 0, cpu(1, 1, 1)), raw, other), notMeasured},

		{"raw at the bound", rawTarget(sum(redisName, 800, cpuUsage{}), raw, nil, defaults), met},
		{"raw under the bound", rawTarget(sum(redisName, 799, cpuUsage{}), raw, nil, defaults), missed},
		{"raw not at the defaults", rawTarget(sum(redisName, 800, cpuUsage{}), raw, nil, other), met},
		{"raw in too few rounds", rawTarget(sum(redisName, 900, cpuUsage{}), raw, nil, fewRounds), notMeasured},
		{"raw did not run", rawTarget(sum(redisName, 900, cpuUsage{}), nil, nil, defaults), notMeasured},

		{"ahead of watermill", watermillTarget(sum(redisName, 1001, cpuUsage{}), sum(watermillName, 1000, cpuUsage{})), met},
		{"level with watermill", watermillTarget(sum(redisName, 1000, cpuUsage{}), sum(watermillName, 1000, cpuUsage{})), missed},
		{"watermill did not run", watermillTarget(sum(redisName, 1000, cpuUsage{}), nil), notMeasured},

		{"3 × hand-written", handTarget(sum(redisName, 900, cpu(1, 1, 1)), hand), met},
		{"under 3 × hand-written", handTarget(sum(redisName, 899, cpu(1, 1, 1)), hand), missed},
		{"hand-written at other settings", handTarget(sum(redisName, 900, cpu(1, 1, 1)), at(8, 4, sum(handName, 300, cpuUsage{}))), notMeasured},
		{"hand-written did not run", handTarget(sum(redisName, 900, cpu(1, 1, 1)), nil), notMeasured},

		{"stack within", stackTarget("", stack(1000, 3), 1000, 3), met},
		{"stack too slow", stackTarget("", stack(1001, 3), 1000, 3), missed},
		{"stack allocates too much", stackTarget("", stack(500, 4), 1000, 3), missed},
		{"stack not measured", stackTarget("", nil, 1000, 3), notMeasured},

		{"round trips within", roundTripsTarget(withRTT(0.3, 2, 100)), met},
		{"a third round trip", roundTripsTarget(withRTT(0.3, 3, 100)), missed},
		{"a mean of 2", roundTripsTarget(withRTT(2, 2, 100)), missed},
		{"no deliveries counted", roundTripsTarget(withRTT(0, 0, 0)), notMeasured},
		{"rabbitmw-redis did not run", roundTripsTarget(nil), notMeasured},

		{"exactly once", exactlyOnceTarget(summaries{*raw, *hand}), met},
		{"a message left behind", exactlyOnceTarget(withProblem("round 1: 1 messages left in the queue, 0 in its dead-letter queue")), missed},

		{"20 × hand-written-p1", handP1Target(sum(redisName, 2000, cpuUsage{}), sum(handP1Name, 100, cpuUsage{}), raw), met},
		{"under 20 × hand-written-p1", handP1Target(sum(redisName, 1999, cpuUsage{}), sum(handP1Name, 100, cpuUsage{}), nil), missed},
		{"hand-written-p1 did not run", handP1Target(sum(redisName, 2000, cpuUsage{}), nil, raw), notMeasured},
	} {
		if tc.got.Status != tc.want {
			t.Errorf("%s: %s (%s); want %s", tc.name, tc.got.Status, tc.got.Detail, tc.want)
		}
	}
}

// The targets of a saved run (go run . -rounds 5 -only raw,hand-written,
// rabbitmw-memory,rabbitmw-redis,rabbitmw-redis-unbatched,rabbitmw-pgstore,
// watermill -json testdata/table0.json), judged again from its JSON. Run
// with -v to see them as bench prints them.
func TestTargetsOfSavedRun(t *testing.T) {
	b, err := os.ReadFile("testdata/table0.json")
	require.NoError(t, err)
	var r compareResult
	require.NoError(t, json.Unmarshal(b, &r))
	ts := r.targets()
	var out strings.Builder
	printTargets(&out, ts)
	t.Log("\n" + out.String())
	want := []string{met, met, met, missed, missed, missed, met, met, notMeasured}
	var got []string
	for _, tg := range ts {
		got = append(got, tg.Status)
	}
	if !slices.Equal(got, want) {
		t.Errorf("statuses %q; want %q", got, want)
	}
	if s := out.String(); strings.Contains(s, "issue 5") || !strings.HasPrefix(s, "targets:\n") {
		t.Errorf("printed %q; want it headed \"targets:\", with no issue number", s)
	}
}

// The outputs, a run and a summary keep their JSON keys (a run and a
// summary share theirs through figures).
func TestResultJSON(t *testing.T) {
	for _, tc := range []struct {
		v    any
		want []string
	}{
		{&compareResult{}, []string{"Runs", "machine", "rabbitmq_idle_cpu_per_s", "run_id", "settings", "summary", "targets"}},
		{&sweepResult{}, []string{"cells", "defaults", "grid_prefetch", "grid_workers", "machine", "rabbitmq_idle_cpu_per_s", "run_id", "settings"}},
		{&runResult{}, []string{"contender", "cpu", "deliveries", "effects", "failed_settlements", "left_in_dlq", "left_in_queue", "messages", "msgs_per_sec", "outcomes", "p50_us", "p99_us", "prefetch", "redelivered", "redis_commands", "redis_round_trips", "redis_setup_round_trips", "repeated_effects", "round", "rtt_per_ack", "rtt_per_duplicate", "seconds", "unique_effects", "unique_ids", "workers"}},
		{&summary{}, []string{"contender", "cpu", "deliveries", "effects", "msgs_per_sec_max", "msgs_per_sec_median", "msgs_per_sec_min", "outcomes", "p50_us", "p99_us", "prefetch", "ratio_to_raw", "redis_commands_per_msg", "redis_round_trips_per_msg", "rtt_per_ack", "rtt_per_duplicate", "unique_effects", "workers"}},
	} {
		b, err := json.Marshal(tc.v)
		require.NoError(t, err)
		var m map[string]any
		require.NoError(t, json.Unmarshal(b, &m))
		if got := slices.Sorted(maps.Keys(m)); !slices.Equal(got, tc.want) {
			t.Errorf("%T keys = %v; want %v", tc.v, got, tc.want)
		}
	}
}

// Each contender of a set of summaries is related to raw's median.
func TestRelateToRaw(t *testing.T) {
	ss := summaries{{figures: figures{Contender: redisName}, Median: 500}, {figures: figures{Contender: rawName}, Median: 1000}}
	ss.relateToRaw()
	if ss.find(redisName).RatioToRaw != 0.5 || ss.find(rawName).RatioToRaw != 1 {
		t.Errorf("ratios %v; want 0.5 and 1", ss)
	}
	ss = summaries{{figures: figures{Contender: redisName}, Median: 500}}
	ss.relateToRaw()
	if ss.find(rawName) != nil || ss[0].RatioToRaw != 0 {
		t.Errorf("without raw: %v; want ratio 0", ss)
	}
}

func TestInRoundOrder(t *testing.T) {
	items := []string{"a", "b", "c"}
	if got := inRoundOrder(items, 1); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Errorf("round 1: %v; want a b c", got)
	}
	if got := inRoundOrder(items, 2); !slices.Equal(got, []string{"c", "b", "a"}) {
		t.Errorf("round 2: %v; want c b a", got)
	}
	if !slices.Equal(items, []string{"a", "b", "c"}) {
		t.Errorf("inRoundOrder changed its argument: %v", items)
	}
}
