package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"runtime/debug"
	"strconv"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
)

// ConsumeOptions configures one Consume call. The zero value selects the
// defaults noted on each field.
type ConsumeOptions struct {
	// Workers is the number of handlers run at once. Default 16. In the
	// prefetch × workers sweep of BENCHMARKS.md (a handler that does no
	// work, the Redis store, 2 cores), 64 workers made 26 % more messages
	// per second than 16, at four times the latency. For a rate r of
	// messages per second and a handler that takes t seconds, give it at
	// least r×t workers.
	Workers int
	// Prefetch is the QoS prefetch count: how many unsettled deliveries
	// the server may hand this consumer at once. Default 2*Workers, at
	// most 65535. In the sweep of BENCHMARKS.md, a prefetch of 1*Workers
	// is slower with few workers (a worker that acks waits for its next
	// delivery), and 4 or 8 times Workers gained 10 to 16 % over 2 times
	// with a handler that does nothing (2 to 10 % on an earlier machine),
	// while it keeps 2 to 4 times as many messages from the queue's other
	// consumers, and as many in redelivery when a consumer dies.
	Prefetch int
	// Topology describes the queues that serve the work queue.
	Topology Topology
	// ShutdownTimeout is how long handlers in flight may run after the
	// context of Consume is cancelled. Default 30s.
	ShutdownTimeout time.Duration
	// ConsumerTag names the consumer on the server. Default: a unique tag
	// made of "rabbitmw", the process name and random digits.
	ConsumerTag string
	// OnSettle, if set, is called after each delivery was settled, with
	// what was done and the error of doing it (nil when the server took
	// it). A delivery given back unhandled at shutdown is reported as
	// Requeue. It runs on the worker that settled the delivery, so it must
	// be quick and safe for concurrent use: it is meant for metrics. It
	// must not settle d.
	OnSettle func(d *amqp.Delivery, o rabbitmw.Outcome, err error)
}

const (
	// defaultWorkers and the default prefetch (2*Workers) are chosen from
	// the sweep in BENCHMARKS.md (go run ./bench -sweep).
	defaultWorkers         = 16
	defaultShutdownTimeout = 30 * time.Second
	// shutdownGrace is how long Consume waits, after the shutdown deadline
	// cancelled the handlers' context, for them to return and be settled.
	shutdownGrace = time.Second
	// settleTimeout bounds the publish of a delayed or dead-lettered copy,
	// confirm included.
	settleTimeout = 30 * time.Second
	// requeueBackoff is the pause before a delivery whose copy could not be
	// published is requeued, so that a failing publish is never a hot loop.
	requeueBackoff = time.Second
	// stableSession is how long a session must have lasted for the
	// reconnection backoff to start again from its minimum.
	stableSession = time.Second
)

var consumerSeq atomic.Uint64

// Consume consumes queue with manual acknowledgements, runs h for each
// delivery on opts.Workers goroutines, and settles each delivery, once,
// from [rabbitmw.Decide] of h's result:
//
//   - Ack, Duplicate: basic.ack.
//   - Requeue: basic.nack with requeue.
//   - Delay(d): a copy goes to the delay queue for d (see [Topology]); the
//     original is acked once the server confirmed the copy.
//   - DeadLetter: a copy with fault headers goes to the dead-letter queue;
//     the original is acked once the server confirmed the copy.
//
// If the copy cannot be published or is not confirmed, the original is
// nacked with requeue after a pause of about a second: a message is never
// lost for a failed settlement, and never requeued in a hot loop. A copy
// that can never be sent (ErrInvalidMessage: too big for a frame with the
// headers it adds) is not tried again: a delayed message is dead-lettered
// instead, and a dead-letter copy is sent with its fault headers cut
// short or, if even that does not fit, the original is rejected to the
// work queue's dead-letter exchange, and the reason logged at Error. A panic
// that escapes h becomes rabbitmw.Permanent(&rabbitmw.PanicError{...}): the
// message is dead-lettered, the panic logged at Error, and the process goes
// on.
//
// Consume declares the topology first (opts.Topology), then consumes. When
// the connection or a channel is lost, it waits for the handlers in flight
// (their deliveries cannot be settled any more: the server requeues them),
// then connects again with backoff (Options.ReconnectMin/Max), declares
// again and resumes. A delivery received on a connection that has since
// closed is not handled. Each state change is logged.
//
// Consume blocks until ctx is cancelled or a fatal error. On cancellation it
// stops taking deliveries (basic.cancel), requeues the ones received but not
// started, lets the handlers in flight finish and settles them, then closes
// its connection and returns nil. Handlers run with a context that is
// cancelled only when opts.ShutdownTimeout has passed after ctx was
// cancelled; if some have still not returned a second later, Consume closes
// the connection (the server requeues their messages) and returns an error
// wrapping ErrShutdownTimeout that says how many. Those handlers' goroutines
// end when the handlers return; their settlements then fail.
//
// Fatal errors: wrong credentials (ErrAccessRefused), a missing queue
// (ErrQueueNotFound), a work queue with other arguments
// (ErrQueueArguments), a consumer cancelled by the server, as when its
// queue is deleted (ErrConsumerCancelled), invalid options. A server that
// cannot be reached is not fatal: Consume logs it and keeps trying until ctx
// is done, and then returns nil.
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
	return c.run(ctx)
}

// A consumer is one Consume call.
type consumer struct {
	b        *Broker
	h        rabbitmw.Handler
	top      topology
	workers  int
	prefetch int
	timeout  time.Duration
	tag      string
	onSettle func(*amqp.Delivery, rabbitmw.Outcome, error)
	log      *slog.Logger
	inflight atomic.Int64 // handlers running
}

func (c *consumer) run(ctx context.Context) error {
	// Handlers run under hctx, which outlives ctx: it is cancelled only at
	// the shutdown deadline (by drain), or when Consume returns.
	hctx, cancelHandlers := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelHandlers()
	server := slog.String("server", c.b.cfg.serverString)
	bo := newBackoff(c.b.cfg.rmin, c.b.cfg.rmax)
	stopped := func() error {
		c.log.LogAttrs(ctx, slog.LevelInfo, "broker: consumer stopped")
		return nil
	}
	for {
		if ctx.Err() != nil {
			return stopped()
		}
		c.log.LogAttrs(ctx, slog.LevelInfo, "broker: connecting", server)
		s, err := c.b.tr.dial(ctx, "rabbitmw consume "+c.top.queue+" ("+c.b.cfg.process+")")
		switch {
		case err != nil && ctx.Err() != nil:
			return stopped()
		case err == nil:
			start := time.Now()
			var consumed bool
			consumed, err = c.serve(ctx, hctx, cancelHandlers, s)
			if consumed && time.Since(start) >= stableSession {
				bo.reset()
			}
			if err == nil || (retryable(err) && ctx.Err() != nil) {
				return stopped()
			}
		}
		if !retryable(err) {
			c.log.LogAttrs(ctx, slog.LevelError, "broker: consumer stopped by a fatal error", server,
				slog.String("error", err.Error()))
			return err
		}
		d := bo.next()
		c.log.LogAttrs(ctx, slog.LevelWarn, "broker: reconnecting", server,
			slog.String("error", err.Error()), slog.Duration("retry_in", d))
		if !sleep(ctx, d) {
			return stopped()
		}
	}
}

// serve consumes on s until ctx is cancelled (nil), s is lost (an error
// wrapping ErrConnectionLost) or a fatal error. consumed reports whether the
// consumer started. serve closes s before it returns.
func (c *consumer) serve(ctx, hctx context.Context, cancelHandlers context.CancelFunc, s session) (consumed bool, err error) {
	defer s.close()
	if err := s.declare(ctx, c.top.specs()); err != nil {
		return false, c.top.refusal(err)
	}
	deliveries, err := s.consume(c.top.queue, c.tag, c.prefetch)
	if err != nil {
		return false, c.top.refusal(err)
	}
	c.log.LogAttrs(ctx, slog.LevelInfo, "broker: consuming",
		slog.String("consumer_tag", c.tag), slog.Int("workers", c.workers), slog.Int("prefetch", c.prefetch))

	// The workers end when deliveries is closed: after the consumer is
	// cancelled and what it had received was handed out, or at once when s
	// is lost. The last one to end closes done.
	var (
		stopping atomic.Bool
		running  atomic.Int64
		done     = make(chan struct{})
	)
	running.Store(int64(c.workers))
	for range c.workers {
		go func() {
			defer func() {
				if running.Add(-1) == 0 {
					close(done)
				}
			}()
			c.work(hctx, s, deliveries, &stopping)
		}()
	}

	cancelled := s.cancelled()
	for {
		select {
		case <-ctx.Done():
			stopping.Store(true)
			c.log.LogAttrs(ctx, slog.LevelInfo, "broker: shutting down",
				slog.Int64("in_flight", c.inflight.Load()), slog.Duration("timeout", c.timeout))
			if err := s.cancel(c.tag); err != nil {
				c.log.LogAttrs(ctx, slog.LevelDebug, "broker: cancel consumer", slog.String("error", err.Error()))
			}
			return true, c.drain(cancelHandlers, done)

		case <-s.closed():
			c.log.LogAttrs(ctx, slog.LevelWarn, "broker: connection lost",
				slog.String("reason", s.reason().Error()), slog.Int64("in_flight", c.inflight.Load()))
			return true, c.awaitWorkers(ctx, cancelHandlers, done, s.reason())

		case tag, ok := <-cancelled:
			if !ok {
				// Closed with the connection: s.closed() follows.
				cancelled = nil
				continue
			}
			return true, c.cancelledByServer(ctx, cancelHandlers, done, &stopping, tag)

		case <-done:
			// deliveries was closed: the consumer was cancelled by the
			// server, or s was lost. The notice may still be on its way.
			select {
			case tag, ok := <-cancelled:
				if ok {
					return true, c.cancelledByServer(ctx, cancelHandlers, done, &stopping, tag)
				}
				<-s.closed()
				return true, s.reason()
			case <-s.closed():
				return true, s.reason()
			case <-time.After(time.Second):
				return true, lostError(errors.New("delivery channel closed"))
			}
		}
	}
}

func (c *consumer) cancelledByServer(ctx context.Context, cancelHandlers context.CancelFunc, done chan struct{}, stopping *atomic.Bool, tag string) error {
	stopping.Store(true)
	err := fmt.Errorf("%w: queue %q (consumer %q); was the queue deleted?", ErrConsumerCancelled, c.top.queue, tag)
	c.log.LogAttrs(ctx, slog.LevelError, "broker: consumer cancelled by the server", slog.String("consumer_tag", tag))
	if derr := c.drain(cancelHandlers, done); derr != nil {
		return errors.Join(err, derr)
	}
	return err
}

// awaitWorkers waits for the workers of a lost session, and returns lost.
// If ctx is cancelled meanwhile, the shutdown deadline applies: it returns
// nil, or drain's error.
func (c *consumer) awaitWorkers(ctx context.Context, cancelHandlers context.CancelFunc, done chan struct{}, lost error) error {
	select {
	case <-done:
		return lost
	case <-ctx.Done():
		return c.drain(cancelHandlers, done)
	}
}

// drain waits for the workers to end, for at most the shutdown timeout;
// then it cancels the handlers' context and waits shutdownGrace more.
func (c *consumer) drain(cancelHandlers context.CancelFunc, done chan struct{}) error {
	t := time.NewTimer(c.timeout)
	defer t.Stop()
	select {
	case <-done:
		return nil
	case <-t.C:
	}
	cancelHandlers()
	t.Reset(shutdownGrace)
	select {
	case <-done:
		return nil
	case <-t.C:
	}
	n := c.inflight.Load()
	return fmt.Errorf("%w: %d handlers did not return within %v of the shutdown, plus %v after their context was cancelled; their messages return to the queue",
		ErrShutdownTimeout, n, c.timeout, shutdownGrace)
}

// work runs the handler for each delivery until deliveries is closed.
func (c *consumer) work(ctx context.Context, s session, deliveries <-chan amqp.Delivery, stopping *atomic.Bool) {
	for d := range deliveries {
		if stopping.Load() {
			// Shutting down: give back what was not started.
			c.report(ctx, &d, rabbitmw.Requeue, d.Nack(false, true))
			continue
		}
		select {
		case <-s.closed():
			// Its channel is gone: it cannot be settled, and the server
			// redelivers it. Handling it would only duplicate work.
			continue
		default:
		}
		c.inflight.Add(1)
		c.process(ctx, s, &d)
		c.inflight.Add(-1)
	}
}

// process handles one delivery and settles it.
func (c *consumer) process(ctx context.Context, s session, d *amqp.Delivery) {
	if nb, ok := notBefore(d.Headers); ok {
		switch rest := time.Until(nb); {
		case rest > maxNotBefore:
			// A delay this long is a corrupt header (or a producer's
			// mistake), and the message would cycle through the delay
			// queues for it: dead-letter it, with the reason.
			err := fmt.Errorf("broker: header %s is %v ahead, beyond the %v a delay may last", HeaderNotBefore, rest.Round(time.Second), maxNotBefore)
			c.settle(ctx, s, d, rabbitmw.Decide(rabbitmw.Permanent(err)))
			return
		case rest > 0:
			// Not due yet: back to a delay queue, unhandled.
			c.settle(ctx, s, d, rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: rest})
			return
		}
	}
	c.settle(ctx, s, d, rabbitmw.Decide(c.call(ctx, d)))
}

// maxNotBefore bounds how far ahead HeaderNotBefore may be: a message whose
// header is further ahead is dead-lettered rather than delayed.
const maxNotBefore = 7 * 24 * time.Hour

// call runs the handler, turning a panic into a permanent error.
func (c *consumer) call(ctx context.Context, d *amqp.Delivery) (err error) {
	defer func() {
		if v := recover(); v != nil {
			pe := &rabbitmw.PanicError{Value: v, Stack: debug.Stack()}
			c.log.LogAttrs(ctx, slog.LevelError, "broker: handler panicked; the message is dead-lettered",
				slog.String("message_id", d.MessageId),
				slog.String("panic", pe.Error()),
				slog.String("stack", string(pe.Stack)))
			err = rabbitmw.Permanent(pe)
		}
	}()
	return c.h.Handle(ctx, d)
}

// settle settles d by dec.
func (c *consumer) settle(ctx context.Context, s session, d *amqp.Delivery, dec rabbitmw.Decision) {
	var err error
	switch dec.Outcome {
	case rabbitmw.Ack, rabbitmw.Duplicate:
		err = d.Ack(false)
	case rabbitmw.Delay:
		err = c.delay(ctx, s, d, dec)
	case rabbitmw.DeadLetter:
		err = c.deadLetter(ctx, s, d, dec)
	default: // Requeue
		err = d.Nack(false, true)
	}
	c.report(ctx, d, dec.Outcome, err)
}

// delay sends a copy of d to the delay queue for dec.Delay and acks d once
// the copy is confirmed. A copy that cannot be sent (ErrInvalidMessage:
// with what a delay adds, it would not leave a frame's headroom free, as
// it must since it comes back with RabbitMQ's x-death) would fail the same
// way every time: d is dead-lettered instead, with the reason.
func (c *consumer) delay(ctx context.Context, s session, d *amqp.Delivery, dec rabbitmw.Decision) error {
	tr, over := c.top.tierFor(dec.Delay)
	var due time.Time
	if over || d.Expiration != "" {
		// The delay queue alone cannot guarantee the delay: it is too
		// short, or the message's own expiration may cut its stay.
		due = time.Now().Add(dec.Delay)
	}
	msg := republishing(d, delayHeaders(d, dec, due))
	if err := c.publishCopy(ctx, s, tr.queue, msg, retryHeadroom); err != nil {
		if errors.Is(err, ErrInvalidMessage) {
			return c.deadLetter(ctx, s, d, rabbitmw.Decision{
				Outcome:  rabbitmw.DeadLetter,
				Attempts: dec.Attempts,
				Err:      copyRefused("delay", err, dec.Err),
			})
		}
		return c.requeueAfter(ctx, s, d, "delay", tr.queue, err)
	}
	return d.Ack(false)
}

// copyRefused is the reason for dead-lettering a message whose copy of kind
// what could not be sent (refusal), after its handler's result (cause, nil
// for a delivery that was not handled): cause first, so that the error
// type header names the handler's error.
func copyRefused(what string, refusal, cause error) error {
	if cause == nil {
		return fmt.Errorf("broker: the %s copy cannot be sent: %w", what, refusal)
	}
	return fmt.Errorf("%w (and the %s copy cannot be sent: %v)", cause, what, refusal)
}

// maxCutErrorText bounds HeaderError on a dead-letter copy cut to fit.
const maxCutErrorText = 512

// deadLetter sends a copy of d with fault headers to the dead-letter queue
// and acks d once the copy is confirmed.
//
// A copy that cannot be sent (ErrInvalidMessage; with d as delivered,
// only because its fault headers make it too big for a frame) is sent
// again without most of them: d's headers, the attempt count, the queue,
// and HeaderError cut to 512 bytes, saying so. If even that cannot be
// sent, d fills its frame: it is rejected without requeue, and the
// reason logged at Error. The work queue's dead-letter arguments then take
// it to the dead-letter queue, without fault headers, with RabbitMQ's
// x-death (reason "rejected") (DeclareAll declares them; a work queue
// declared elsewhere without them drops it). It is never requeued: it
// would fail the same way again.
func (c *consumer) deadLetter(ctx context.Context, s session, d *amqp.Delivery, dec rabbitmw.Decision) error {
	h := faultHeaders(d, dec, c.top.queue, time.Now(), c.b.cfg.host, c.b.cfg.process)
	errText, _ := h[HeaderError].(string)
	attempts, _ := h[rabbitmw.HeaderAttempts].(int64)
	err := c.publishCopy(ctx, s, c.top.dlq, republishing(d, h), 0)
	if errors.Is(err, ErrInvalidMessage) {
		cut := make(amqp.Table, len(d.Headers)+3)
		maps.Copy(cut, d.Headers)
		cut[HeaderError] = truncate("broker: fault headers cut, the dead-letter copy did not fit ("+err.Error()+"): "+errText, maxCutErrorText)
		cut[rabbitmw.HeaderAttempts] = attempts
		cut[HeaderOriginalQueue] = c.top.queue
		err = c.publishCopy(ctx, s, c.top.dlq, republishing(d, cut), 0)
		if errors.Is(err, ErrInvalidMessage) {
			c.log.LogAttrs(ctx, slog.LevelError, "broker: dead-letter copy cannot be sent; the message is rejected to the work queue's dead-letter exchange",
				slog.String("message_id", d.MessageId),
				slog.String("error", errText),
				slog.String("reason", err.Error()))
			return d.Reject(false)
		}
	}
	if err != nil {
		return c.requeueAfter(ctx, s, d, "dead-letter", c.top.dlq, err)
	}
	c.log.LogAttrs(ctx, slog.LevelWarn, "broker: message dead-lettered",
		slog.String("message_id", d.MessageId),
		slog.String("error", errText),
		slog.Int64("attempts", attempts))
	return d.Ack(false)
}

// publishCopy publishes a copy to queue and waits for its confirm, for at
// most settleTimeout. It refuses a copy that would not leave headroom bytes
// of a frame free (ErrInvalidMessage).
func (c *consumer) publishCopy(ctx context.Context, s session, queue string, msg amqp.Publishing, headroom int) error {
	if headroom > 0 {
		size, err := checkPublishing("", queue, msg)
		if err == nil {
			err = fitFrame(size, s.maxProperties(), headroom)
		}
		if err != nil {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	return s.publish(ctx, "", queue, msg)
}

// requeueAfter logs a failed republish, pauses (unless the session or ctx
// ends first), and requeues d.
func (c *consumer) requeueAfter(ctx context.Context, s session, d *amqp.Delivery, what, queue string, err error) error {
	c.log.LogAttrs(ctx, slog.LevelWarn, "broker: "+what+" copy not published; requeueing the message",
		slog.String("message_id", d.MessageId),
		slog.String("to", queue),
		slog.String("error", err.Error()))
	t := time.NewTimer(requeueBackoff)
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-s.closed():
	}
	t.Stop()
	return d.Nack(false, true)
}

// report tells OnSettle of a settlement, and logs it if it failed.
func (c *consumer) report(ctx context.Context, d *amqp.Delivery, o rabbitmw.Outcome, err error) {
	if c.onSettle != nil {
		c.onSettle(d, o, err)
	}
	if err == nil {
		return
	}
	level := slog.LevelWarn
	if errors.Is(err, amqp.ErrClosed) {
		level = slog.LevelDebug // the server redelivers it
	}
	c.log.LogAttrs(ctx, level, "broker: settlement failed",
		slog.String("message_id", d.MessageId),
		slog.Uint64("delivery_tag", d.DeliveryTag),
		slog.String("outcome", o.String()),
		slog.String("error", err.Error()))
}
