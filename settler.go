package rabbitmw

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrSettlerClosed is returned by [Settler.Settle] for a delayed delivery
// that a closed Settler could not hold; the delivery was requeued at once.
var ErrSettlerClosed = errors.New("rabbitmw: settler closed")

// defaultMaxHeld is SettlerOptions.MaxHeld's default: far above the prefetch
// of a usual consumer, so that it only bounds a channel without one.
const defaultMaxHeld = 1024

// SettlerOptions configures a [Settler]. The zero value means the defaults.
type SettlerOptions struct {
	// MaxHeld is the most deliveries the Settler holds for their delays
	// at once; 0 means 1024. With the prefetch of the channels it settles
	// for at or below MaxHeld, Settle never waits: the server sends no
	// more deliveries once every prefetch slot is taken.
	MaxHeld int
	// OnError, if set, is called with each held delivery whose requeue
	// failed, and the error; nil drops these errors. A requeue fails when
	// the channel is gone, and then RabbitMQ has requeued the delivery
	// already. OnError runs on the goroutine that requeued the delivery
	// (a timer's, or Close's), so it must be quick and safe for concurrent
	// use. It must not settle d.
	OnError func(d *amqp.Delivery, err error)
}

// A Settler settles deliveries from a plain amqp091 channel by [Decide], as
// [Settle] does, except that it never waits out a Delay in the caller's
// goroutine: it holds the delivery, unsettled, and requeues it (a nack with
// requeue) from a timer when the delay ends. A loop that receives
// deliveries one by one therefore goes on to the next one at once, however
// long the delays of the ones before it:
//
//	s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
//	defer s.Close()
//	for d := range deliveries {
//		s.Settle(ctx, &d, h.Handle(ctx, &d))
//	}
//
// A held delivery keeps its prefetch slot until it is requeued, as with
// Settle, and counts towards RabbitMQ's consumer_timeout: keep the delays
// below it. The limits of DeadLetter on a plain channel are Settle's.
//
// At most [SettlerOptions.MaxHeld] deliveries are held at once. When that
// many are, Settle waits for one of them to be requeued. It does not
// requeue the new delivery at once instead: its delay is a backoff, or a
// wait for a busy or unreachable store, and a requeue at once would bring
// it straight back, in a hot loop that burns its attempts and hammers what
// is failing. Waiting slows the consumer, as a full prefetch does.
//
// A Settler is safe for concurrent use: several loops may share one. Its
// timers' goroutines, which requeue the held deliveries, end when the
// deliveries are requeued; Close requeues the rest at once.
type Settler struct {
	onError func(*amqp.Delivery, error)
	room    chan struct{}  // a token for each held delivery
	closing chan struct{}  // closed by Close
	pending sync.WaitGroup // held deliveries not yet requeued

	mu     sync.Mutex
	closed bool
	held   map[*heldDelivery]struct{}
}

// heldDelivery is a delivery that waits out its delay.
type heldDelivery struct {
	d     *amqp.Delivery
	dec   Decision
	timer *time.Timer // requeues d when the delay ends
}

// NewSettler returns a Settler. It panics if opts.MaxHeld is negative.
func NewSettler(opts SettlerOptions) *Settler {
	n := opts.MaxHeld
	switch {
	case n < 0:
		panic("rabbitmw: NewSettler: SettlerOptions.MaxHeld " + strconv.Itoa(n) + " is negative")
	case n == 0:
		n = defaultMaxHeld
	}
	return &Settler{
		onError: opts.OnError,
		room:    make(chan struct{}, n),
		closing: make(chan struct{}),
		held:    make(map[*heldDelivery]struct{}),
	}
}

// Settle settles d by [Decide](err), as the function [Settle] does, but holds
// a delayed delivery instead of waiting: it returns at once, and d is
// requeued when its delay ends, or when the Settler is closed. The caller
// must not modify d until then.
//
// Settle waits only while MaxHeld deliveries are held, until one of them is
// requeued, and ctx bounds that wait: if ctx is done first, Settle
// requeues d at once and returns ctx's error joined to the requeue's
// result. A done ctx does not stop Settle from holding d when there is room.
// On a closed Settler, a delayed delivery is requeued at once and the
// error wraps [ErrSettlerClosed].
//
// Settle returns the error of the Ack, Nack or Reject call it made, if any
// (a held delivery's requeue is later; its error goes to
// [SettlerOptions.OnError]). It must be called once per delivery.
func (s *Settler) Settle(ctx context.Context, d *amqp.Delivery, err error) error {
	if d == nil {
		return ErrNoDelivery
	}
	dec := Decide(err)
	if dec.Outcome != Delay {
		return settleNow(d, dec)
	}
	select {
	case s.room <- struct{}{}:
	default:
		if ctx == nil {
			ctx = context.Background()
		}
		select {
		case s.room <- struct{}{}:
		case <-ctx.Done():
			return settled(d, dec, errors.Join(ctx.Err(), d.Nack(false, true)))
		case <-s.closing:
			return settled(d, dec, errors.Join(ErrSettlerClosed, d.Nack(false, true)))
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		<-s.room
		return settled(d, dec, errors.Join(ErrSettlerClosed, d.Nack(false, true)))
	}
	h := &heldDelivery{d: d, dec: dec}
	s.held[h] = struct{}{}
	s.pending.Add(1)
	h.timer = time.AfterFunc(dec.Delay, func() {
		defer s.pending.Done()
		s.requeue(h)
	})
	return nil
}

// requeue requeues a held delivery and frees its room.
func (s *Settler) requeue(h *heldDelivery) {
	err := settleNow(h.d, h.dec)
	s.mu.Lock()
	delete(s.held, h)
	s.mu.Unlock()
	<-s.room
	if err != nil && s.onError != nil {
		s.onError(h.d, err)
	}
}

// Close requeues at once every delivery still held, ends the wait of any
// Settle for room (that delivery is requeued too), and returns when every
// requeue has returned and no goroutine of s is left. Close it before the
// channel, so that the requeues reach the server; if the channel is gone
// first, nothing is lost: RabbitMQ requeues what a closed channel left
// unsettled. Close may be called more than once.
func (s *Settler) Close() {
	s.mu.Lock()
	if !s.closed {
		s.closed = true
		close(s.closing)
	}
	var stopped []*heldDelivery // their timers will never fire: Close requeues them
	for h := range s.held {
		if h.timer.Stop() {
			stopped = append(stopped, h)
		}
	}
	s.mu.Unlock()
	for _, h := range stopped {
		s.requeue(h)
		s.pending.Done()
	}
	s.pending.Wait()
}
