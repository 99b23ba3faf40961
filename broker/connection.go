package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/clock"
	"github.com/rabbitmw/rabbitmw/internal/recording"
)

// run connects, serves the session (serve), and connects again when the
// session is lost, until ctx is done or a fatal error; then it waits for
// the handlers (see Reconnection and Shutdown in the package
// documentation).
func (c *consumer) run(ctx context.Context) error {
	// Handlers run under hctx, which outlives ctx: it is cancelled only at
	// the shutdown deadline (by drain), or when Consume returns.
	// It carries c.recording, which counts the layers' writes of results
	// after their handlers returned (see drain).
	hctx, cancelHandlers := context.WithCancel(recording.With(context.WithoutCancel(ctx), &c.recording))
	defer cancelHandlers()
	c.cancelHandlers = cancelHandlers
	server := slog.String("server", c.b.cfg.serverString)
	bo := newBackoff(c.b.cfg.rmin, c.b.cfg.rmax)
	// end waits for the handlers still running, on any session, as the
	// shutdown rules say (serve may have waited for them already), and
	// returns err joined to drain's error.
	end := func(err error) error {
		if derr := c.drain(); derr != nil {
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
			err = c.serve(ctx, hctx, s, bo.reset)
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
func (c *consumer) serve(ctx, hctx context.Context, s session, consuming func()) error {
	defer s.Close()
	// The set-up's basic.qos and basic.consume wait for the server's
	// answer, whatever ctx says (its declarations return when ctx ends),
	// and a server can hold them for long: a quorum queue without a
	// majority answers neither queue.declare nor basic.consume until its
	// members elect a leader. A stop then closes s, which ends them.
	closedOnStop := make(chan struct{})
	closeOnStop := context.AfterFunc(ctx, func() {
		defer close(closedOnStop)
		s.Close()
	})
	deliveries, err := c.setUp(ctx, s)
	if !closeOnStop() {
		<-closedOnStop
	}
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return nil // stopped while a call waited for the server
		}
		// A call ended by the stop's close failed as on a lost
		// connection, which run takes for the stop it is; a refusal the
		// server sent first is fatal all the same.
		return err
	}
	if ctx.Err() != nil {
		return nil // stopped: nothing was handled on s
	}
	consuming()
	a := newAcker(c.top.queue, c.prefetch, c.workers, &c.b.cfg.obs, c.log)
	// Before s.Close: the acks not sent yet go first, but a write blocked
	// for closeTimeout is ended by closing s.
	defer a.closeWithin(closeTimeout, func() { s.Close() })
	c.log.LogAttrs(ctx, slog.LevelInfo, "broker: consuming",
		slog.String("consumer_tag", c.tag), slog.Int("workers", c.workers), slog.Int("prefetch", c.prefetch))

	cn := newConn(c, s, a, deliveries)
	done := cn.startWorkers(hctx)
	cancelled := s.Cancelled()
	for {
		select {
		case <-ctx.Done():
			cn.stopTaking()
			return cn.shutDown(ctx)

		case <-s.Closed():
			return cn.lost(ctx)

		case <-cn.given:
			c.log.LogAttrs(ctx, slog.LevelWarn, "broker: giving the connection up",
				slog.String("reason", cn.givenUp.Error()), slog.Int("in_flight", c.inFlight()))
			return cn.givenUp

		case tag, ok := <-cancelled:
			if !ok {
				// Closed with the connection: s.Closed() follows.
				cancelled = nil
				continue
			}
			cn.stopTaking()
			return cn.cancelledByServer(ctx, tag)

		case <-done:
			return cn.deliveriesClosed(ctx, cancelled)
		}
	}
}

// setUp declares the topology on s and starts the consumer.
func (c *consumer) setUp(ctx context.Context, s session) (<-chan amqp.Delivery, error) {
	if err := c.top.declare(ctx, s); err != nil {
		return nil, err
	}
	deliveries, err := s.Consume(c.top.queue, c.tag, c.prefetch)
	if err != nil {
		return nil, c.top.refusal(err)
	}
	return deliveries, nil
}

// A conn is the state of one session of a consumer, from the start of its
// consumer (serve) to its end: the session, its acker, its deliveries, how
// its workers are told to stop taking them, and how a worker gives the
// session up.
type conn struct {
	// The Consume call it serves: its slots, counts and log are shared
	// by every session.
	*consumer
	s          session
	a          *acker // sends the acks of s's deliveries
	deliveries <-chan amqp.Delivery

	// stop is closed by stopTaking: the workers take no more deliveries
	// (serve then gives back what deliveries still holds).
	stop       chan struct{}
	stopTaking func()

	// given is closed by giveUp, with givenUp the reason, written before.
	giveUpOnce sync.Once
	given      chan struct{}
	givenUp    error
}

func newConn(c *consumer, s session, a *acker, deliveries <-chan amqp.Delivery) *conn {
	stop := make(chan struct{})
	return &conn{
		consumer: c, s: s, a: a, deliveries: deliveries,
		stop: stop, stopTaking: sync.OnceFunc(func() { close(stop) }),
		given: make(chan struct{}),
	}
}

// giveUp is how a worker whose copy's fate is unknown gives the session
// up: it records the first error it is given and closes given; serve then
// returns that error, and closes the session.
func (cn *conn) giveUp(err error) {
	cn.giveUpOnce.Do(func() {
		cn.givenUp = err
		close(cn.given)
	})
}

// shutDown ends the session when ctx is cancelled; its workers must be
// stopped already. It cancels the consumer, gives back what deliveries
// still holds, both within closeTimeout (see stopWithin), and drains the
// handlers.
func (cn *conn) shutDown(ctx context.Context) error {
	cn.log.LogAttrs(ctx, slog.LevelInfo, "broker: shutting down",
		slog.Int("in_flight", cn.inFlight()), slog.Duration("timeout", cn.timeout))
	cn.stopWithin(ctx, closeTimeout, func() {
		if err := cn.s.Cancel(cn.tag); err != nil {
			cn.log.LogAttrs(ctx, slog.LevelDebug, "broker: cancel consumer", slog.String("error", err.Error()))
		}
		cn.giveBack(ctx)
	})
	cn.drain() // run reports its error
	return nil
}

// lost logs the loss of s and returns why it was lost.
func (cn *conn) lost(ctx context.Context) error {
	cn.log.LogAttrs(ctx, slog.LevelWarn, "broker: connection lost",
		slog.String("reason", cn.s.Reason().Error()), slog.Int("in_flight", cn.inFlight()))
	return cn.s.Reason()
}

// deliveriesClosed ends the session whose workers all ended because
// deliveries was closed: the consumer was cancelled by the server, or s
// was lost. The notice (on cancelled, or s.Closed) may still be on its
// way: deliveriesClosed waits a second for it. It calls stopTaking before
// cancelledByServer, as serve does.
func (cn *conn) deliveriesClosed(ctx context.Context, cancelled <-chan string) error {
	select {
	case tag, ok := <-cancelled:
		if ok {
			cn.stopTaking()
			return cn.cancelledByServer(ctx, tag)
		}
		<-cn.s.Closed()
		return cn.lost(ctx)
	case <-cn.s.Closed():
		return cn.lost(ctx)
	case <-time.After(time.Second):
		return lostError(errors.New("delivery channel closed"))
	}
}

// cancelledByServer ends the session whose consumer the server
// cancelled; its workers must be stopped already.
func (cn *conn) cancelledByServer(ctx context.Context, tag string) error {
	err := fmt.Errorf("%w: queue %q (consumer %q); was the queue deleted?", ErrConsumerCancelled, cn.top.queue, tag)
	cn.log.LogAttrs(ctx, slog.LevelError, "broker: consumer cancelled by the server", slog.String("consumer_tag", tag))
	cn.stopWithin(ctx, closeTimeout, func() { cn.giveBack(ctx) })
	cn.drain() // run reports its error
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
func (cn *conn) stopWithin(ctx context.Context, d time.Duration, stop func()) {
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
		cn.log.LogAttrs(ctx, slog.LevelWarn, "broker: cancel and requeues still being written; closing the connection",
			slog.Duration("waited", d), slog.Int("in_flight", cn.inFlight()))
		cn.a.closeWithin(d, func() { cn.s.Close() })
		cn.s.Close()
		<-done
	}
}

// giveBack requeues, unhandled, what deliveries still holds once the
// consumer was cancelled: until deliveries is closed (the server's consumer
// is gone, and what it had sent was handed out) or s is lost.
func (cn *conn) giveBack(ctx context.Context) {
	for {
		select {
		case d, ok := <-cn.deliveries:
			if !ok {
				return
			}
			cn.a.adopt(&d)
			cn.report(ctx, &d, rabbitmw.Requeue, d.Nack(false, true))
		case <-cn.s.Closed():
			return
		}
	}
}
