package broker

import (
	"context"
	"fmt"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
)

// ConsumeOptions configures one Consume call. The zero value selects the
// defaults noted on each field.
type ConsumeOptions struct {
	// Workers is the number of handlers run at once, counting those still
	// running on a connection that was lost (see Reconnection in the
	// package documentation). Default 16. For a rate r of messages per
	// second and a handler that takes t seconds, give it at least r×t
	// workers; more workers cost latency. Over the Redis store more
	// workers also cost less CPU per message, since more store calls
	// share each pipeline (BENCHMARKS.md §6: about a quarter less of the
	// process's and Redis's at 64); over the PostgreSQL inbox they cost
	// PostgreSQL more per message.
	Workers int
	// Prefetch is the QoS prefetch count: how many unsettled deliveries
	// the server may hand this consumer at once. Default 2*Workers, at
	// most 65535. A prefetch below Workers leaves workers idle while they
	// wait for their next delivery; a larger one keeps more messages from
	// the queue's other consumers, and puts as many in redelivery when a
	// consumer dies. Acks are coalesced in the part beyond Workers (see
	// Acks in the package documentation): at or below Workers, they are
	// sent as they come.
	Prefetch int
	// Topology describes the queues that serve the work queue.
	Topology Topology
	// ShutdownTimeout is how long handlers in flight may run after the
	// context of Consume is cancelled (see Shutdown in the package
	// documentation). Default 30s.
	ShutdownTimeout time.Duration
	// ConsumerTag names the consumer on the server. Default: a unique tag
	// made of "rabbitmw", the process name and random digits.
	ConsumerTag string
	// OnSettle, if set, is called after each delivery was settled, with
	// what was done and the error of doing it (nil when the server took
	// it; for Ack and Duplicate, nil when the ack is handed to the
	// connection, which coalesces it with others: see Acks in the package
	// documentation). A delivery given back unhandled at shutdown is
	// reported as Requeue. It runs on the worker that settled the
	// delivery, so it must be quick and safe for concurrent use: it is
	// meant for metrics. It must not settle d.
	OnSettle func(d *amqp.Delivery, o rabbitmw.Outcome, err error)
}

const (
	// defaultWorkers and the default prefetch (2*Workers) were chosen
	// again from a prefetch × workers sweep against a plain consumer
	// (BENCHMARKS.md §6, 2026-12-02): 64 workers cut the CPU per message
	// of a consumer over Redis, in its process and in Redis, by about a
	// quarter, and cost the PostgreSQL inbox a third more of
	// PostgreSQL's CPU per message on the same 2-core machine, with no
	// clear gain in either's ratio to a plain consumer. A default serves
	// both; 16 stays.
	defaultWorkers         = 16
	defaultShutdownTimeout = 30 * time.Second
)

var consumerSeq atomic.Uint64

// Consume consumes queue with manual acknowledgements, runs h for each
// delivery on opts.Workers goroutines, and settles each delivery, once, as
// the package documentation's table says for the outcome that
// [rabbitmw.Decide] gives h's result. It declares the topology first
// (opts.Topology), then consumes, and connects again whenever its
// connection is lost.
//
// h sees each delivery as it was first delivered, on every attempt and
// after a replay: its exchange, routing key, UserId, Expiration and
// DeliveryMode as published, though a retry comes back from a delay queue
// through the default exchange, and every copy keeps those properties in
// headers (see the package documentation, Settlement).
//
// Consume blocks until ctx is cancelled, and then shuts down gracefully
// and returns nil, or until a fatal error. The package documentation says
// how it acks, what it does when a copy fails, how it reconnects and shuts
// down, and which errors are fatal.
//
// Consume panics if h is nil.
func (b *Broker) Consume(ctx context.Context, queue string, h rabbitmw.Handler, opts ConsumeOptions) error {
	if h == nil {
		panic("broker: Consume: nil handler")
	}
	top, err := opts.Topology.resolve(queue)
	if err != nil {
		return err
	}
	c := &consumer{
		b:        b,
		h:        h,
		top:      top,
		workers:  opts.Workers,
		prefetch: opts.Prefetch,
		timeout:  opts.ShutdownTimeout,
		tag:      opts.ConsumerTag,
		onSettle: opts.OnSettle,
		log:      b.cfg.log.With(slog.String("queue", queue)),
	}
	switch {
	case c.workers < 0:
		return fmt.Errorf("broker: ConsumeOptions.Workers %d is negative", c.workers)
	case c.prefetch < 0 || c.prefetch > 65535:
		return fmt.Errorf("broker: ConsumeOptions.Prefetch %d is not in [0, 65535]", c.prefetch)
	case c.timeout < 0:
		return fmt.Errorf("broker: ConsumeOptions.ShutdownTimeout %v is negative", c.timeout)
	}
	if c.workers == 0 {
		c.workers = defaultWorkers
	}
	if c.prefetch == 0 {
		c.prefetch = min(2*c.workers, 65535)
	}
	if c.timeout == 0 {
		c.timeout = defaultShutdownTimeout
	}
	if c.tag == "" {
		c.tag = "rabbitmw-" + b.cfg.process + "-" + strconv.FormatUint(consumerSeq.Add(1), 10) + "-" + newMessageID()[:8]
	}
	c.slots = make(chan struct{}, c.workers)
	return c.run(ctx)
}
