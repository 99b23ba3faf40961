package main

import (
	"context"
	"errors"
	"reflect"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/store/redisstore"
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

// Every command the Redis store sends for a delivery is counted on the
// delivery's probe: attributed overrides each method of redisstore.Client
// but the script loading (done once, at start). A method it lacks would be
// promoted from the embedded client, and its requests counted nowhere (as
// the claim's SET once was).
func TestAttributedCountsEveryCommand(t *testing.T) {
	rt := &roundTrips{shares: new(sync.Map)}
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	defer c.Close()
	c.AddHook(rt)
	c.AddHook(refuse{}) // inside rt: nothing is dialled or sent
	a := reflect.ValueOf(attributed{Client: c, shares: rt.shares})
	methods := reflect.TypeFor[redisstore.Client]()
	for i := range methods.NumMethod() {
		m := methods.Method(i)
		if m.Name == "ScriptLoad" || m.Name == "ScriptExists" {
			continue
		}
		var p probe
		fn := a.MethodByName(m.Name)
		args := make([]reflect.Value, fn.Type().NumIn())
		args[0] = reflect.ValueOf(withProbe(context.Background(), &p))
		for j := 1; j < len(args); j++ {
			args[j] = reflect.Zero(fn.Type().In(j))
		}
		if fn.Type().IsVariadic() {
			fn.CallSlice(args)
		} else {
			fn.Call(args)
		}
		if got := p.cost().requests; got != 1 {
			t.Errorf("attributed.%s counted %d requests on its delivery; want 1", m.Name, got)
		}
	}
}

// refuse is a hook that answers every command with an error, sending
// nothing.
type refuse struct{}

var errRefused = errors.New("refused by the test")

func (refuse) DialHook(next redis.DialHook) redis.DialHook { return next }

func (refuse) ProcessHook(redis.ProcessHook) redis.ProcessHook {
	return func(_ context.Context, cmd redis.Cmder) error { cmd.SetErr(errRefused); return errRefused }
}

func (refuse) ProcessPipelineHook(redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(context.Context, []redis.Cmder) error { return errRefused }
}
