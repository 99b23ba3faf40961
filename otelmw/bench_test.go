package otelmw_test

import (
	"context"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/benchstack"
	"github.com/rabbitmw/rabbitmw/otelmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// telemetries are the setups the layer is measured over.
var telemetries = []struct {
	name string
	opts func(b *testing.B) otelmw.Options
}{
	// Tracing and metrics off: the API's no-op providers, and a
	// propagator that propagates nothing (the default until one is set).
	{"noop", func(*testing.B) otelmw.Options {
		return otelmw.Options{
			TracerProvider: tracenoop.NewTracerProvider(),
			MeterProvider:  metricnoop.NewMeterProvider(),
			Propagator:     propagation.NewCompositeTextMapPropagator(),
		}
	}},
	// The SDK with a sampler that drops every span, and its metrics into
	// a reader that is never read.
	{"sdk-drop", func(b *testing.B) otelmw.Options {
		tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.NeverSample()))
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
		b.Cleanup(func() {
			tp.Shutdown(context.Background())
			mp.Shutdown(context.Background())
		})
		return otelmw.Options{TracerProvider: tp, MeterProvider: mp, Propagator: w3c, Queue: "q"}
	}},
}

// BenchmarkChain is package e2e's BenchmarkChain over the memory
// store (the recommended stack, a new message each time or a duplicate),
// with the otelmw layer in front and without it ("off").
func BenchmarkChain(b *testing.B) {
	for _, kind := range []struct {
		name string
		dup  bool
	}{{"new", false}, {"duplicate", true}} {
		b.Run("off/"+kind.name, func(b *testing.B) {
			benchstack.Run(b, benchstack.Recommended(store.NewMemory()), kind.dup)
		})
		for _, tm := range telemetries {
			b.Run(tm.name+"/"+kind.name, func(b *testing.B) {
				tel := otelmw.New(tm.opts(b))
				stack := rabbitmw.Chain(tel.Middleware(), benchstack.Recommended(store.NewMemory()))
				benchstack.Run(b, stack, kind.dup)
			})
		}
	}
}

// BenchmarkLayer is the layer alone, in front of a handler that does
// nothing, for a delivery without trace context and for one with a W3C
// traceparent (which the "noop" setup does not read; "noop-w3c" does), and
// over the global providers of a program that never set them.
func BenchmarkLayer(b *testing.B) {
	nop := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	setups := append(telemetries, struct {
		name string
		opts func(b *testing.B) otelmw.Options
	}{"noop-w3c", func(*testing.B) otelmw.Options {
		return otelmw.Options{TracerProvider: tracenoop.NewTracerProvider(), MeterProvider: metricnoop.NewMeterProvider(), Propagator: w3c}
	}}, struct {
		name string
		opts func(b *testing.B) otelmw.Options
	}{"global-unset", func(*testing.B) otelmw.Options {
		return otelmw.Options{} // the global providers, never set
	}})
	for _, tm := range setups {
		for _, hdr := range []struct {
			name    string
			headers amqp.Table
		}{{"plain", nil}, {"traceparent", amqp.Table{"traceparent": traceparent}}} {
			b.Run(tm.name+"/"+hdr.name, func(b *testing.B) {
				h := otelmw.New(tm.opts(b)).Middleware()(nop)
				d := &amqp.Delivery{MessageId: "m", Headers: hdr.headers, RoutingKey: "q"}
				ctx := context.Background()
				b.ReportAllocs()
				benchstack.OnCPU(b, func() {
					for b.Loop() {
						h.Handle(ctx, d)
					}
				})
			})
		}
	}
}
