// Package redistest starts miniredis servers for tests and counts the round
// trips a client makes to them.
package redistest

import (
	"context"
	"net"
	"sync/atomic"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Start starts a miniredis whose TTLs run on the wall clock, as a real
// server's do, and returns it with a client that counts its round trips.
// Both are closed when t ends.
func Start(t testing.TB) (*miniredis.Miniredis, *redis.Client, *RoundTrips) {
	t.Helper()
	m := miniredis.RunT(t)
	m.ClockTTL(true)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	rt := new(RoundTrips)
	c.AddHook(rt)
	t.Cleanup(func() { c.Close() })
	return m, c, rt
}

// RoundTrips is a redis.Hook that counts the requests a client sends: one
// per command, and one per pipeline however many commands it holds. (The
// server's own command count is no measure of round trips: it also counts
// the commands a Lua script runs.)
type RoundTrips struct{ n atomic.Int64 }

// Count returns the round trips so far.
func (r *RoundTrips) Count() int64 { return r.n.Load() }

// DialHook implements redis.Hook.
func (r *RoundTrips) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		return next(ctx, network, addr)
	}
}

// ProcessHook implements redis.Hook.
func (r *RoundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		r.n.Add(1)
		return next(ctx, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (r *RoundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		r.n.Add(1)
		return next(ctx, cmds)
	}
}
