package main

import (
	"context"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
)

// A request counts 1/k to each of the k deliveries whose commands it
// carried, and once to what each of them waited for.
func TestRoundTripShares(t *testing.T) {
	ctx := context.Background()
	rt := &roundTrips{shares: new(sync.Map)}
	pipeline := rt.ProcessPipelineHook(func(context.Context, []redis.Cmder) error { return nil })
	process := rt.ProcessHook(func(context.Context, redis.Cmder) error { return nil })

	var a, b probe
	batch := []redis.Cmder{redis.NewCmd(ctx, "evalsha"), redis.NewCmd(ctx, "evalsha"), redis.NewCmd(ctx, "evalsha"), redis.NewCmd(ctx, "del")}
	pipeline(ctx, batch)
	alone := redis.NewCmd(ctx, "evalsha")
	process(ctx, alone)
	unsent := redis.NewCmd(ctx, "evalsha")

	attribute(withProbe(ctx, &a), rt.shares, batch[0])
	attribute(withProbe(ctx, &a), rt.shares, alone)
	attribute(withProbe(ctx, &a), rt.shares, unsent)
	for _, c := range batch[1:] {
		attribute(withProbe(ctx, &b), rt.shares, c)
	}
	for _, tc := range []struct {
		name string
		p    *probe
		want cost
	}{
		{"a: one of 4 in a pipeline, then alone", &a, cost{requests: 2, share: shareUnit/4 + shareUnit}},
		{"b: three of 4 in a pipeline", &b, cost{requests: 3, share: 3 * shareUnit / 4}},
	} {
		if got := tc.p.cost(); got != tc.want {
			t.Errorf("%s: cost %+v; want %+v", tc.name, got, tc.want)
		}
	}
	if got := rt.n.Load(); got != 2 {
		t.Errorf("requests %d; want 2", got)
	}
	var left int
	rt.shares.Range(func(any, any) bool { left++; return true })
	if left != 0 {
		t.Errorf("%d commands left in shares; want 0", left)
	}

	var tally rttTally
	tally.add(a.cost())
	tally.add(b.cost())
	if got, want := tally.summary(), (rttSummary{N: 2, Mean: 1, Max: 3}); got != want {
		t.Errorf("summary %+v; want %+v", got, want)
	}
}

// Without shares, a client's requests count on the probe of the context
// they were made under: one each, a pipeline one in all.
func TestRoundTripsOnProbe(t *testing.T) {
	rt := new(roundTrips)
	var p probe
	ctx := withProbe(context.Background(), &p)
	rt.ProcessHook(func(context.Context, redis.Cmder) error { return nil })(ctx, redis.NewCmd(ctx, "set"))
	rt.ProcessPipelineHook(func(context.Context, []redis.Cmder) error { return nil })(ctx, []redis.Cmder{redis.NewCmd(ctx, "set"), redis.NewCmd(ctx, "expire")})
	rt.ProcessHook(func(context.Context, redis.Cmder) error { return nil })(ctx, redis.NewCmd(ctx, "hello"))
	if got, want := p.cost(), (cost{requests: 2, share: 2 * shareUnit}); got != want {
		t.Errorf("cost %+v; want %+v", got, want)
	}
	if rt.n.Load() != 2 || rt.setup.Load() != 1 {
		t.Errorf("requests %d, setup %d; want 2, 1", rt.n.Load(), rt.setup.Load())
	}
}
