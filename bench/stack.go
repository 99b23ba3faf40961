package main

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// A stackCase is one in-process measurement of a stack's cost per delivery.
type stackCase struct {
	Name    string    `json:"name"`
	Ns      float64   `json:"ns_per_op"` // median of the runs
	Allocs  int64     `json:"allocs_per_op"`
	Bytes   int64     `json:"bytes_per_op"`
	Samples []float64 `json:"samples_ns"`
}

// stackCost is the in-process cost of the recommended stack per delivery:
// the loops of BenchmarkChain/memory in the root package, run with
// testing.Benchmark three times each. The first two cases are the target's;
// the others say where the time goes: without the Timeout layer, and over a
// store that does nothing (no map, no clock).
type stackCost struct {
	Cases []stackCase `json:"cases"`
}

const (
	stackNew       = "memory, new message"
	stackDuplicate = "memory, duplicate"
)

func measureStack() stackCost {
	cases := []struct {
		name  string
		stack func(store.Store) rabbitmw.Middleware
		store func() store.Store
		dup   bool
	}{
		{stackNew, recommended, memoryStore, false},
		{stackDuplicate, recommended, memoryStore, true},
		{"memory, new message, no Timeout layer", withoutTimeout, memoryStore, false},
		{"no-op store, new message", recommended, func() store.Store { return nopStore{} }, false},
		{"no-op store, new message, no Timeout layer", withoutTimeout, func() store.Store { return nopStore{} }, false},
	}
	var sc stackCost
	results := make([][]testing.BenchmarkResult, len(cases))
	for range 3 {
		for i, c := range cases {
			results[i] = append(results[i], testing.Benchmark(func(b *testing.B) {
				benchStack(b, c.stack(c.store()), c.dup)
			}))
		}
	}
	for i, c := range cases {
		rs := results[i]
		slices.SortFunc(rs, func(a, b testing.BenchmarkResult) int { return int(a.NsPerOp() - b.NsPerOp()) })
		sample := stackCase{Name: c.name}
		for _, r := range rs {
			sample.Samples = append(sample.Samples, nsPerOp(r))
		}
		m := rs[len(rs)/2]
		sample.Ns, sample.Allocs, sample.Bytes = nsPerOp(m), m.AllocsPerOp(), m.AllocedBytesPerOp()
		sc.Cases = append(sc.Cases, sample)
	}
	return sc
}

func (sc *stackCost) find(name string) *stackCase {
	for i := range sc.Cases {
		if sc.Cases[i].Name == name {
			return &sc.Cases[i]
		}
	}
	return nil
}

func nsPerOp(r testing.BenchmarkResult) float64 {
	if r.N == 0 {
		return 0
	}
	return float64(r.T.Nanoseconds()) / float64(r.N)
}

func memoryStore() store.Store { return store.NewMemory() }

// withoutTimeout is the recommended stack without its Timeout layer.
func withoutTimeout(st store.Store) rabbitmw.Middleware {
	return rabbitmw.Chain(
		middleware.Log(slog.New(slog.DiscardHandler)),
		middleware.Retry(st, middleware.RetryOptions{}),
		middleware.Recover(),
		middleware.Dedup(st, middleware.DedupOptions{}),
	)
}

var nop = rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })

// benchStack runs h once per b.N: with a new message id each time (claim,
// handler, complete), or the same id, done before the timer starts (claim
// only), as BenchmarkChain does.
func benchStack(b *testing.B, stack rabbitmw.Middleware, dup bool) {
	h := stack(nop)
	d := &amqp.Delivery{MessageId: "dup", Body: []byte(`{"order":42}`)}
	ctx := context.Background()
	want := rabbitmw.Ack
	var ids []string
	if dup {
		h.Handle(ctx, d)
		want = rabbitmw.Duplicate
	} else {
		ids = make([]string, b.N)
		for i := range ids {
			ids[i] = "m" + strconv.Itoa(i)
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if !dup {
			d.MessageId = ids[i]
		}
		if err := h.Handle(ctx, d); rabbitmw.Decide(err).Outcome != want {
			b.Fatal(err)
		}
	}
}

// nopStore is a store that claims every key and does nothing else: the
// stack over it costs only the layers.
type nopStore struct{}

func (nopStore) Claim(context.Context, string, string, time.Duration) (store.Status, error) {
	return store.Claimed, nil
}
func (nopStore) Extend(context.Context, string, string, time.Duration) error   { return nil }
func (nopStore) Complete(context.Context, string, string, time.Duration) error { return nil }
func (nopStore) Release(context.Context, string, string) error                 { return nil }
func (nopStore) Fail(context.Context, string, time.Duration) (int64, error)    { return 1, nil }
func (nopStore) ResetFailures(context.Context, string) error                   { return nil }
