package otelmw

import (
	"context"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
)

// keyOutboxTable names the outbox table of the outbox metrics.
const keyOutboxTable = attribute.Key("rabbitmw.outbox.table")

// Outbox is the telemetry of a transactional outbox (package pgstore's
// Outbox) and of its relays. Make it with [Telemetry.Outbox], and wire it
// in three places, with plain functions, so that otelmw links no
// database driver:
//
//	ot := tel.Outbox("rabbitmw_outbox")
//	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Inject: ot.Inject})
//	b := broker.New(url, broker.Options{Observer: tel.Broker()})
//	r := relay.New(ob, b, relay.Options{Observer: relay.Observer{Extract: ot.Extract, Dispatched: ot.Dispatched}})
//	go ot.Watch(ctx, func(ctx context.Context) (otelmw.OutboxStats, error) {
//		s, err := ob.Stats(ctx)
//		return otelmw.OutboxStats{Pending: s.Pending, Parked: s.Parked, OldestPending: s.OldestPending}, err
//	}, 15*time.Second)
//
// Then the writer's trace context is stored with each row (Inject), the
// relay publishes each row under it (Extract), and the broker's publish
// hook makes the "send <destination>" span a child of the writer's span:
// the trace runs from the handler that wrote the message, through its
// send by the relay, to the consumer of the next service.
type Outbox struct {
	prop                 propagation.TextMapPropagator
	meter                metric.Meter
	sent, parked, failed metric.Int64Counter
	pending, parkedRows  metric.Int64ObservableGauge
	oldest               metric.Float64ObservableGauge
	attrs                metric.MeasurementOption
}

// Outbox returns the telemetry of the outbox table named table (its name
// is the rabbitmw.outbox.table attribute of the metrics). It panics if the
// meter cannot make its instruments. The metrics:
//
//   - rabbitmw.outbox.sent ({message}): rows the relays sent (confirmed);
//   - rabbitmw.outbox.parked ({message}): rows the relays parked (returned
//     by RabbitMQ, refused by closing the channel, or invalid);
//   - rabbitmw.outbox.send.failures ({message}): sends that ended without
//     a confirm (nacked, or none came), the row left pending;
//   - rabbitmw.outbox.pending and rabbitmw.outbox.parked.rows ({row}),
//     rabbitmw.outbox.oldest.age (s): gauges of the rows waiting, the rows
//     parked and the age of the oldest waiting row, from [Outbox.Watch].
func (t *Telemetry) Outbox(table string) *Outbox {
	o := &Outbox{prop: t.prop, meter: t.meter, attrs: metric.WithAttributes(keyOutboxTable.String(table))}
	var errs [6]error
	o.sent, errs[0] = t.meter.Int64Counter("rabbitmw.outbox.sent",
		metric.WithUnit("{message}"), metric.WithDescription("Outbox rows sent by the relays, confirmed by the broker."))
	o.parked, errs[1] = t.meter.Int64Counter("rabbitmw.outbox.parked",
		metric.WithUnit("{message}"), metric.WithDescription("Outbox rows parked by the relays: returned, invalid, or refused by closing the channel."))
	o.failed, errs[2] = t.meter.Int64Counter("rabbitmw.outbox.send.failures",
		metric.WithUnit("{message}"), metric.WithDescription("Outbox sends that ended without a confirm (nacked, or none came); the row stays pending."))
	o.pending, errs[3] = t.meter.Int64ObservableGauge("rabbitmw.outbox.pending",
		metric.WithUnit("{row}"), metric.WithDescription("Outbox rows waiting to be sent."))
	o.parkedRows, errs[4] = t.meter.Int64ObservableGauge("rabbitmw.outbox.parked.rows",
		metric.WithUnit("{row}"), metric.WithDescription("Outbox rows parked, waiting for an operator."))
	o.oldest, errs[5] = t.meter.Float64ObservableGauge("rabbitmw.outbox.oldest.age",
		metric.WithUnit("s"), metric.WithDescription("Age of the oldest outbox row waiting to be sent; 0 when none is."))
	for _, err := range errs {
		if err != nil {
			panic("otelmw: Outbox: " + err.Error())
		}
	}
	return o
}

// Inject writes the trace context of ctx into carrier by the Telemetry's
// propagator: it is the Inject of pgstore.OutboxOptions.
func (o *Outbox) Inject(ctx context.Context, carrier map[string]string) {
	o.prop.Inject(ctx, propagation.MapCarrier(carrier))
}

// Extract returns ctx with the trace context in carrier (the writer's,
// stored by Inject) as its parent: it is the Extract of the relay's
// Observer.
func (o *Outbox) Extract(ctx context.Context, carrier map[string]string) context.Context {
	return o.prop.Extract(ctx, propagation.MapCarrier(carrier))
}

// Dispatched counts one dispatch of a relay: it is the Dispatched of the
// relay's Observer.
func (o *Outbox) Dispatched(ctx context.Context, sent, parked, failed int) {
	if sent > 0 {
		o.sent.Add(ctx, int64(sent), o.attrs)
	}
	if parked > 0 {
		o.parked.Add(ctx, int64(parked), o.attrs)
	}
	if failed > 0 {
		o.failed.Add(ctx, int64(failed), o.attrs)
	}
}

// OutboxStats is what [Outbox.Watch] reports: pgstore.OutboxStats, less
// the sent rows.
type OutboxStats struct {
	Pending, Parked int64
	OldestPending   time.Duration
}

// Watch calls stats every interval (15 seconds if interval is 0 or less),
// until ctx is done, and reports its last answer as the gauges
// rabbitmw.outbox.pending, rabbitmw.outbox.parked.rows and
// rabbitmw.outbox.oldest.age; while stats fails, the gauges report
// nothing. It runs in the caller's goroutine (start it with go, cancel ctx
// to stop it), and returns nil when ctx is done, or at once the error of a
// meter that refuses the callback. Run it in one process per outbox: the
// gauges are the table's, not the process's.
func (o *Outbox) Watch(ctx context.Context, stats func(context.Context) (OutboxStats, error), interval time.Duration) error {
	if interval <= 0 {
		interval = 15 * time.Second
	}
	var (
		mu   sync.Mutex
		last OutboxStats
		ok   bool
	)
	reg, err := o.meter.RegisterCallback(func(_ context.Context, ob metric.Observer) error {
		mu.Lock()
		defer mu.Unlock()
		if ok {
			ob.ObserveInt64(o.pending, last.Pending, o.attrs)
			ob.ObserveInt64(o.parkedRows, last.Parked, o.attrs)
			ob.ObserveFloat64(o.oldest, last.OldestPending.Seconds(), o.attrs)
		}
		return nil
	}, o.pending, o.parkedRows, o.oldest)
	if err != nil {
		return err
	}
	defer reg.Unregister()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, interval)
		s, err := stats(pctx)
		cancel()
		mu.Lock()
		last, ok = s, err == nil
		mu.Unlock()
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
