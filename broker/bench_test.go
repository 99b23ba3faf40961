package broker

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
)

// BenchmarkConsume measures Consume's throughput with a handler that does
// nothing: b.N messages are published, then consumed and acked.
func BenchmarkConsume(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			br, q, top := benchQueue(b, be)
			ctx := context.Background()
			for i := range b.N {
				require.NoError(b, br.Publish(ctx, "", q, amqp.Publishing{MessageId: fmt.Sprint(i), Body: make([]byte, 128)}))
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
			require.NoError(b, br.Consume(cctx, q, h, ConsumeOptions{Topology: top}))
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "msgs/s")
		})
	}
}

// BenchmarkPublish measures confirmed publishes from concurrent goroutines
// sharing one Broker.
func BenchmarkPublish(b *testing.B) {
	for _, be := range backends {
		b.Run(be.name, func(b *testing.B) {
			br, q, _ := benchQueue(b, be)
			ctx := context.Background()
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

// benchQueue opens a Broker on be and declares a fresh queue with one
// delay tier; both go when b ends.
func benchQueue(b *testing.B, be backend) (*Broker, string, Topology) {
	br, _ := be.open(b, Options{})
	q := fmt.Sprintf("rabbitmw-bench-%d", time.Now().UnixNano())
	top := Topology{Delays: []time.Duration{time.Second}}
	require.NoError(b, br.Declare(context.Background(), q, top))
	b.Cleanup(func() { br.Delete(context.Background(), q, top) })
	return br, q, top
}
