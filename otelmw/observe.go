package otelmw

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// Dedup returns the observer to give the Dedup layer, as
// DedupOptions.Observe. Each of Dedup's events becomes an event of the
// span in the delivery's context (the one [Telemetry.Middleware] started),
// named "rabbitmw.dedup.<kind>" (claimed, duplicate, busy, unavailable,
// abandoned, rejected, lease_renewed, lease_lost) with the key as rabbitmw.dedup.key, and counts
// in rabbitmw.dedup.results (the answers, by rabbitmw.dedup.result),
// rabbitmw.dedup.lease.renewals or rabbitmw.dedup.leases.lost.
func (t *Telemetry) Dedup() func(context.Context, middleware.DedupEvent) {
	return t.dedupEvent
}

func (t *Telemetry) dedupEvent(ctx context.Context, e middleware.DedupEvent) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.AddEvent("rabbitmw.dedup."+e.Kind.String(), trace.WithAttributes(keyDedupKey.String(e.Key)))
	}
	m := &t.m
	switch e.Kind {
	case middleware.DedupLeaseRenewed:
		m.renewals.Add(ctx, 1, m.base.add...)
	case middleware.DedupLeaseLost:
		m.leasesLost.Add(ctx, 1, m.base.add...)
	default:
		if e.Kind >= middleware.DedupClaimed && int(e.Kind) <= maxDedupKind {
			m.dedup.Add(ctx, 1, m.byDedup[e.Kind].add...)
		}
	}
}

// Broker returns the observer to give the broker, as broker.Options.Observer:
// [Telemetry.StartPublish] for each Publish, and for the consumers'
// copies and connections the metrics rabbitmw.delay.republishes (by
// rabbitmw.delay.queue, with error.type when the copy was not
// published), rabbitmw.dead_letters (by error.type, the HeaderErrorType
// of the copy), rabbitmw.reconnects (by messaging.destination.name,
// the queue of the consumer; absent for the shared connection) and
// rabbitmw.publish_channel.replacements (by rabbitmw.node, host:port/vhost,
// with error.type when no new channel could be opened).
func (t *Telemetry) Broker() broker.Observer {
	return broker.Observer{
		Publish:        t.StartPublish,
		Republish:      t.republished,
		Reconnect:      t.reconnected,
		PublishChannel: t.publishChannel,
	}
}

func (t *Telemetry) republished(ctx context.Context, e broker.RepublishEvent) {
	attrs := queueAttrs(e.Queue)
	switch {
	case e.Outcome == rabbitmw.Delay:
		attrs = append(attrs, keyDelayQueue.String(e.To))
		if e.Err != nil {
			attrs = append(attrs, semconv.ErrorTypeKey.String(rabbitmw.ErrorType(e.Err)))
		}
		t.m.republish.Add(ctx, 1, metric.WithAttributes(attrs...))
	case e.Outcome == rabbitmw.DeadLetter && e.Err == nil:
		attrs = append(attrs, semconv.ErrorTypeKey.String(e.ErrorType))
		t.m.deadLetter.Add(ctx, 1, metric.WithAttributes(attrs...))
	}
}

func (t *Telemetry) reconnected(e broker.ReconnectEvent) {
	t.m.reconnects.Add(context.Background(), 1, metric.WithAttributes(queueAttrs(e.Queue)...))
}

func (t *Telemetry) publishChannel(e broker.PublishChannelEvent) {
	attrs := []attribute.KeyValue{semconv.MessagingSystemRabbitMQ, keyNode.String(e.Node)}
	if e.Err != nil {
		attrs = append(attrs, semconv.ErrorTypeKey.String(rabbitmw.ErrorType(e.Err)))
	}
	t.m.pubChans.Add(context.Background(), 1, metric.WithAttributes(attrs...))
}

// queueAttrs returns the attributes of an event of the consumer of queue,
// or of the shared connection if queue is empty.
func queueAttrs(queue string) []attribute.KeyValue {
	attrs := make([]attribute.KeyValue, 1, 4)
	attrs[0] = semconv.MessagingSystemRabbitMQ
	if queue != "" {
		attrs = append(attrs, semconv.MessagingDestinationName(queue))
	}
	return attrs
}
