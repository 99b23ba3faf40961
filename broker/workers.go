package broker

import (
	"context"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/recording"
)

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

	// cancelHandlers cancels the context the handlers run with, on every
	// session: at the shutdown deadline (drain), or when Consume returns.
	cancelHandlers context.CancelFunc

	// slots holds a token per worker taking, handling or settling a
	// delivery, on any session: at most workers. A worker of a lost
	// session keeps its slot until its handler returns.
	slots   chan struct{}
	running sync.WaitGroup // the workers of every session

	mu       sync.Mutex
	handling int  // handlers started and not returned
	gaveUp   bool // drain stopped waiting for the handlers still running

	// recording counts the writes that the handlers' layers make to
	// record a result after its handler returned (a done mark), which
	// drain waits for.
	recording recording.Tracker

	drainOnce sync.Once
	drainErr  error
}

const (
	// shutdownGrace is how long Consume waits, after the shutdown deadline
	// cancelled the handlers' context, for them to return.
	shutdownGrace = time.Second
	// lateSettleTimeout bounds the settlement of a result that came after
	// the shutdown deadline; Consume waits that long, after the grace, for
	// the settlements in progress.
	lateSettleTimeout = 2 * time.Second
	// recordingPoll is how often drain, once the grace has passed, looks
	// again for the writes of results still in progress.
	recordingPoll = 50 * time.Millisecond
)

// errUnsettled is what OnSettle hears of a delivery whose session was gone
// when its result came: the server redelivers it.
var errUnsettled = fmt.Errorf("broker: not settled, its connection is gone; the server redelivers it: %w", amqp.ErrClosed)

// startWorkers starts cn.workers workers (work) on s, and returns a channel
// that the last of them to end closes. The workers end when stop is
// closed (serve then gives back what deliveries still holds), when
// deliveries is closed (at once when s is lost), or when s is lost while
// they wait for a slot; a worker in a handler ends after it.
func (cn *conn) startWorkers(hctx context.Context) <-chan struct{} {
	var left atomic.Int64
	done := make(chan struct{})
	left.Store(int64(cn.workers))
	cn.running.Add(cn.workers)
	for range cn.workers {
		go func() {
			defer cn.running.Done()
			defer func() {
				if left.Add(-1) == 0 {
					close(done)
				}
			}()
			cn.work(hctx)
		}()
	}
	return done
}

// work runs the handler for each delivery until deliveries is closed or
// stop is. It takes a slot first, then a delivery, which a, the acker of
// s, adopts; it ends at once if s is closed while it waits for a slot. It
// ends without freeing its slot if drain gave up on its handler.
func (cn *conn) work(hctx context.Context) {
	for {
		select {
		case <-cn.stop:
			return
		case <-cn.s.Closed():
			return
		case cn.slots <- struct{}{}:
		}
		var d amqp.Delivery
		var ok bool
		select {
		case d, ok = <-cn.deliveries:
		case <-cn.stop:
		}
		if ok {
			cn.a.adopt(&d)
		}
		switch {
		case !ok:
			<-cn.slots
			return
		case isClosed(cn.stop):
			// Shutting down: give back what was not started.
			cn.report(hctx, &d, rabbitmw.Requeue, d.Nack(false, true))
			<-cn.slots
			return
		case isClosed(cn.s.Closed()):
			// Its channel is gone: it cannot be settled, and the server
			// redelivers it. Handling it would only duplicate work.
			<-cn.slots
			continue
		}
		cn.mu.Lock()
		cn.handling++
		cn.mu.Unlock()
		if !cn.handle(hctx, &d) {
			return
		}
	}
}

// handle runs the handler for d, as first delivered (see asPublished),
// settles d on s, and frees the worker's slot. If s is gone by the time
// the handler returns, d is not settled: the server redelivers it. If drain gave up on the handler meanwhile, d
// is not settled either, the slot is kept (drain counts on it), and handle
// reports false: the worker must end.
func (cn *conn) handle(hctx context.Context, d *amqp.Delivery) bool {
	asPublished(d, cn.top.queue)
	dec := cn.decide(hctx, d)
	if cn.returned() {
		cn.report(hctx, d, dec.Outcome, errUnsettled)
		return false
	}
	defer func() { <-cn.slots }()
	if isClosed(cn.s.Closed()) {
		cn.report(hctx, d, dec.Outcome, errUnsettled)
		return true
	}
	cn.settle(hctx, d, dec)
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

// inFlight returns the number of handlers started and not returned.
func (c *consumer) inFlight() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.handling
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
func (c *consumer) drain() error {
	c.drainOnce.Do(func() { c.drainErr = c.awaitHandlers() })
	return c.drainErr
}

func (c *consumer) awaitHandlers() error {
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
	c.cancelHandlers()
	if take(c.workers, shutdownGrace) {
		return nil
	}
	// A handler that returned may leave its layers writing its result
	// (Dedup's done mark) to a store that is slow to answer: wait for
	// those writes until their own deadlines, for the process exits once
	// Consume returns, and a done mark lost then lets the effect repeat.
	for {
		n, until := c.recording.Pending()
		if n == 0 || !time.Now().Before(until) {
			break
		}
		if take(c.workers, min(time.Until(until), recordingPoll)) {
			return nil
		}
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
