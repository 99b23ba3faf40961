package otelmw

import (
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/rabbitmw/rabbitmw/broker"
)

// keyQueueRole is the role of a queue in its work queue's topology:
// "work", "delay" or "dead_letter".
const keyQueueRole = attribute.Key("rabbitmw.queue.role")

// QueueOptions configures [Telemetry.WatchQueues]. The zero value selects
// the defaults.
type QueueOptions struct {
	// Topology names the delay and dead-letter queues of the work queue
	// (Options.Queue), as the consumers' broker.ConsumeOptions.Topology
	// does: give it the same value. Its QuorumSupport says that the
	// dead-letter queue is a quorum queue, whose head is not peeked (see
	// WatchQueues).
	Topology broker.Topology
	// Interval is the time between two polls of the queues. Default 15
	// seconds. Each poll is one passive declare per queue, and one
	// basic.get of the dead-letter queue's head when it is not empty.
	Interval time.Duration
}

// WatchQueues polls the queues of the work queue that Options.Queue names
// every QueueOptions.Interval, until ctx is done, and reports what the
// last poll found as two observable gauges, read whenever the meter
// provider's reader collects:
//
//   - rabbitmw.queue.depth ({message}): the messages ready in the work
//     queue, each delay queue and the dead-letter queue, by
//     messaging.destination.name and rabbitmw.queue.role ("work",
//     "delay", "dead_letter");
//   - rabbitmw.dead_letter.oldest.age (s): how long ago the message at the
//     head of the dead-letter queue, the oldest, was dead-lettered (its
//     broker.HeaderFailedAt, else the latest time of its x-death); 0 when
//     the dead-letter queue is empty.
//
// A queue that does not exist, or that the last poll could not read, is
// left out until a poll reads it. To read the head's time, the poll takes
// the message with basic.get and returns it at once with basic.nack and
// requeue, which puts it back at the head: for that instant, a reader of
// the dead-letter queue (a dlq ls or replay) does not see it, and the
// message is marked redelivered. Messages that are being delivered and
// not yet settled are not counted (broker.Broker.Len).
//
// A quorum queue counts each such return as a delivery of the message
// (RabbitMQ before 4.3 counts a basic.nack too), and drops it, or
// dead-letters it, once the count passes the queue's delivery limit,
// which RabbitMQ 4.0 and later set to 20 unless told otherwise: a peek
// every poll would drop the oldest dead letter within minutes. So the
// head of a quorum dead-letter queue is never peeked: not when
// QueueOptions.Topology has QuorumSupport, and not after the first peek
// that finds the message's x-delivery-count header (a dead-letter queue
// declared as a quorum queue elsewhere; that peek counts once). The age
// of its oldest is then reported only when the queue is empty (0).
//
// WatchQueues runs in the caller's goroutine (start it with go, and cancel
// ctx to stop it); it uses b's shared connection, and returns nil when ctx
// is done, or at once an error if Options.Queue is empty, the topology is
// not valid, or the meter refuses the callback.
func (t *Telemetry) WatchQueues(ctx context.Context, b *broker.Broker, opts QueueOptions) error {
	if t.queue == "" {
		return errors.New("otelmw: WatchQueues: Options.Queue names no queue")
	}
	names, err := opts.Topology.Queues(t.queue)
	if err != nil {
		return err
	}
	interval := opts.Interval
	if interval <= 0 {
		interval = 15 * time.Second
	}
	w := newQueueWatch(names, opts.Topology.QuorumSupport)
	reg, err := t.meter.RegisterCallback(w.observe(t.m.depth, t.m.oldest), t.m.depth, t.m.oldest)
	if err != nil {
		return err
	}
	defer reg.Unregister()
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		pctx, cancel := context.WithTimeout(ctx, interval)
		w.poll(pctx, b)
		cancel()
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// watchedQueue is one queue of a topology and what the last poll found.
type watchedQueue struct {
	name  string
	attrs metric.MeasurementOption
	depth int
	ok    bool // depth was read by the last poll
}

// A queueWatch holds the last poll's findings for the callback.
type queueWatch struct {
	mu       sync.Mutex
	queues   []watchedQueue // the work queue, the delay queues, the dead-letter queue (last)
	oldestAt time.Time      // dead-lettering time of the DLQ's head; zero if empty or unknown
	ageAttrs metric.MeasurementOption

	// counting is set when the dead-letter queue counts the returns of
	// its messages, as a quorum queue does: its head is then not peeked.
	// Only poll reads and writes it.
	counting bool
}

func newQueueWatch(names broker.Queues, quorum bool) *queueWatch {
	w := &queueWatch{counting: quorum}
	add := func(name, role string) {
		w.queues = append(w.queues, watchedQueue{name: name, attrs: metric.WithAttributes(
			semconv.MessagingSystemRabbitMQ, semconv.MessagingDestinationName(name), keyQueueRole.String(role))})
	}
	add(names.Work, "work")
	for _, q := range names.Delays {
		add(q, "delay")
	}
	add(names.DeadLetter, "dead_letter")
	w.ageAttrs = metric.WithAttributes(semconv.MessagingSystemRabbitMQ, semconv.MessagingDestinationName(names.DeadLetter))
	return w
}

// poll reads every queue's depth, and the time of the dead-letter queue's
// head.
func (w *queueWatch) poll(ctx context.Context, b *broker.Broker) {
	depths := make([]int, len(w.queues))
	oks := make([]bool, len(w.queues))
	for i, q := range w.queues {
		n, err := b.Len(ctx, q.name)
		depths[i], oks[i] = n, err == nil
	}
	dlq := len(w.queues) - 1
	var oldest time.Time
	ageKnown := oks[dlq]
	switch {
	case !oks[dlq] || depths[dlq] == 0:
	case w.counting:
		ageKnown = false
	default:
		oldest, ageKnown, w.counting = peekFailedAt(ctx, b, w.queues[dlq].name)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for i := range w.queues {
		w.queues[i].depth, w.queues[i].ok = depths[i], oks[i]
	}
	if ageKnown {
		w.oldestAt = oldest
	} else {
		w.oldestAt = time.Time{}
	}
}

// peekFailedAt returns when the message at the head of queue was
// dead-lettered, and puts it back. ok is false if that could not be read;
// a zero time with ok means the queue was empty. counting reports that the
// message carries x-delivery-count: the queue counts its returns (a
// quorum queue), this one included.
func peekFailedAt(ctx context.Context, b *broker.Broker, queue string) (at time.Time, ok, counting bool) {
	d, got, err := b.Get(ctx, queue)
	if err != nil {
		return time.Time{}, false, false
	}
	if !got {
		return time.Time{}, true, false
	}
	at = deadLetteredAt(d)
	_, counting = d.Headers["x-delivery-count"]
	// Should the nack fail, the message returns to the queue when the
	// connection ends.
	_ = d.Nack(false, true)
	return at, !at.IsZero(), counting
}

// deadLetteredAt returns when d was dead-lettered: its HeaderFailedAt,
// written by the broker, else the latest time of its x-death records,
// written by RabbitMQ; zero if it has neither.
func deadLetteredAt(d *amqp.Delivery) time.Time {
	if t, ok := d.Headers[broker.HeaderFailedAt].(time.Time); ok {
		return t
	}
	var times []time.Time
	if deaths, ok := d.Headers["x-death"].([]any); ok {
		for _, r := range deaths {
			if rec, ok := r.(amqp.Table); ok {
				if t, ok := rec["time"].(time.Time); ok {
					times = append(times, t)
				}
			}
		}
	}
	if len(times) == 0 {
		return time.Time{}
	}
	return slices.MaxFunc(times, time.Time.Compare)
}

// observe returns the callback that reports the last poll.
func (w *queueWatch) observe(depth metric.Int64ObservableGauge, oldest metric.Float64ObservableGauge) metric.Callback {
	return func(_ context.Context, o metric.Observer) error {
		w.mu.Lock()
		defer w.mu.Unlock()
		for _, q := range w.queues {
			if q.ok {
				o.ObserveInt64(depth, int64(q.depth), q.attrs)
			}
		}
		dlq := w.queues[len(w.queues)-1]
		switch {
		case !dlq.ok:
		case dlq.depth == 0:
			o.ObserveFloat64(oldest, 0, w.ageAttrs)
		case !w.oldestAt.IsZero():
			o.ObserveFloat64(oldest, max(0, time.Since(w.oldestAt).Seconds()), w.ageAttrs)
		}
		return nil
	}
}
