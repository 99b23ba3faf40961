package redisstore_test

import (
	"context"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// BenchmarkClaimComplete is a claim and a complete of a new key from
// 16 goroutines at once, on the real Redis, over the plain client
// (NoBatching), the batcher (New's default) and go-redis's autopipeliner. Read it with -benchtime and the
// CPU figures of BENCHMARKS.md: wall time on a shared machine says little.
// It reports the CPU the Redis server spent per pair (redis-µs/op, from
// INFO cpu: exact only on a Redis that serves nothing else, REDIS_ADDR),
// the CPU of this process per pair (client-µs/op, from getrusage, on
// Linux: the store's, the batcher's and go-redis's share of a consumer's
// CPU) and
// the requests sent per pair (trips/op).
func BenchmarkClaimComplete(b *testing.B) {
	addr := testenv.RedisAddr(b)
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, PoolSize: 32})
	b.Cleanup(func() { c.Close() })
	rt := new(redistest.RoundTrips)
	c.AddHook(rt)
	prefix := "rabbitmw-bench-" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	ap, err := c.AutoPipeline()
	require.NoError(b, err)
	b.Cleanup(func() { ap.Close() })
	clients := []struct {
		name string
		rc   redisstore.Client
		opts redisstore.Options
	}{
		{"plain", c, redisstore.Options{Prefix: prefix, NoBatching: true}},
		{"batcher", c, redisstore.Options{Prefix: prefix}},
		{"autopipeline", ap, redisstore.Options{Prefix: prefix}},
	}
	var seq atomic.Int64
	for _, cl := range clients {
		b.Run(cl.name, func(b *testing.B) {
			s := redisstore.New(cl.rc, cl.opts)
			ctx := context.Background()
			require.NoError(b, s.Load(ctx))
			b.SetParallelism(8) // 16 goroutines on 2 cores, as the consumer's workers
			cpu, trips, self := redisCPU(b, c), rt.Count(), selfCPU()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					key := strconv.FormatInt(seq.Add(1), 10)
					if _, err := s.Claim(ctx, key, "tok", time.Minute); err != nil {
						b.Error(err)
						return
					}
					if err := s.Complete(ctx, key, "tok", 10*time.Second); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			if self >= 0 {
				b.ReportMetric(float64(selfCPU()-self)/float64(time.Microsecond)/float64(b.N), "client-µs/op")
			}
			trips = rt.Count() - trips
			b.ReportMetric(float64(redisCPU(b, c)-cpu)/float64(time.Microsecond)/float64(b.N), "redis-µs/op")
			b.ReportMetric(float64(trips)/float64(b.N), "trips/op")
		})
	}
}

// redisCPU returns the CPU time, user and system, that the Redis server
// behind c has used since it started.
func redisCPU(b *testing.B, c *redis.Client) time.Duration {
	b.Helper()
	info, err := c.Info(context.Background(), "cpu").Result()
	require.NoError(b, err)
	var total time.Duration
	for line := range strings.Lines(info) {
		name, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || (name != "used_cpu_user" && name != "used_cpu_sys") {
			continue
		}
		sec, err := strconv.ParseFloat(v, 64)
		require.NoError(b, err, "INFO cpu %s", name)
		total += time.Duration(sec * float64(time.Second))
	}
	return total
}
