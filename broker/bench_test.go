package broker

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// BenchmarkConsume measures Consume's throughput with a handler that does
// nothing: b.N messages are published, then consumed and acked.
func BenchmarkConsume(b *testing.B) {
	for _, be := range []string{"memory", "rabbitmq"} {
		b.Run(be, func(b *testing.B) {
			var br *Broker
			if be == "memory" {
				m := NewMemory()
				defer m.Close()
				br = m.Broker(Options{})
			} else {
				br = New(testenv.RabbitMQURL(b), Options{})
			}
			defer br.Close()
			ctx := context.Background()
			q := fmt.Sprintf("rabbitmw-bench-%d", time.Now().UnixNano())
			top := Topology{Delays: []time.Duration{time.Second}}
			if err := br.Declare(ctx, q, top); err != nil {
				b.Fatal(err)
			}
			defer br.Delete(ctx, q, top)
			for i := range b.N {
				if err := br.Publish(ctx, "", q, amqp.Publishing{MessageId: fmt.Sprint(i), Body: make([]byte, 128)}); err != nil {
					b.Fatal(err)
				}
			}
			var n atomic.Int64
			cctx, cancel := context.WithCancel(ctx)
			h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
				if n.Add(1) == int64(b.N) {
					cancel()
				}
				return nil
			})
			b.ResetTimer()
			if err := br.Consume(cctx, q, h, ConsumeOptions{Topology: top}); err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
		})
	}
}

// BenchmarkPublish measures confirmed publishes from concurrent goroutines
// sharing one Broker.
func BenchmarkPublish(b *testing.B) {
	for _, be := range []string{"memory", "rabbitmq"} {
		b.Run(be, func(b *testing.B) {
			var br *Broker
			if be == "memory" {
				m := NewMemory()
				defer m.Close()
				br = m.Broker(Options{})
			} else {
				br = New(testenv.RabbitMQURL(b), Options{})
			}
			defer br.Close()
			ctx := context.Background()
			q := fmt.Sprintf("rabbitmw-bench-%d", time.Now().UnixNano())
			top := Topology{Delays: []time.Duration{time.Second}}
			if err := br.Declare(ctx, q, top); err != nil {
				b.Fatal(err)
			}
			defer br.Delete(ctx, q, top)
			b.SetParallelism(8)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if err := br.Publish(ctx, "", q, amqp.Publishing{Body: make([]byte, 128)}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
		})
	}
}
