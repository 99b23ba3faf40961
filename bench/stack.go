package main

import (
	"slices"
	"testing"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/benchstack"
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
// benchstack.Run, the loop of BenchmarkChain in package e2e, run with
// testing.Benchmark three times each. The targets judge the new message
// over the memory store (stackNew) and over a store that does nothing, no
// map, no clock (stackNopNew); the others say where the time goes: a
// duplicate, and without the Timeout layer.
type stackCost struct {
	Cases []stackCase `json:"cases"`
}

const (
	stackNew       = "memory, new message"
	stackDuplicate = "memory, duplicate"
	stackNopNew    = "no-op store, new message"
)

func measureStack() stackCost {
	cases := []struct {
		name  string
		stack func(store.Store) rabbitmw.Middleware
		store func() store.Store
		dup   bool
	}{
		{stackNew, benchstack.Recommended, memoryStore, false},
		{stackDuplicate, benchstack.Recommended, memoryStore, true},
		{"memory, new message, no Timeout layer", benchstack.WithoutTimeout, memoryStore, false},
		{stackNopNew, benchstack.Recommended, nopStore, false},
		{"no-op store, new message, no Timeout layer", benchstack.WithoutTimeout, nopStore, false},
	}
	var sc stackCost
	results := make([][]testing.BenchmarkResult, len(cases))
	for range 3 {
		for i, c := range cases {
			results[i] = append(results[i], testing.Benchmark(func(b *testing.B) {
				benchstack.Run(b, c.stack(c.store()), c.dup)
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

func nopStore() store.Store { return benchstack.NopStore{} }
