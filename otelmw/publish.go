package otelmw

import (
	"context"
	"maps"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/rabbitmw/rabbitmw"
)

// StartPublish starts the PRODUCER span "send <destination>" of a publish
// of msg to exchange with routing key key, child of the span in ctx,
// injects its context into msg.Headers, and returns the func to call with
// the result of the publish, which ends the span and counts the message in
// messaging.client.sent.messages (with error.type if err is not nil). The
// destination is "{exchange}:{routing key}", or the routing key alone on
// the default exchange, where it names the queue.
//
// StartPublish replaces msg.Headers with a copy holding the trace context,
// so that a table shared with other messages is not written to. It is the
// publish hook of [Telemetry.Broker]; call it yourself around a publish on
// a plain amqp091 channel.
func (t *Telemetry) StartPublish(ctx context.Context, exchange, key string, msg *amqp.Publishing) func(error) {
	if ctx == nil {
		ctx = context.Background()
	}
	dest := key // the default exchange routes to the queue named key
	if exchange != "" {
		dest = destination(exchange, key, "")
	}
	name := "send"
	if dest != "" {
		name += " " + dest
	}
	attrs := []attribute.KeyValue{
		semconv.MessagingSystemRabbitMQ,
		semconv.MessagingOperationName("send"),
		semconv.MessagingOperationTypeSend,
	}
	if dest != "" {
		attrs = append(attrs, semconv.MessagingDestinationName(dest))
	}
	if key != "" {
		attrs = append(attrs, semconv.MessagingRabbitMQDestinationRoutingKey(key))
	}
	if msg.MessageId != "" {
		attrs = append(attrs, semconv.MessagingMessageID(msg.MessageId))
	}
	if msg.CorrelationId != "" {
		attrs = append(attrs, semconv.MessagingMessageConversationID(msg.CorrelationId))
	}
	ctx, span := t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(attrs...))
	t.Inject(ctx, msg)
	metricAttrs := attrs[:0:0]
	metricAttrs = append(metricAttrs, attrs[0], attrs[1])
	if dest != "" {
		metricAttrs = append(metricAttrs, semconv.MessagingDestinationName(dest))
	}
	return func(err error) {
		if err != nil {
			typ := semconv.ErrorTypeKey.String(rabbitmw.ErrorType(err))
			span.SetAttributes(typ)
			span.SetStatus(codes.Error, err.Error())
			metricAttrs = append(metricAttrs, typ)
		}
		span.End()
		t.m.sent.Add(ctx, 1, metric.WithAttributes(metricAttrs...))
	}
}

// Inject writes the trace context of ctx (the span in it, and its
// baggage) into msg.Headers by the propagator of [Options], replacing
// msg.Headers with a copy that holds it, so that a table shared with other
// messages is not written to. It is for publishing on a plain amqp091
// channel; [Telemetry.StartPublish] calls it, and makes a span.
func (t *Telemetry) Inject(ctx context.Context, msg *amqp.Publishing) {
	h := make(amqp.Table, len(msg.Headers)+3)
	maps.Copy(h, msg.Headers)
	t.prop.Inject(ctx, HeaderCarrier(h))
	msg.Headers = h
}
