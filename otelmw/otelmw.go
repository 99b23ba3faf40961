package otelmw

import (
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// scope names the tracer and the meter.
const scope = "github.com/rabbitmw/rabbitmw/otelmw"

// Options configures [New]. The zero value selects the defaults.
type Options struct {
	// TracerProvider makes the tracer. Default: otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
	// MeterProvider makes the meter. Default: otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// Propagator extracts the creation context from each delivery's
	// headers and injects it into each publish's. Default:
	// otel.GetTextMapPropagator(), which propagates nothing until one is
	// set (otel.SetTextMapPropagator with propagation.TraceContext and
	// propagation.Baggage, for W3C trace context).
	Propagator propagation.TextMapPropagator
	// Queue is the queue the instrumented chain consumes. An amqp.Delivery
	// does not name it, and it is the last part of the consumer spans'
	// messaging.destination.name, the destination of the consumer
	// metrics, and the span names ("process <queue>").
	Queue string
	// NewRoot makes each process span the root of a trace of its own,
	// linked to the creation context, instead of its child (and linked
	// to it). The messaging conventions allow both for a span that
	// processes one message: the child keeps the producer and every
	// attempt in one trace, which is what most trace viewers show best;
	// a new root keeps traces small when one message fans out into much
	// work, or when a publisher's trace should not grow for hours with
	// the retries of its messages.
	NewRoot bool
}

// Telemetry makes the spans and metrics of the consumers of one queue and
// of publishers: a layer for the chain ([Telemetry.Middleware]), observers
// for the Dedup layer ([Telemetry.Dedup]) and the broker
// ([Telemetry.Broker]), and helpers for plain channels
// ([Telemetry.StartPublish], [Telemetry.Inject]). It is safe for
// concurrent use.
type Telemetry struct {
	tracer    trace.Tracer
	meter     metric.Meter
	prop      propagation.TextMapPropagator
	queue     string
	spanName  string                  // "process <queue>"
	startOpts []trace.SpanStartOption // of the process span
	consumer  attribute.Set           // the attributes of every consumer metric
	m         instruments
}

// New returns the Telemetry of opts. It panics if the meter cannot make
// its instruments.
func New(opts Options) *Telemetry {
	tp, mp, prop := opts.TracerProvider, opts.MeterProvider, opts.Propagator
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if prop == nil {
		prop = otel.GetTextMapPropagator()
	}
	t := &Telemetry{
		tracer:    tp.Tracer(scope),
		prop:      prop,
		queue:     opts.Queue,
		spanName:  "process",
		startOpts: []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindConsumer)},
	}
	if opts.Queue != "" {
		t.spanName += " " + opts.Queue
	}
	if opts.NewRoot {
		t.startOpts = append(t.startOpts, trace.WithNewRoot())
	}
	attrs := []attribute.KeyValue{semconv.MessagingSystemRabbitMQ, semconv.MessagingOperationName("process")}
	if opts.Queue != "" {
		attrs = append(attrs, semconv.MessagingDestinationName(opts.Queue))
	}
	t.consumer = attribute.NewSet(attrs...)
	t.meter = mp.Meter(scope)
	if err := t.m.init(t.meter, t.consumer); err != nil {
		panic("otelmw: New: " + err.Error())
	}
	return t
}
