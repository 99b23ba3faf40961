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
	Name string  `json:"name"`
	Ns   float64 `json:"ns_per_op"` // median of the runs
	// CPUNs is the CPU time of the benchmark's thread per delivery, in
	// the run of the median: unlike Ns, it leaves out the time spent
	// waiting for a core, and the garbage collector's background work.
	CPUNs   float64   `json:"cpu_ns_per_op"`
	Allocs  int64     `json:"allocs_per_op"`
	Bytes   int64     `json:"bytes_per_op"`
	Samples []float64 `json:"samples_ns"`
	Load    string    `json:"load"` // the load averages when it was measured
}

// stackCost is the in-process cost of the recommended stack per delivery:
// benchstack.Run and RunWaiting, the loops of BenchmarkChain in package
// e2e, run with testing.Benchmark three times each. The target judges the
// new message over the memory store in front of a handler that waits on
// its context, as any handler doing I/O does (stackWaitsNew); the others
// say where the time goes: the same handler under a context like a
// consumer's of package broker, a handler that never looks at its
// context, a duplicate, a store that does nothing.
type stackCost struct {
	Cases []stackCase `json:"cases"`
}

const (
	stackWaitsNew  = "memory, new message, handler waits on its context"
	stackConsumer  = "memory, new message, waits, under a consumer's context"
	stackNew       = "memory, new message, handler ignores its context"
	stackDuplicate = "memory, duplicate"
	stackNopNew    = "no-op store, new message, handler waits on its context"
)

func measureStack() stackCost {
	cases := []struct {
		name  string
		store func() store.Store
		run   func(*testing.B, rabbitmw.Middleware)
	}{
		{stackWaitsNew, memoryStore, benchstack.RunWaiting},
		{stackConsumer, memoryStore, benchstack.RunWaitingInConsumer},
		{stackNew, memoryStore, func(b *testing.B, m rabbitmw.Middleware) { benchstack.Run(b, m, false) }},
		{stackDuplicate, memoryStore, func(b *testing.B, m rabbitmw.Middleware) { benchstack.Run(b, m, true) }},
		{stackNopNew, nopStore, benchstack.RunWaiting},
	}
	var sc stackCost
	load := loadAverage()
	results := make([][]testing.BenchmarkResult, len(cases))
	for range 3 {
		for i, c := range cases {
			results[i] = append(results[i], testing.Benchmark(func(b *testing.B) {
				c.run(b, benchstack.Recommended(c.store()))
			}))
		}
	}
	for i, c := range cases {
		rs := results[i]
		slices.SortFunc(rs, func(a, b testing.BenchmarkResult) int { return int(a.NsPerOp() - b.NsPerOp()) })
		sample := stackCase{Name: c.name, Load: load}
		for _, r := range rs {
			sample.Samples = append(sample.Samples, nsPerOp(r))
		}
		m := rs[len(rs)/2]
		sample.Ns, sample.Allocs, sample.Bytes = nsPerOp(m), m.AllocsPerOp(), m.AllocedBytesPerOp()
		sample.CPUNs = m.Extra["cpu-ns/op"]
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
