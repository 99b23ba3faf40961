package otelmw_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sort"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/otelmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// One Telemetry wired in its three places: the broker (publish spans and
// the consumers' events), the chain (one span per attempt) and the Dedup
// layer (its answers as span events). A message published twice is
// handled once; its trace holds the send span and both attempts.
func Example() {
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	defer tp.Shutdown(context.Background())
	reader := sdkmetric.NewManualReader() // in production: a periodic reader and an exporter
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())

	tel := otelmw.New(otelmw.Options{
		Queue:          "orders",
		TracerProvider: tp,
		MeterProvider:  mp,
		Propagator:     propagation.TraceContext{},
	})
	srv := brokertest.NewServer() // in production: RabbitMQ
	defer srv.Close()
	b := broker.New(srv.URL(), broker.Options{Observer: tel.Broker()}) // 1: the broker
	defer b.Close()
	chain := rabbitmw.Chain(
		tel.Middleware(), // 2: outermost in the chain
		middleware.Stack(store.NewMemory(), middleware.StackOptions{Dedup: middleware.DedupOptions{Observe: tel.Dedup()}}), // 3: Dedup's observer
	)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if err := b.Declare(ctx, "orders", broker.Topology{}); err != nil {
		log.Fatal(err)
	}
	for range 2 { // the same message twice: a publisher's retry
		if err := b.Publish(ctx, "", "orders", amqp.Publishing{MessageId: "order-1"}); err != nil {
			log.Fatal(err)
		}
	}
	h := chain(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		fmt.Println("handled", d.MessageId)
		return nil
	}))
	deliveries := 0
	stopAfterTwo := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		err := h.Handle(ctx, d)
		if deliveries++; deliveries == 2 {
			cancel() // stop consuming; this delivery is still settled
		}
		return err
	})
	if err := b.Consume(ctx, "orders", stopAfterTwo, broker.ConsumeOptions{Workers: 1}); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
	tp.ForceFlush(context.Background())

	var names []string
	for _, s := range spans.Ended() {
		var evs []string
		for _, e := range s.Events() {
			evs = append(evs, e.Name)
		}
		names = append(names, fmt.Sprint(s.Name(), " ", evs))
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Println(n)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		log.Fatal(err)
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name == "rabbitmw.dedup.results" {
				for _, p := range m.Data.(metricdata.Sum[int64]).DataPoints {
					v, _ := p.Attributes.Value("rabbitmw.dedup.result")
					fmt.Println(m.Name, v.AsString(), p.Value)
				}
			}
		}
	}
	// Unordered output:
	// handled order-1
	// process orders [rabbitmw.dedup.claimed]
	// process orders [rabbitmw.dedup.duplicate]
	// send orders []
	// send orders []
	// rabbitmw.dedup.results claimed 1
	// rabbitmw.dedup.results duplicate 1
}
