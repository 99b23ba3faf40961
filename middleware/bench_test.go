package middleware_test

import (
	"context"
	"io"
	"log/slog"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

var nop = rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })

// watching is a handler that looks at its context's Done, as one that
// does I/O does, and does nothing else.
var watching = rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	default:
		return nil
	}
})

// benchLayer runs h over b.N deliveries, each with a new message id unless
// sameID, under a context that never ends.
func benchLayer(b *testing.B, h rabbitmw.Handler, sameID bool) {
	b.Helper()
	benchUnder(b, context.Background(), h, sameID)
}

// benchUnder is benchLayer under the consumer's context ctx.
func benchUnder(b *testing.B, ctx context.Context, h rabbitmw.Handler, sameID bool) {
	b.Helper()
	ids := make([]string, b.N)
	for i := range ids {
		ids[i] = "m" + strconv.Itoa(i)
		if sameID {
			ids[i] = "same"
		}
	}
	d := &amqp.Delivery{Body: []byte(`{"order":42}`), DeliveryTag: 1}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		d.MessageId = ids[i]
		h.Handle(ctx, d)
	}
}

// Each layer alone, in front of a handler that does nothing.
func BenchmarkLayer(b *testing.B) {
	b.Run("Recover", func(b *testing.B) { benchLayer(b, middleware.Recover()(nop), false) })
	b.Run("Timeout", func(b *testing.B) { benchLayer(b, middleware.Timeout(time.Minute)(nop), false) })
	b.Run("Log/discard", func(b *testing.B) {
		benchLayer(b, middleware.Log(slog.New(slog.DiscardHandler))(nop), false)
	})
	b.Run("Log/json", func(b *testing.B) {
		benchLayer(b, middleware.Log(slog.New(slog.NewJSONHandler(io.Discard, nil)))(nop), false)
	})
	b.Run("Log/json/options", func(b *testing.B) {
		opts := middleware.LogOptions{
			DuplicateLevel: slog.LevelDebug,
			AppendAttrs: func(attrs []slog.Attr, d *amqp.Delivery) []slog.Attr {
				return append(attrs, slog.String("tenant", "acme"))
			},
		}
		benchLayer(b, middleware.LogWith(slog.New(slog.NewJSONHandler(io.Discard, nil)), opts)(nop), false)
	})
	b.Run("Retry/success", func(b *testing.B) {
		benchLayer(b, middleware.Retry(store.NewMemory(), middleware.RetryOptions{})(nop), false)
	})
	b.Run("Retry/failure/memory", func(b *testing.B) {
		fail := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return errBoom })
		benchLayer(b, middleware.Retry(store.NewMemory(), middleware.RetryOptions{MaxAttempts: 1 << 30})(fail), false)
	})
	b.Run("Retry/failure/miniredis", func(b *testing.B) {
		_, c, _ := redistest.Start(b)
		fail := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return errBoom })
		benchLayer(b, middleware.Retry(redisstore.New(c, redisstore.Options{}), middleware.RetryOptions{MaxAttempts: 1 << 30})(fail), false)
	})
	b.Run("Dedup/new/memory", func(b *testing.B) {
		benchLayer(b, middleware.Dedup(store.NewMemory(), middleware.DedupOptions{})(nop), false)
	})
	b.Run("Dedup/new/memory/consumer", func(b *testing.B) {
		// Under a consumer's context that can end, as package broker's,
		// which Dedup then watches, for a handler that watches its own.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		benchUnder(b, ctx, middleware.Dedup(store.NewMemory(), middleware.DedupOptions{})(watching), false)
	})
	b.Run("Dedup/new/memory/own-consumer", func(b *testing.B) {
		// Under a consumer's context that the context package does not
		// know, which takes a goroutine to watch.
		ctx := newOwnDone(context.Background())
		defer ctx.cancel()
		benchUnder(b, ctx, middleware.Dedup(store.NewMemory(), middleware.DedupOptions{})(watching), false)
	})
	b.Run("Stack/new/memory/consumer", func(b *testing.B) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		st := store.NewMemory()
		benchUnder(b, ctx, middleware.Stack(st, middleware.StackOptions{})(watching), false)
	})
	b.Run("Dedup/duplicate/memory", func(b *testing.B) {
		benchLayer(b, middleware.Dedup(store.NewMemory(), middleware.DedupOptions{})(nop), true)
	})
	b.Run("Dedup/new/miniredis", func(b *testing.B) {
		_, c, _ := redistest.Start(b)
		benchLayer(b, middleware.Dedup(redisstore.New(c, redisstore.Options{}), middleware.DedupOptions{})(nop), false)
	})
	b.Run("Dedup/duplicate/miniredis", func(b *testing.B) {
		_, c, _ := redistest.Start(b)
		benchLayer(b, middleware.Dedup(redisstore.New(c, redisstore.Options{}), middleware.DedupOptions{})(nop), true)
	})
}
