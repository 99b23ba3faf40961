package redisstore_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// BenchmarkClaimComplete is a claim and a complete of a new key from
// 16 goroutines at once, on the real Redis, over the plain client, the
// batcher and go-redis's autopipeliner. Read it with -benchtime and the
// CPU figures of BENCHMARKS.md: wall time on a shared machine says little.
func BenchmarkClaimComplete(b *testing.B) {
	addr := testenv.RedisAddr(b)
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true, PoolSize: 32})
	b.Cleanup(func() { c.Close() })
	ap, err := c.AutoPipeline()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ap.Close() })
	clients := []struct {
		name string
		rc   redisstore.Client
	}{
		{"plain", c},
		{"batcher", redisstore.NewBatcher(c, redisstore.BatcherOptions{})},
		{"autopipeline", ap},
	}
	var seq atomic.Int64
	prefix := "rabbitmw-bench-" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	for _, cl := range clients {
		b.Run(cl.name, func(b *testing.B) {
			s := redisstore.New(cl.rc, redisstore.Options{Prefix: prefix})
			ctx := context.Background()
			if err := s.Load(ctx); err != nil {
				b.Fatal(err)
			}
			b.SetParallelism(8) // 16 goroutines on 2 cores, as the consumer's workers
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
		})
	}
}
