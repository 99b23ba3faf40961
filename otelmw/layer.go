package otelmw

import (
	"context"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/errchain"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// Middleware returns the layer that traces and measures each delivery. Put
// it first in the chain (outermost), so that its span covers every other
// layer and its result is the one settled.
//
// For each delivery it extracts the creation context from the headers
// (through a [HeaderCarrier] and the propagator of [Options]) and starts a
// CONSUMER span, "process <queue>" at its start and renamed
// "process <destination>" once it records, where the destination is
// "{exchange}:{routing key}:{queue}" with empty parts omitted, and the
// routing key omitted on the default exchange, where it names the queue.
// The span is a child of the creation context, unless Options.NewRoot,
// and links to it either way. It has the messaging conventions'
// attributes (messaging.system, messaging.operation.name and .type,
// messaging.destination.name, messaging.rabbitmq.destination.routing_key,
// messaging.rabbitmq.message.delivery_tag, messaging.message.id,
// messaging.message.conversation_id from the CorrelationId,
// messaging.client.id from the ConsumerTag) and, from
// [rabbitmw.Decide] of the result: rabbitmw.outcome, rabbitmw.attempt
// (the number of this attempt), rabbitmw.retry.delay (seconds, for a
// delay) and rabbitmw.dead_letter.reason (the error's text, for a
// dead-letter). A result that is neither an ack nor a duplicate sets the
// status to Error, described by the error's text, and error.type (see
// [rabbitmw.ErrorType]). An error's text longer than 4 KiB is cut to its
// first 4 KiB, ending in "…", in the reason and the status, as in the
// broker's fault headers. The links and the attributes other than the
// span kind are added after the span started, which a sampler does not
// see: they cost nothing on a span that does not record. The handler runs with the span in its context, where
// [Telemetry.Dedup] finds it.
//
// Each delivery also counts in messaging.process.duration,
// messaging.client.consumed.messages (with rabbitmw.outcome and, for a
// failure, error.type), rabbitmw.handlers.active while it runs, and, when
// it is acked or dead-lettered, rabbitmw.message.attempts.
//
// A panic that goes through the layer ends the span with the status
// Error and error.type "panic", and goes on.
func (t *Telemetry) Middleware() rabbitmw.Middleware {
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		if next == nil {
			panic("otelmw: Middleware: nil handler")
		}
		return &layer{Telemetry: t, next: next}
	}
}

type layer struct {
	*Telemetry
	next rabbitmw.Handler
}

func (l *layer) Handle(ctx context.Context, d *amqp.Delivery) error {
	if d == nil {
		return l.next.Handle(ctx, d)
	}
	if ctx == nil {
		ctx = context.Background()
	}
	m := &l.m
	timed := m.duration.Enabled(ctx)
	var start time.Time
	if timed {
		start = time.Now()
	}
	pctx := l.prop.Extract(ctx, HeaderCarrier(d.Headers))
	hctx, span := l.tracer.Start(pctx, l.spanName, l.startOpts...)
	recording := span.IsRecording()
	if recording {
		l.describe(span, trace.SpanContextFromContext(pctx), d)
	}
	m.active.Add(ctx, 1, m.base.add...)
	finished := false
	defer func() {
		if !finished { // a panic: record it and let it go on
			m.active.Add(ctx, -1, m.base.add...)
			span.SetAttributes(semconv.ErrorTypeKey.String("panic"))
			span.SetStatus(codes.Error, "panic")
			span.End()
		}
	}()
	err := errchain.Safe(l.next.Handle(hctx, d))
	finished = true
	m.active.Add(ctx, -1, m.base.add...)

	dec := rabbitmw.Decide(err)
	var errType string
	if dec.Outcome != rabbitmw.Ack && dec.Outcome != rabbitmw.Duplicate {
		errType = rabbitmw.ErrorType(err)
	}
	attempt := dec.Attempts
	if attempt <= 0 {
		attempt = rabbitmw.PriorAttempts(d) + 1
	}
	if recording {
		l.result(span, dec, attempt, errType)
	}
	span.End()

	o := m.outcome(dec.Outcome, errType)
	if timed {
		m.duration.Record(ctx, time.Since(start).Seconds(), o.record...)
	}
	m.consumed.Add(ctx, 1, o.add...)
	if dec.Outcome == rabbitmw.Ack || dec.Outcome == rabbitmw.DeadLetter {
		m.attempts.Record(ctx, int64(attempt), m.byOutcome[dec.Outcome].record...)
	}
	return err
}

// describe sets the attributes and the link of a recording process span.
func (l *layer) describe(span trace.Span, creation trace.SpanContext, d *amqp.Delivery) {
	dest := destination(d.Exchange, d.RoutingKey, l.queue)
	if name := "process " + dest; dest != "" && name != l.spanName {
		span.SetName(name)
	}
	if creation.IsValid() {
		span.AddLink(trace.Link{SpanContext: creation})
	}
	span.SetAttributes(
		semconv.MessagingSystemRabbitMQ,
		semconv.MessagingOperationName("process"),
		semconv.MessagingOperationTypeProcess,
		semconv.MessagingRabbitMQMessageDeliveryTag(int(d.DeliveryTag)),
	)
	if dest != "" {
		span.SetAttributes(semconv.MessagingDestinationName(dest))
	}
	if d.RoutingKey != "" {
		span.SetAttributes(semconv.MessagingRabbitMQDestinationRoutingKey(d.RoutingKey))
	}
	if d.MessageId != "" {
		span.SetAttributes(semconv.MessagingMessageID(d.MessageId))
	}
	if d.CorrelationId != "" {
		span.SetAttributes(semconv.MessagingMessageConversationID(d.CorrelationId))
	}
	if d.ConsumerTag != "" {
		span.SetAttributes(semconv.MessagingClientID(d.ConsumerTag))
	}
}

// result records dec on a recording process span.
func (l *layer) result(span trace.Span, dec rabbitmw.Decision, attempt int, errType string) {
	span.SetAttributes(keyOutcome.String(dec.Outcome.String()), keyAttempt.Int(attempt))
	switch dec.Outcome {
	case rabbitmw.Delay:
		span.SetAttributes(keyRetryDelay.Float64(dec.Delay.Seconds()))
	case rabbitmw.DeadLetter:
		span.SetAttributes(keyReason.String(text.Capped(dec.Err)))
	}
	if errType != "" {
		span.SetAttributes(semconv.ErrorTypeKey.String(errType))
		span.SetStatus(codes.Error, text.Capped(dec.Err))
	}
}

// destination is the messaging.destination.name of a delivery from queue:
// "{exchange}:{routing key}:{queue}" with empty parts omitted, and the
// routing key omitted on the default exchange, where it is a queue's name.
func destination(exchange, key, queue string) string {
	if exchange == "" {
		key = ""
	}
	s := exchange
	for _, p := range [...]string{key, queue} {
		switch {
		case p == "":
		case s == "":
			s = p
		default:
			s += ":" + p
		}
	}
	return s
}
