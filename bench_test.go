package rabbitmw_test

import (
	"context"
	"log/slog"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// recommended is the stack of the README, with a logger whose level
// discards per-delivery records (production logs at Info cost what the
// slog handler costs, which is not this package's to measure).
func recommended(st store.Store) rabbitmw.Middleware {
	return rabbitmw.Chain(
		middleware.Log(slog.New(slog.DiscardHandler)),
		middleware.Retry(st, middleware.RetryOptions{}),
		middleware.Recover(),
		middleware.Dedup(st, middleware.DedupOptions{}),
		middleware.Timeout(30*time.Second),
	)
}

var nop = rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })

// BenchmarkChain measures the whole recommended stack per delivery, on the
// happy path (a new message id each time: claim, handler, complete) and for
// a duplicate (claim only), over each store.
func BenchmarkChain(b *testing.B) {
	stores := []struct {
		name string
		new  func(b *testing.B) store.Store
	}{
		{"memory", func(*testing.B) store.Store { return store.NewMemory() }},
		{"miniredis", func(b *testing.B) store.Store {
			_, c, _ := redistest.Start(b)
			return store.NewRedis(c, store.RedisOptions{})
		}},
	}
	for _, s := range stores {
		b.Run(s.name+"/new", func(b *testing.B) {
			h := recommended(s.new(b))(nop)
			ids := make([]string, b.N)
			for i := range ids {
				ids[i] = "m" + strconv.Itoa(i)
			}
			d := &amqp.Delivery{Body: []byte(`{"order":42}`)}
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				d.MessageId = ids[i]
				if err := h.Handle(ctx, d); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(s.name+"/duplicate", func(b *testing.B) {
			h := recommended(s.new(b))(nop)
			d := &amqp.Delivery{MessageId: "dup", Body: []byte(`{"order":42}`)}
			ctx := context.Background()
			h.Handle(ctx, d)
			b.ReportAllocs()
			b.ResetTimer()
			for range b.N {
				if err := h.Handle(ctx, d); rabbitmw.Decide(err).Outcome != rabbitmw.Duplicate {
					b.Fatal(err)
				}
			}
		})
	}
}
