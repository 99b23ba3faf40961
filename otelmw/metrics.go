package otelmw

import (
	"errors"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// Attributes of rabbitmw's own, beside the messaging conventions'.
const (
	keyOutcome      = attribute.Key("rabbitmw.outcome")
	keyAttempt      = attribute.Key("rabbitmw.attempt")
	keyRetryDelay   = attribute.Key("rabbitmw.retry.delay")
	keyReason       = attribute.Key("rabbitmw.dead_letter.reason")
	keyDedupResult  = attribute.Key("rabbitmw.dedup.result")
	keyDedupKey     = attribute.Key("rabbitmw.dedup.key")
	keyDelayQueue   = attribute.Key("rabbitmw.delay.queue")
	keyNode         = attribute.Key("rabbitmw.node") // host:port/vhost
	maxOutcome      = int(rabbitmw.DeadLetter)
	maxDedupKind    = int(middleware.DedupRejected)
	maxCachedErrors = 256 // error.type values given attribute sets of their own
)

// instruments are the metrics of a Telemetry, with the measurement
// options of their common attribute sets made once, so that recording a
// delivery allocates nothing.
type instruments struct {
	duration   metric.Float64Histogram // messaging.process.duration
	consumed   metric.Int64Counter     // messaging.client.consumed.messages
	sent       metric.Int64Counter     // messaging.client.sent.messages
	active     metric.Int64UpDownCounter
	attempts   metric.Int64Histogram
	dedup      metric.Int64Counter
	renewals   metric.Int64Counter
	leasesLost metric.Int64Counter
	deadLetter metric.Int64Counter
	republish  metric.Int64Counter
	reconnects metric.Int64Counter
	pubChans   metric.Int64Counter
	depth      metric.Int64ObservableGauge   // see Telemetry.WatchQueues
	oldest     metric.Float64ObservableGauge // see Telemetry.WatchQueues

	consumer  attribute.Set
	base      measure                   // consumer, for the handlers in flight
	byOutcome [maxOutcome + 1]measure   // consumer + outcome
	byDedup   [maxDedupKind + 1]measure // consumer + dedup result
	failures  sync.Map                  // failureKey -> *measure
	nFailures int64                     // entries in failures, approximately
	failMu    sync.Mutex
}

// measure is one attribute set as the options of each kind of call.
type measure struct {
	add    []metric.AddOption
	record []metric.RecordOption
}

func newMeasure(s attribute.Set) measure {
	o := metric.WithAttributeSet(s)
	return measure{add: []metric.AddOption{o}, record: []metric.RecordOption{o}}
}

type failureKey struct {
	outcome rabbitmw.Outcome
	errType string
}

func (m *instruments) init(meter metric.Meter, consumer attribute.Set) error {
	var errs [14]error
	m.duration, errs[0] = meter.Float64Histogram("messaging.process.duration",
		metric.WithUnit("s"), metric.WithDescription("Duration of processing operation."),
		metric.WithExplicitBucketBoundaries(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10))
	m.consumed, errs[1] = meter.Int64Counter("messaging.client.consumed.messages",
		metric.WithUnit("{message}"), metric.WithDescription("Number of messages that were delivered to the application."))
	m.sent, errs[2] = meter.Int64Counter("messaging.client.sent.messages",
		metric.WithUnit("{message}"), metric.WithDescription("Number of messages producer attempted to send to the broker."))
	m.active, errs[3] = meter.Int64UpDownCounter("rabbitmw.handlers.active",
		metric.WithUnit("{handler}"), metric.WithDescription("Number of deliveries being handled."))
	m.attempts, errs[4] = meter.Int64Histogram("rabbitmw.message.attempts",
		metric.WithUnit("{attempt}"), metric.WithDescription("Attempts a message took, counted when it was acked or dead-lettered."),
		metric.WithExplicitBucketBoundaries(1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30))
	m.dedup, errs[5] = meter.Int64Counter("rabbitmw.dedup.results",
		metric.WithUnit("{delivery}"), metric.WithDescription("Dedup's answers: claimed, duplicate, busy, unavailable or abandoned."))
	m.renewals, errs[6] = meter.Int64Counter("rabbitmw.dedup.lease.renewals",
		metric.WithUnit("{renewal}"), metric.WithDescription("Leases renewed while their handler ran."))
	m.leasesLost, errs[7] = meter.Int64Counter("rabbitmw.dedup.leases.lost",
		metric.WithUnit("{lease}"), metric.WithDescription("Claims lost before a handler's success was recorded."))
	m.deadLetter, errs[8] = meter.Int64Counter("rabbitmw.dead_letters",
		metric.WithUnit("{message}"), metric.WithDescription("Messages the broker dead-lettered, by error type."))
	m.republish, errs[9] = meter.Int64Counter("rabbitmw.delay.republishes",
		metric.WithUnit("{message}"), metric.WithDescription("Copies the broker sent to a delay queue."))
	m.reconnects, errs[10] = meter.Int64Counter("rabbitmw.reconnects",
		metric.WithUnit("{connection}"), metric.WithDescription("Connections lost or not made, each followed by another attempt."))
	m.depth, errs[11] = meter.Int64ObservableGauge("rabbitmw.queue.depth",
		metric.WithUnit("{message}"), metric.WithDescription("Messages ready in a work, delay or dead-letter queue."))
	m.oldest, errs[12] = meter.Float64ObservableGauge("rabbitmw.dead_letter.oldest.age",
		metric.WithUnit("s"), metric.WithDescription("Time since the oldest message of a dead-letter queue was dead-lettered."))
	m.pubChans, errs[13] = meter.Int64Counter("rabbitmw.publish_channel.replacements",
		metric.WithUnit("{channel}"), metric.WithDescription("Publish channels replaced after the server nacked publishes on them, or replacements that failed."))
	if err := errors.Join(errs[:]...); err != nil {
		return err
	}
	m.consumer = consumer
	m.base = newMeasure(consumer)
	for o := rabbitmw.Ack; int(o) <= maxOutcome; o++ {
		m.byOutcome[o] = newMeasure(with(consumer, keyOutcome.String(o.String())))
	}
	for k := middleware.DedupClaimed; int(k) <= maxDedupKind; k++ {
		m.byDedup[k] = newMeasure(with(consumer, keyDedupResult.String(k.String())))
	}
	return nil
}

// with returns s with kv added.
func with(s attribute.Set, kv ...attribute.KeyValue) attribute.Set {
	return attribute.NewSet(append(s.ToSlice(), kv...)...)
}

// outcome returns the measure of a delivery that settled as o, failed with
// an error of type errType ("" if it did not fail).
func (m *instruments) outcome(o rabbitmw.Outcome, errType string) *measure {
	if o < rabbitmw.Ack || int(o) > maxOutcome {
		o = rabbitmw.Requeue
	}
	if errType == "" {
		return &m.byOutcome[o]
	}
	k := failureKey{o, errType}
	if v, ok := m.failures.Load(k); ok {
		return v.(*measure)
	}
	mm := newMeasure(with(m.consumer, keyOutcome.String(o.String()), semconv.ErrorTypeKey.String(errType)))
	m.failMu.Lock()
	defer m.failMu.Unlock()
	if m.nFailures >= maxCachedErrors {
		// An error type per message (a bug in a caller's error, or a
		// type made at run time) must not grow the cache without bound.
		return &mm
	}
	v, loaded := m.failures.LoadOrStore(k, &mm)
	if !loaded {
		m.nFailures++
	}
	return v.(*measure)
}
