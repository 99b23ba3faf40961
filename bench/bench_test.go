package main

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"
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
	if err != nil {
		t.Fatal(err)
	}
	if cfg.n != 100 || len(cfg.only) != 2 || cfg.only[1] != redisName || len(cfg.sweepWorkers) != 2 {
		t.Errorf("parseFlags = %+v; want n 100, only [raw rabbitmw-redis], sweep workers [2 4]", cfg)
	}
	for _, args := range [][]string{{"-only", "nope"}, {"-dup", "1"}, {"-n", "0"}, {"-sweep-prefetch", "0"}, {"extra"}} {
		if _, err := parseFlags(args); err == nil {
			t.Errorf("parseFlags(%q) = nil error; want one", args)
		}
	}
}

// The verdicts that bench prints, and BENCHMARKS.md quotes, for the
// throughput ratio and the round-trip targets.
func TestTargets(t *testing.T) {
	rtt := func(mean float64, max int64) rttSummary { return rttSummary{N: 100, Mean: mean, Max: max} }
	sum := func(name string, median float64, ack, dup rttSummary) summary {
		return summary{figures: figures{Contender: name, RTTAck: ack, RTTDuplicate: dup}, Median: median}
	}
	raw := sum(rawName, 1000, rttSummary{}, rttSummary{})
	for _, tc := range []struct {
		name              string
		summaries         summaries
		ratio, roundTrips string
	}{
		{"nothing measured", nil, notMeasured, notMeasured},
		{"ratio met, duplicates not run", summaries{raw, sum(redisName, 800, rtt(2, 2), rttSummary{})}, met, notMeasured},
		{"ratio missed, a third round trip", summaries{raw, sum(redisName, 799, rtt(2.01, 3), rttSummary{})}, missed, missed},
		{"both measured and within", summaries{
			sum(redisName, 0, rtt(2, 2), rttSummary{}),
			sum(redisDupName, 0, rtt(2, 2), rtt(1, 1)),
		}, notMeasured, met},
		{"a duplicate with two round trips", summaries{
			sum(redisName, 0, rtt(2, 2), rttSummary{}),
			sum(redisDupName, 0, rtt(2, 2), rtt(1.01, 2)),
		}, notMeasured, missed},
	} {
		r := &compareResult{Summary: tc.summaries, runHeader: runHeader{Settings: settings{Defaults: true}}}
		ts := r.targets()
		if ts[0].Status != tc.ratio || ts[1].Status != tc.roundTrips {
			t.Errorf("%s: ratio %s, round trips %s; want %s, %s (%s; %s)", tc.name, ts[0].Status, ts[1].Status, tc.ratio, tc.roundTrips, ts[0].Detail, ts[1].Detail)
		}
	}
}

func TestBatchedRoundTripsTarget(t *testing.T) {
	for _, tc := range []struct {
		ack  rttSummary
		want string
	}{
		{rttSummary{}, notMeasured},
		{rttSummary{N: 10, Mean: 0.3, Max: 2}, met},
		{rttSummary{N: 10, Mean: 0.3, Max: 3}, missed},
		{rttSummary{N: 10, Mean: 2, Max: 2}, missed},
	} {
		r := &compareResult{Summary: summaries{{figures: figures{Contender: redisName, RTTAck: tc.ack}}}}
		ts := r.targets()
		got := ts[len(ts)-2]
		if got.Status != tc.want {
			t.Errorf("batched %+v: %s (%s); want %s", tc.ack, got.Status, got.Detail, tc.want)
		}
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
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
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
