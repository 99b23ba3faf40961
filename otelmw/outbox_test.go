package otelmw_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"

	"github.com/rabbitmw/rabbitmw/otelmw"
)

// The writer's span context goes into the row (Inject) and comes back at
// the relay (Extract): the relay's send is a child of the writer's span.
func TestOutboxTraceRunsFromWriterToSend(t *testing.T) {
	r := newRig(t, otelmw.Options{Queue: "orders"})
	ot := r.tel.Outbox("rabbitmw_outbox")
	ctx, writer := r.tp.Tracer("test").Start(context.Background(), "process orders")
	carrier := map[string]string{}
	ot.Inject(ctx, carrier)
	writer.End()
	require.NotEmpty(t, carrier["traceparent"], "the trace context stored with the row")

	// The relay, later, in another process.
	rctx := ot.Extract(context.Background(), carrier)
	msg := amqp.Publishing{MessageId: "m1"}
	r.tel.StartPublish(rctx, "", "shipments", &msg)(nil)

	sends := r.ended("send shipments")
	require.Len(t, sends, 1)
	assert.Equal(t, writer.SpanContext().TraceID(), sends[0].SpanContext().TraceID())
	assert.Equal(t, writer.SpanContext().SpanID(), sends[0].Parent().SpanID(), "the send's parent is the writer's span")
}

func TestOutboxMetrics(t *testing.T) {
	r := newRig(t, otelmw.Options{})
	ot := r.tel.Outbox("shop.outbox")
	table := attribute.String("rabbitmw.outbox.table", "shop.outbox")
	ot.Dispatched(context.Background(), 5, 2, 0)
	ot.Dispatched(context.Background(), 1, 0, 3)
	rm := r.metrics(t)
	assert.Equal(t, int64(6), count(rm, "rabbitmw.outbox.sent", table))
	assert.Equal(t, int64(2), count(rm, "rabbitmw.outbox.parked", table))
	assert.Equal(t, int64(3), count(rm, "rabbitmw.outbox.send.failures", table))

	ctx, cancel := context.WithCancel(context.Background())
	polled := make(chan struct{})
	calls := 0
	done := make(chan error, 1)
	go func() {
		done <- ot.Watch(ctx, func(context.Context) (otelmw.OutboxStats, error) {
			calls++
			if calls == 1 {
				polled <- struct{}{}
				return otelmw.OutboxStats{Pending: 7, Parked: 1, OldestPending: 1500 * time.Millisecond}, nil
			}
			if calls == 2 {
				polled <- struct{}{}
				<-ctx.Done() // the first answer stands while the test reads it
			}
			return otelmw.OutboxStats{}, errors.New("database down")
		}, time.Millisecond)
	}()
	<-polled // the first poll, answered
	<-polled // the second has begun: the first's answer is recorded, and stays
	rm = r.metrics(t)
	pending, ok := gauge[int64](rm, "rabbitmw.outbox.pending", table)
	assert.True(t, ok)
	assert.Equal(t, int64(7), pending)
	parked, _ := gauge[int64](rm, "rabbitmw.outbox.parked.rows", table)
	assert.Equal(t, int64(1), parked)
	age, _ := gauge[float64](rm, "rabbitmw.outbox.oldest.age", table)
	assert.Equal(t, 1.5, age)

	cancel()
	require.NoError(t, <-done)
	rm = r.metrics(t)
	_, ok = gauge[int64](rm, "rabbitmw.outbox.pending", table)
	assert.False(t, ok, "once Watch returned, the gauges report nothing")
}
