package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"runtime/debug"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
	"github.com/rabbitmw/rabbitmw/internal/clock"
)

// ConsumeOptions configures one Consume call. The zero value selects the
// defaults noted on each field.
type ConsumeOptions struct {
	// Workers is the number of handlers run at once, counting those still
	// running on a connection that was lost (see Consume). Default 16. For
	// a rate r of messages per second and a handler that takes t seconds,
	// give it at least r×t workers; more workers cost latency (BENCHMARKS.md
	// has the sweep the default comes from).
	Workers int
	// Prefetch is the QoS prefetch count: how many unsettled deliveries
	// the server may hand this consumer at once. Default 2*Workers, at
	// most 65535. A prefetch below Workers leaves workers idle while they
	// wait for their next delivery; a larger one keeps more messages from
	// the queue's other consumers, and puts as many in redelivery when a
	// consumer dies.
	Prefetch int
	// Topology describes the queues that serve the work queue.
	Topology Topology
	// ShutdownTimeout is how long handlers in flight may run after the
	// context of Consume is cancelled (see Consume). Default 30s.
	ShutdownTimeout time.Duration
	// ConsumerTag names the consumer on the server. Default: a unique tag
	// made of "rabbitmw", the process name and random digits.
	ConsumerTag string
	// OnSettle, if set, is called after each delivery was settled, with
	// what was done and the error of doing it (nil when the server took
	// it; for Ack and Duplicate, nil when the ack is handed to the
	// connection, which coalesces it with others, see Consume). A
	// delivery given back unhandled at shutdown is reported as Requeue. It runs on the worker that settled the delivery, so it must
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
	// cancelled the handlers' context, for them to return.
	shutdownGrace = time.Second
	// lateSettleTimeout bounds the settlement of a result that came after
	// the shutdown deadline; Consume waits that long, after the grace, for
	// the settlements in progress.
	lateSettleTimeout = 2 * time.Second
	// settleTimeout bounds the wait for the confirm of a delayed or
	// dead-lettered copy. A session whose confirm has not come by then is
	// taken for broken, and given up.
	settleTimeout = 2 * time.Minute
	// requeueBackoff is the pause before a delivery whose copy was refused
	// is requeued, so that a failing publish is never a hot loop.
	requeueBackoff = time.Second
)

var consumerSeq atomic.Uint64

// Consume consumes queue with manual acknowledgements, runs h for each
// delivery on opts.Workers goroutines, and settles each delivery, once, as
// the package documentation's table says for the outcome that
// [rabbitmw.Decide] gives h's result.
//
// h sees each delivery as it was first delivered, on every attempt and
// after a replay: its exchange, routing key, UserId, Expiration and
// DeliveryMode as published, though a retry comes back from a delay queue
// through the default exchange, and every copy keeps those properties in
// headers (see the package documentation, Settlement).
//
// Acks are coalesced: once every delivery received before it on its
// channel is settled, one ack with multiple set settles the run; an ack
// behind a delivery still in its handler waits at most 5 ms, or until a
// quarter of the prefetch count (at most 32) wait, and is then sent alone.
//
// The original of a copy is settled only once the copy's fate is known. If
// the server refuses the copy (unroutable, or nacked), the original is
// nacked with requeue after a pause of about a second: a message is never
// lost for a failed settlement, and never requeued in a hot loop. A copy
// that can never be sent (ErrInvalidMessage: too big for a frame with the
// headers it adds) is not tried again: a delayed message is dead-lettered
// instead, and a dead-letter copy is sent with its fault headers cut
// short or, if even that does not fit, the original is rejected to the
// work queue's dead-letter exchange, and the reason logged at Error. If the
// copy's fate cannot be known, because the connection is lost before its
// confirm, or the confirm has not come two minutes after the copy was sent
// (Consume then gives the connection up, and connects again), the original
// is left to the server, which redelivers it: the message then exists
// twice, as the original and as its copy. That is the one window in which
// Consume duplicates a message; Dedup absorbs the second. (Acks not sent
// yet when a connection is lost are lost with it, as an ack written just
// before it dies is: the server redelivers those messages, and Dedup
// takes them for duplicates.) A panic that
// escapes h becomes rabbitmw.Permanent(&rabbitmw.PanicError{...}): the
// message is dead-lettered, the panic logged at Error, and the process goes
// on.
//
// Consume declares the topology first (opts.Topology), then consumes. When
// the connection or a channel is lost (a server's consumer_timeout closes
// the channel too), it connects again at once, with backoff
// (Options.ReconnectMin/Max, starting again from the minimum once a
// connection is consuming), declares again and resumes. Handlers still
// running on the lost connection finish in the background: their
// deliveries cannot be settled any more, the server redelivers them, and
// Dedup absorbs the redeliveries. They keep their worker until they
// return: at most opts.Workers handlers run at once, whatever connection
// their deliveries came on. A delivery received on a connection that has
// since closed is not handled. Each state change is logged.
//
// Consume blocks until ctx is cancelled or a fatal error. On cancellation it
// stops taking deliveries (basic.cancel), requeues the ones received but not
// started (if those writes have not ended five seconds later, on a socket
// the server no longer reads, it sends the acks not sent yet, as below, and
// closes the connection, which ends them: the server requeues what was not
// settled, and the handlers in flight can no longer settle theirs), lets
// the handlers in flight finish and settles them, then closes
// its connection, after the acks not sent yet (an ack whose write has not
// ended five seconds later, on a socket the server no longer reads, is lost
// with the connection), and returns nil. Handlers,
// those of lost connections included, run with a context that is cancelled
// only when opts.ShutdownTimeout has passed after ctx was cancelled. A result that
// comes after that deadline is still settled, once, under a context of its
// own that lasts two seconds: no copy is published under a context that is
// done. If some handlers have still not returned a second after the
// deadline, Consume waits up to two seconds more for the settlements in
// progress, closes the connection (the server requeues the messages of the
// handlers still running) and returns an error wrapping ErrShutdownTimeout
// that says how many. Those handlers' goroutines end when the handlers
// return; their results are not settled. Every other goroutine of Consume
// has ended when it returns. A fatal error ends Consume the same way, after
// the same wait for the handlers in flight. A socket the server no longer
// reads delays Consume's return by at most about twenty seconds past
// ShutdownTimeout.
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
	c.slots = make(chan struct{}, c.workers)
	return c.run(ctx)
}

// A consumer is one Consume call.
//
// Each session has workers goroutines (work) that handle its deliveries.
// A worker takes one of the consumer's slots before it takes a delivery,
// and frees it once the delivery is settled. Consume waits for the
// workers of every session before it returns, but for those whose
// handlers it gave up on at the shutdown deadline (see drain).
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

	// slots holds a token per worker taking, handling or settling a
	// delivery, on any session: at most workers. A worker of a lost
	// session keeps its slot until its handler returns.
	slots   chan struct{}
	running sync.WaitGroup // the workers of every session

	mu       sync.Mutex
	handling int  // handlers started and not returned
	gaveUp   bool // drain stopped waiting for the handlers still running

	drainOnce sync.Once
	drainErr  error
}

// errUnsettled is what OnSettle hears of a delivery whose session was gone
// when its result came: the server redelivers it.
var errUnsettled = fmt.Errorf("broker: not settled, its connection is gone; the server redelivers it: %w", amqp.ErrClosed)

func (c *consumer) run(ctx context.Context) error {
	// Handlers run under hctx, which outlives ctx: it is cancelled only at
	// the shutdown deadline (by drain), or when Consume returns.
	hctx, cancelHandlers := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelHandlers()
	server := slog.String("server", c.b.cfg.serverString)
	bo := newBackoff(c.b.cfg.rmin, c.b.cfg.rmax)
	// end waits for the handlers still running, on any session, as the
	// shutdown rules say (serve may have waited for them already), and
	// returns err joined to drain's error.
	end := func(err error) error {
		if derr := c.drain(cancelHandlers); derr != nil {
			c.log.LogAttrs(ctx, slog.LevelError, "broker: consumer stopped with handlers still running",
				slog.String("error", derr.Error()))
			err = errors.Join(err, derr)
		}
		c.mu.Lock()
		gaveUp := c.gaveUp
		c.mu.Unlock()
		if !gaveUp {
			c.running.Wait() // their sessions are closed: they are ending
		}
		if err == nil {
			c.log.LogAttrs(ctx, slog.LevelInfo, "broker: consumer stopped")
		}
		return err
	}
	for {
		if ctx.Err() != nil {
			return end(nil)
		}
		c.log.LogAttrs(ctx, slog.LevelInfo, "broker: connecting", server)
		s, err := c.b.dial(ctx, c.top.queue, "consume "+c.top.queue)
		switch {
		case err != nil && ctx.Err() != nil:
			return end(nil)
		case err == nil:
			err = c.serve(ctx, hctx, cancelHandlers, s, bo.reset)
			if err == nil || (retryable(err) && ctx.Err() != nil) {
				return end(nil)
			}
		}
		if !retryable(err) {
			c.log.LogAttrs(ctx, slog.LevelError, "broker: consumer stopped by a fatal error", server,
				slog.String("error", err.Error()))
			return end(err)
		}
		d := bo.next()
		c.b.cfg.obs.reconnect(c.top.queue, err, d)
		c.log.LogAttrs(ctx, slog.LevelWarn, "broker: reconnecting", server,
			slog.String("error", err.Error()), slog.Duration("retry_in", d))
		if clock.Sleep(ctx, d) != nil {
			return end(nil)
		}
	}
}

// serve consumes on s until ctx is cancelled (nil), s is lost or given up
// (an error wrapping ErrConnectionLost) or a fatal error. When ctx is
// cancelled or the server cancels the consumer, serve drains the handlers
// before it returns, so that they can settle on s; when s is lost, it
// returns at once, whatever handlers still run. It calls consuming once
// the consumer is started. serve closes s before it returns.
func (c *consumer) serve(ctx, hctx context.Context, cancelHandlers context.CancelFunc, s session, consuming func()) error {
	defer s.Close()
	if err := c.top.declare(ctx, s); err != nil {
		return err
	}
	deliveries, err := s.Consume(c.top.queue, c.tag, c.prefetch)
	if err != nil {
		return c.top.refusal(err)
	}
	consuming()
	a := newAcker(c.top.queue, c.prefetch, &c.b.cfg.obs, c.log)
	// Before s.Close: the acks not sent yet go first, but a write blocked
	// for closeTimeout is ended by closing s.
	defer a.closeWithin(closeTimeout, func() { s.Close() })
	c.log.LogAttrs(ctx, slog.LevelInfo, "broker: consuming",
		slog.String("consumer_tag", c.tag), slog.Int("workers", c.workers), slog.Int("prefetch", c.prefetch))

	g := newGivingUp()
	stop := make(chan struct{})
	stopTaking := sync.OnceFunc(func() { close(stop) })
	done := c.startWorkers(hctx, s, a, deliveries, stop, g.giveUp)
	cancelled := s.Cancelled()
	for {
		select {
		case <-ctx.Done():
			stopTaking()
			return c.shutDown(ctx, cancelHandlers, s, a, deliveries)

		case <-s.Closed():
			return c.lost(ctx, s)

		case <-g.given:
			c.log.LogAttrs(ctx, slog.LevelWarn, "broker: giving the connection up",
				slog.String("reason", g.err.Error()), slog.Int("in_flight", c.inFlight()))
			return g.err

		case tag, ok := <-cancelled:
			if !ok {
				// Closed with the connection: s.Closed() follows.
				cancelled = nil
				continue
			}
			stopTaking()
			return c.cancelledByServer(ctx, cancelHandlers, s, a, deliveries, tag)

		case <-done:
			return c.deliveriesClosed(ctx, cancelHandlers, s, a, deliveries, cancelled, stopTaking)
		}
	}
}

// givingUp is how a handler whose copy's fate is unknown gives its
// session up: giveUp records the first error it is given and closes
// given; serve then returns that error, and closes the session.
type givingUp struct {
	once  sync.Once
	given chan struct{}
	err   error // written before given is closed
}

func newGivingUp() *givingUp { return &givingUp{given: make(chan struct{})} }

func (g *givingUp) giveUp(err error) {
	g.once.Do(func() {
		g.err = err
		close(g.given)
	})
}

// startWorkers starts c.workers workers (work) on s, and returns a channel
// that the last of them to end closes. The workers end when stop is
// closed (serve then gives back what deliveries still holds), when
// deliveries is closed (at once when s is lost), or when s is lost while
// they wait for a slot; a worker in a handler ends after it.
func (c *consumer) startWorkers(hctx context.Context, s session, a *acker, deliveries <-chan amqp.Delivery, stop <-chan struct{}, giveUp func(error)) <-chan struct{} {
	var left atomic.Int64
	done := make(chan struct{})
	left.Store(int64(c.workers))
	c.running.Add(c.workers)
	for range c.workers {
		go func() {
			defer c.running.Done()
			defer func() {
				if left.Add(-1) == 0 {
					close(done)
				}
			}()
			c.work(hctx, s, a, deliveries, stop, giveUp)
		}()
	}
	return done
}

// shutDown ends the session when ctx is cancelled; its workers must be
// stopped already. It cancels the consumer, gives back what deliveries
// still holds, both within closeTimeout (see stopWithin), and drains the
// handlers.
func (c *consumer) shutDown(ctx context.Context, cancelHandlers context.CancelFunc, s session, a *acker, deliveries <-chan amqp.Delivery) error {
	c.log.LogAttrs(ctx, slog.LevelInfo, "broker: shutting down",
		slog.Int("in_flight", c.inFlight()), slog.Duration("timeout", c.timeout))
	c.stopWithin(ctx, closeTimeout, s, a, func() {
		if err := s.Cancel(c.tag); err != nil {
			c.log.LogAttrs(ctx, slog.LevelDebug, "broker: cancel consumer", slog.String("error", err.Error()))
		}
		c.giveBack(ctx, s, a, deliveries)
	})
	c.drain(cancelHandlers) // run reports its error
	return nil
}

// lost logs the loss of s and returns why it was lost.
func (c *consumer) lost(ctx context.Context, s session) error {
	c.log.LogAttrs(ctx, slog.LevelWarn, "broker: connection lost",
		slog.String("reason", s.Reason().Error()), slog.Int("in_flight", c.inFlight()))
	return s.Reason()
}

// deliveriesClosed ends the session whose workers all ended because
// deliveries was closed: the consumer was cancelled by the server, or s
// was lost. The notice (on cancelled, or s.Closed) may still be on its
// way: deliveriesClosed waits a second for it. It calls stopTaking before
// cancelledByServer, as serve does.
func (c *consumer) deliveriesClosed(ctx context.Context, cancelHandlers context.CancelFunc, s session, a *acker, deliveries <-chan amqp.Delivery, cancelled <-chan string, stopTaking func()) error {
	select {
	case tag, ok := <-cancelled:
		if ok {
			stopTaking()
			return c.cancelledByServer(ctx, cancelHandlers, s, a, deliveries, tag)
		}
		<-s.Closed()
		return c.lost(ctx, s)
	case <-s.Closed():
		return c.lost(ctx, s)
	case <-time.After(time.Second):
		return lostError(errors.New("delivery channel closed"))
	}
}

// cancelledByServer ends the session whose consumer the server
// cancelled; its workers must be stopped already.
func (c *consumer) cancelledByServer(ctx context.Context, cancelHandlers context.CancelFunc, s session, a *acker, deliveries <-chan amqp.Delivery, tag string) error {
	err := fmt.Errorf("%w: queue %q (consumer %q); was the queue deleted?", ErrConsumerCancelled, c.top.queue, tag)
	c.log.LogAttrs(ctx, slog.LevelError, "broker: consumer cancelled by the server", slog.String("consumer_tag", tag))
	c.stopWithin(ctx, closeTimeout, s, a, func() { c.giveBack(ctx, s, a, deliveries) })
	c.drain(cancelHandlers) // run reports its error
	return err
}

// stopWithin runs stop, the writes that end the consumer of s (basic.cancel,
// the requeues of giveBack), and waits at most d for them. A write still
// blocked then (the server no longer reads the socket) would hold Consume
// for ever: stopWithin closes a, the acker of s, which sends the acks it
// keeps first (within d too, see closeWithin), then closes s, which ends
// the blocked writes (amqp091's Cancel and Nack take no context), and
// waits for stop to return. The deliveries not given back return to the
// queue with the connection; the handlers in flight can no longer settle
// theirs, which the server redelivers.
func (c *consumer) stopWithin(ctx context.Context, d time.Duration, s session, a *acker, stop func()) {
	done := make(chan struct{})
	go func() { // ends when stop returns
		defer close(done)
		stop()
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		c.log.LogAttrs(ctx, slog.LevelWarn, "broker: cancel and requeues still being written; closing the connection",
			slog.Duration("waited", d), slog.Int("in_flight", c.inFlight()))
		a.closeWithin(d, func() { s.Close() })
		s.Close()
		<-done
	}
}

// giveBack requeues, unhandled, what deliveries still holds once the
// consumer was cancelled: until deliveries is closed (the server's consumer
// is gone, and what it had sent was handed out) or s is lost.
func (c *consumer) giveBack(ctx context.Context, s session, a *acker, deliveries <-chan amqp.Delivery) {
	for {
		select {
		case d, ok := <-deliveries:
			if !ok {
				return
			}
			a.adopt(&d)
			c.report(ctx, &d, rabbitmw.Requeue, d.Nack(false, true))
		case <-s.Closed():
			return
		}
	}
}

// inFlight returns the number of handlers started and not returned.
func (c *consumer) inFlight() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.handling
}

// work runs the handler for each delivery until deliveries is closed or
// stop is. It takes a slot first, then a delivery, which a, the acker of
// s, adopts; it ends at once if s is closed while it waits for a slot. It
// ends without freeing its slot if drain gave up on its handler.
func (c *consumer) work(hctx context.Context, s session, a *acker, deliveries <-chan amqp.Delivery, stop <-chan struct{}, giveUp func(error)) {
	for {
		select {
		case <-stop:
			return
		case <-s.Closed():
			return
		case c.slots <- struct{}{}:
		}
		var d amqp.Delivery
		var ok bool
		select {
		case d, ok = <-deliveries:
		case <-stop:
		}
		if ok {
			a.adopt(&d)
		}
		switch {
		case !ok:
			<-c.slots
			return
		case isClosed(stop):
			// Shutting down: give back what was not started.
			c.report(hctx, &d, rabbitmw.Requeue, d.Nack(false, true))
			<-c.slots
			return
		case isClosed(s.Closed()):
			// Its channel is gone: it cannot be settled, and the server
			// redelivers it. Handling it would only duplicate work.
			<-c.slots
			continue
		}
		c.mu.Lock()
		c.handling++
		c.mu.Unlock()
		if !c.handle(hctx, s, &d, giveUp) {
			return
		}
	}
}

// handle runs the handler for d, as first delivered (see asPublished),
// settles d on s, and frees the worker's slot. If s is gone by the time the handler returns, d is not settled:
// the server redelivers it. If drain gave up on the handler meanwhile, d
// is not settled either, the slot is kept (drain counts on it), and handle
// reports false: the worker must end.
func (c *consumer) handle(hctx context.Context, s session, d *amqp.Delivery, giveUp func(error)) bool {
	asPublished(d)
	dec := c.decide(hctx, d)
	if c.returned() {
		c.report(hctx, d, dec.Outcome, errUnsettled)
		return false
	}
	defer func() { <-c.slots }()
	if isClosed(s.Closed()) {
		c.report(hctx, d, dec.Outcome, errUnsettled)
		return true
	}
	c.settle(hctx, s, d, dec, giveUp)
	return true
}

// returned counts a handler out, and reports whether drain gave up on it.
func (c *consumer) returned() (gaveUp bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.handling--
	return c.gaveUp
}

// isClosed reports whether ch is closed; nothing is ever sent on it.
func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// drain waits, for at most the shutdown timeout, for the workers of every
// session to free their slots: their handlers returned, their results
// settled, what they had not started given back. Then it cancels the
// handlers' context and waits shutdownGrace more; then it gives up on the
// handlers still running, and waits at most lateSettleTimeout for the
// settlements in progress. It returns an error wrapping ErrShutdownTimeout
// if it gave up on a handler or a settlement. Only the first call waits;
// later ones return its result. The workers of the live session, if
// any, must be stopped: they take no slot any more.
func (c *consumer) drain(cancelHandlers context.CancelFunc) error {
	c.drainOnce.Do(func() { c.drainErr = c.awaitHandlers(cancelHandlers) })
	return c.drainErr
}

func (c *consumer) awaitHandlers(cancelHandlers context.CancelFunc) error {
	// Every slot drain holds is one that no handler holds.
	held := 0
	take := func(want int, d time.Duration) bool {
		t := time.NewTimer(d)
		defer t.Stop()
		for held < want {
			select {
			case c.slots <- struct{}{}:
				held++
			case <-t.C:
				return false
			}
		}
		return true
	}
	if take(c.workers, c.timeout) {
		return nil
	}
	cancelHandlers()
	if take(c.workers, shutdownGrace) {
		return nil
	}
	// The handlers still running keep their slots (see handle); the other
	// slots are held by settlements, until they end.
	c.mu.Lock()
	c.gaveUp = true
	stuck := c.handling
	c.mu.Unlock()
	take(c.workers-stuck, lateSettleTimeout)
	unsettled := c.workers - stuck - held
	if stuck == 0 && unsettled == 0 {
		return nil
	}
	what := fmt.Sprintf("%d handlers did not return within %v of the shutdown, plus %v after their context was cancelled",
		stuck, c.timeout, shutdownGrace)
	if unsettled > 0 {
		what += fmt.Sprintf(", and %d settlements did not end %v later", unsettled, lateSettleTimeout)
	}
	return fmt.Errorf("%w: %s; their messages return to the queue", ErrShutdownTimeout, what)
}

// decide runs the handler for d, unless d is not due yet, and returns what
// to do with d.
func (c *consumer) decide(ctx context.Context, d *amqp.Delivery) rabbitmw.Decision {
	if nb, ok := notBefore(d.Headers); ok {
		switch rest := time.Until(nb); {
		case rest > maxNotBefore:
			// A delay this long is a corrupt header (or a producer's
			// mistake), and the message would cycle through the delay
			// queues for it: dead-letter it, with the reason.
			err := fmt.Errorf("broker: header %s is %v ahead, beyond the %v a delay may last", HeaderNotBefore, rest.Round(time.Second), maxNotBefore)
			c.log.LogAttrs(ctx, slog.LevelWarn, "broker: not-before header too far ahead; the message is dead-lettered",
				slog.String("message_id", d.MessageId),
				slog.String("error", err.Error()))
			return rabbitmw.Decide(rabbitmw.Permanent(err))
		case rest > 0:
			// Not due yet: back to a delay queue, unhandled.
			return rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: rest}
		}
	}
	return rabbitmw.Decide(c.call(ctx, d))
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

// settle settles d by dec; hctx is the context its handler ran with.
func (c *consumer) settle(hctx context.Context, s session, d *amqp.Delivery, dec rabbitmw.Decision, giveUp func(error)) {
	var err error
	switch dec.Outcome {
	case rabbitmw.Ack, rabbitmw.Duplicate:
		err = ackLater(d) // coalesced, by s's acker
	case rabbitmw.Delay, rabbitmw.DeadLetter:
		// The copy has a context of its own: the shutdown deadline, which
		// cancels hctx, must not cut the wait for its confirm short. A
		// result that came after the deadline gets a short one.
		timeout := settleTimeout
		if hctx.Err() != nil {
			timeout = lateSettleTimeout
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(hctx), timeout)
		if dec.Outcome == rabbitmw.Delay {
			err = c.delay(ctx, s, d, dec, giveUp)
		} else {
			err = c.deadLetter(ctx, s, d, dec, giveUp)
		}
		cancel()
	default: // Requeue
		err = d.Nack(false, true)
	}
	c.report(hctx, d, dec.Outcome, err)
}

// delay sends a copy of d to the delay queue for dec.Delay and acks d once
// the copy is confirmed. A copy that cannot be sent (ErrInvalidMessage:
// with what a delay adds, it would not leave a frame's headroom free, as
// it must since it comes back with RabbitMQ's x-death) would fail the same
// way every time: d is dead-lettered instead, with the reason.
func (c *consumer) delay(ctx context.Context, s session, d *amqp.Delivery, dec rabbitmw.Decision, giveUp func(error)) error {
	tr, over := c.top.tierFor(dec.Delay)
	var due time.Time
	if over {
		// The delay queue alone cannot guarantee the delay: it is too
		// short. (The copy has no Expiration of its own to cut its stay:
		// see asCopy.)
		due = time.Now().Add(dec.Delay)
	}
	h := delayHeaders(d, dec, c.top.queue, due)
	noteFirstFailure(h, dec.Err, time.Now())
	msg := republishing(d, h)
	err := c.publishCopy(ctx, s, tr.queue, msg, retryHeadroom)
	c.b.cfg.obs.republish(ctx, RepublishEvent{Outcome: rabbitmw.Delay, Queue: c.top.queue, To: tr.queue, Delay: dec.Delay, Err: err, Delivery: d})
	if errors.Is(err, ErrInvalidMessage) {
		c.log.LogAttrs(ctx, slog.LevelWarn, "broker: delay copy cannot be sent; the message is dead-lettered",
			slog.String("message_id", d.MessageId),
			slog.String("error", err.Error()))
		return c.deadLetter(ctx, s, d, rabbitmw.Decision{
			Outcome:  rabbitmw.DeadLetter,
			Attempts: dec.Attempts,
			Err:      copyRefused("delay", err, dec.Err),
		}, giveUp)
	}
	if err != nil {
		return c.copyFailed(ctx, s, d, "delay", tr.queue, err, giveUp)
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
func (c *consumer) deadLetter(ctx context.Context, s session, d *amqp.Delivery, dec rabbitmw.Decision, giveUp func(error)) error {
	h := faultHeaders(d, dec, c.top.queue, time.Now(), c.b.cfg.host, c.b.cfg.process)
	errText, _ := h[HeaderError].(string)
	attempts, _ := h[rabbitmw.HeaderAttempts].(int64)
	err := c.publishCopy(ctx, s, c.top.dlq, republishing(d, h), 0)
	if errors.Is(err, ErrInvalidMessage) {
		cut := make(amqp.Table, len(d.Headers)+3)
		maps.Copy(cut, d.Headers)
		cut[HeaderError] = transport.Truncate("broker: fault headers cut, the dead-letter copy did not fit ("+err.Error()+"): "+errText, maxCutErrorText)
		cut[rabbitmw.HeaderAttempts] = attempts
		cut[HeaderOriginalQueue] = c.top.queue
		err = c.publishCopy(ctx, s, c.top.dlq, republishing(d, cut), 0)
	}
	errType, _ := h[HeaderErrorType].(string)
	c.b.cfg.obs.republish(ctx, RepublishEvent{Outcome: rabbitmw.DeadLetter, Queue: c.top.queue, To: c.top.dlq, ErrorType: errType, Err: err, Delivery: d})
	if errors.Is(err, ErrInvalidMessage) {
		c.log.LogAttrs(ctx, slog.LevelError, "broker: dead-letter copy cannot be sent; the message is rejected to the work queue's dead-letter exchange",
			slog.String("message_id", d.MessageId),
			slog.String("error", errText),
			slog.String("reason", err.Error()))
		return d.Reject(false)
	}
	if err != nil {
		return c.copyFailed(ctx, s, d, "dead-letter", c.top.dlq, err, giveUp)
	}
	// Debug: the dead-letter was logged where it was decided (see
	// Options.Logger).
	c.log.LogAttrs(ctx, slog.LevelDebug, "broker: dead-letter copy confirmed",
		slog.String("message_id", d.MessageId),
		slog.String("to", c.top.dlq),
		slog.String("error", errText),
		slog.Int64("attempts", attempts))
	return d.Ack(false)
}

// errNotSent is wrapped by the error of a copy that was not sent.
var errNotSent = errors.New("broker: copy not sent")

// publishCopy publishes msg to queue on s and waits for the server's
// confirm. Under a context that is done already it sends nothing, and
// returns an error wrapping errNotSent. It refuses a copy that would not
// leave headroom bytes of a frame free (ErrInvalidMessage), sending
// nothing.
func (c *consumer) publishCopy(ctx context.Context, s session, queue string, msg amqp.Publishing, headroom int) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %w", errNotSent, err)
	}
	if headroom > 0 {
		size, err := transport.CheckPublishing("", queue, msg)
		if err == nil {
			err = transport.FitFrame(size, s.MaxProperties(), headroom)
		}
		if err != nil {
			return err
		}
	}
	return s.Publish(ctx, "", queue, msg)
}

// copyFailed settles d, whose copy to queue failed with err. A copy known
// not to be in queue (not sent, or refused by the server) leaves d to be
// requeued (requeueAfter). A copy whose fate is unknown (the session was
// lost, or ctx ended, before its confirm) may be in queue: requeueing d
// would make the message exist twice, acking it would lose the message if
// the copy is not there. So d is left as it is, and s given up: the server
// redelivers d.
func (c *consumer) copyFailed(ctx context.Context, s session, d *amqp.Delivery, what, queue string, err error, giveUp func(error)) error {
	unknown := !errors.Is(err, errNotSent) &&
		(errors.Is(err, ErrConnectionLost) || errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled))
	if !unknown {
		return c.requeueAfter(ctx, s, d, what, queue, err)
	}
	c.log.LogAttrs(ctx, slog.LevelWarn, "broker: "+what+" copy not confirmed; the server redelivers the message",
		slog.String("message_id", d.MessageId),
		slog.String("to", queue),
		slog.String("error", err.Error()))
	if !isClosed(s.Closed()) {
		giveUp(fmt.Errorf("%w: the %s copy of message %q was not confirmed: %w", ErrConnectionLost, what, d.MessageId, err))
	}
	return errUnsettled
}

// requeueAfter logs a copy that was not published, pauses (unless the
// session or ctx ends first), and requeues d.
func (c *consumer) requeueAfter(ctx context.Context, s session, d *amqp.Delivery, what, queue string, err error) error {
	c.log.LogAttrs(ctx, slog.LevelWarn, "broker: "+what+" copy not published; requeueing the message",
		slog.String("message_id", d.MessageId),
		slog.String("to", queue),
		slog.String("error", err.Error()))
	t := time.NewTimer(requeueBackoff)
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-s.Closed():
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
