package broker

import (
	"cmp"
	"context"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

const (
	// maxPendingAcks bounds the acks an acker keeps, whatever the
	// window (see acker and ackBudget): one frame for 32 deliveries
	// leaves little to save, and they are as many redeliveries when a
	// session is lost.
	maxPendingAcks = 32
	// maxHoldAck bounds how long an ack is kept (see acker): a few times
	// what a handler that writes to a database takes, so that the gaps
	// such handlers leave mostly close before it, and short beside the
	// redelivery a lost ack costs.
	maxHoldAck = 10 * time.Millisecond
)

// An acker sends the acks of the deliveries of one session's consume
// channel, coalesced: basic.ack with multiple set to the highest tag below
// which every delivery is settled, covering the acks waiting at or below
// it in one frame.
//
// The deliveries of a channel are tagged 1, 2, 3... in the order the
// server sends them, and a multiple ack of tag n settles every delivery of
// the channel at or below n that is not settled yet; if n itself is settled
// already, the server refuses it as an unknown tag and closes the channel.
// So the acker sends a multiple ack of n only once it knows the result of
// every tag up to n (ack, or a settlement of its own: nack, reject, or the
// ack after a confirmed copy, all of which are on the wire by then), and
// only for an n that waits for its ack. A tag it was not told of (a
// handler still running) is a gap: no multiple ack covers it, and the acks
// done above it are held until it closes, or until they must go, and then
// each goes alone, and counts as settled on its own.
//
// What keeping an ack costs, and so when it goes, is this:
//
//   - The server's window. A delivery whose ack is kept counts against
//     the prefetch count as one in its handler does: the window holds
//     the workers' deliveries and, beyond them, prefetch - workers more
//     that wait for a worker. Acks kept take the place of those; were
//     they all taken, a worker done would wait for the server to send
//     it the next one. So the acks kept, those of the run below any gap
//     and those held above one, are at most a budget: three quarters of
//     the deliveries the window holds beyond the workers'
//     (maxPendingAcks at most; none with a prefetch count at or below
//     the workers, where every ack kept would keep a worker waiting,
//     nor up to two above them, where three quarters of the spare
//     window is less than two). The last quarter is what the workers
//     draw on while the acks sent make the server fill the window
//     again. At the budget, the acker frees the window at the least
//     cost in frames: the run first, in one multiple ack, then held
//     acks alone, the highest first (those just above a gap are the
//     likeliest to join a run when it closes), only as many as it takes
//     to go below the budget. A gap longer than the budget's worth of
//     handlers costs a frame for each ack done behind it after that, as
//     an ack that was never kept does.
//   - Time. An ack is sent at most maxHoldAck after its handler returned
//     (a little more on a busy machine), alone if a gap below it is still
//     open then. A run goes whole, in one frame, when its first is due;
//     but each held ack has a bound of its own, so that one held just
//     before the first is due stays, and may still join a run. So
//     handlers that each take a few milliseconds and finish out of order
//     (a handler that writes to a database) leave gaps that mostly close
//     before the acks behind them must go; and a handler that never
//     returns delays each later ack by up to maxHoldAck, and no more
//     (RabbitMQ's consumer_timeout, 30 minutes by default, closes its
//     channel). With few deliveries, each ack waits that long for others
//     to join it.
//   - Redeliveries. Acks not sent yet when the session is lost are lost
//     with it: the server redelivers those deliveries, and Dedup takes
//     them for duplicates, as for an ack written just before a connection
//     dies. The budget bounds how many; the time bound does not add to
//     them. close sends them first: at a graceful shutdown, every ack is
//     sent before the channel closes, unless its write blocks (see
//     closeWithin).
//
// What the acker keeps of the deliveries behind a gap does not grow with
// their number: the tags settled are kept as ranges, split only by the
// deliveries still in their handlers (at most the prefetch count) and the
// acks held.
//
// The acker is the Acknowledger of the deliveries it adopted: their own
// settlements (Nack, Reject, and Ack, one at a time) go through it to the
// channel, and it counts them as settled once they are sent. It runs one
// goroutine, from newAcker to close.
type acker struct {
	queue string
	obs   *Observer
	log   *slog.Logger
	// budget is the bound on the acks kept, those of the run and those
	// held.
	budget int

	wake  chan struct{} // cap 1
	quit  chan struct{} // closed by close
	ended chan struct{} // closed when the goroutine ends

	mu     sync.Mutex
	to     amqp.Acknowledger // the channel: that of the first delivery adopted
	closed bool
	// next is the lowest tag whose result is not known. Every tag below
	// it is settled, or has its ack in run.
	next uint64
	// The tags above next whose result is known: held, the acks held,
	// each with the time it was held; own, those settled on their own
	// (sent alone, nacked, rejected), as ranges in order, apart from one
	// another. Between two ranges lies a tag whose result is not known (a
	// delivery in its handler, of which the server's prefetch window
	// bounds the number) or a held ack (at most budget): so own stays
	// small whatever the number of deliveries behind a handler that never
	// returns.
	held map[uint64]time.Time
	own  []span
	// run is the highest tag below next whose ack is not sent (0: none);
	// runN is the number of acks a multiple ack of run sends, the first
	// of them kept since runSince.
	run      uint64
	runN     int
	runSince time.Time
}

// A span is the tags from lo to hi.
type span struct{ lo, hi uint64 }

// newAcker returns the acker of a session consuming with prefetch, its
// deliveries handled by workers, and starts its goroutine.
func newAcker(queue string, prefetch, workers int, obs *Observer, log *slog.Logger) *acker {
	a := makeAcker(queue, prefetch, workers, obs, log)
	go a.loop()
	return a
}

// makeAcker returns an acker whose goroutine is not started: its acks are
// sent by calls of flush.
func makeAcker(queue string, prefetch, workers int, obs *Observer, log *slog.Logger) *acker {
	return &acker{
		queue:  queue,
		obs:    obs,
		log:    log,
		budget: ackBudget(prefetch, workers),
		wake:   make(chan struct{}, 1),
		quit:   make(chan struct{}),
		ended:  make(chan struct{}),
		next:   1,
		held:   make(map[uint64]time.Time),
	}
}

// ackBudget returns the budget of the acks an acker keeps for a session
// consuming with prefetch and workers (see acker): three quarters of the
// deliveries the window holds beyond the workers', rounded down, at most
// maxPendingAcks, and at least 1 (the acks go as soon as they come).
func ackBudget(prefetch, workers int) int {
	return max(1, min(maxPendingAcks, (prefetch-workers)*3/4))
}

// adopt makes a the Acknowledger of d, which came on a's channel.
func (a *acker) adopt(d *amqp.Delivery) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.to == nil:
		a.to = d.Acknowledger
	case a.to != d.Acknowledger:
		// Not from a's channel: its tags are not a's. It is settled
		// on its own, and is never covered by a multiple ack of a's.
		return
	}
	d.Acknowledger = a
}

// ackLater acks d: through its session's acker, coalesced, if it has one;
// otherwise at once. An error means the ack was not sent and will not be.
func ackLater(d *amqp.Delivery) error {
	if a, ok := d.Acknowledger.(*acker); ok {
		return a.later(d.DeliveryTag)
	}
	return d.Ack(false)
}

// later records the ack of tag, to be sent by a's goroutine.
func (a *acker) later(tag uint64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return amqp.ErrClosed
	}
	a.record(tag, true)
	return nil
}

// Ack implements amqp.Acknowledger: it acks tag alone, now.
func (a *acker) Ack(tag uint64, multiple bool) error {
	err := a.to.Ack(tag, multiple)
	a.observe(1, err)
	a.settled(tag)
	return err
}

// Nack implements amqp.Acknowledger.
func (a *acker) Nack(tag uint64, multiple, requeue bool) error {
	err := a.to.Nack(tag, multiple, requeue)
	a.settled(tag)
	return err
}

// Reject implements amqp.Acknowledger.
func (a *acker) Reject(tag uint64, requeue bool) error {
	err := a.to.Reject(tag, requeue)
	a.settled(tag)
	return err
}

// settled records tag as settled on its own. (A multiple settlement, which
// the consumer never makes, would settle tags a does not know of: their
// acks would then be refused, as a second ack of a tag is.)
func (a *acker) settled(tag uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.record(tag, false)
}

// record records the result of tag: an ack to send (ack), or a settlement
// made already. A second result for a tag is ignored: a tag is settled
// once. a.mu must be held.
func (a *acker) record(tag uint64, ack bool) {
	if tag < a.next || a.known(tag) {
		return
	}
	if tag > a.next {
		if !ack {
			a.settle(tag)
			return
		}
		a.held[tag] = time.Now()
		if len(a.held) == 1 || a.runN+len(a.held) == a.budget {
			a.signal() // to arm the timer, or send them
		}
		return
	}
	// tag == a.next: the run grows over it and the results above it.
	n := a.runN
	if ack {
		a.run, a.runN = tag, a.runN+1
	}
	if n == 0 && a.runN > 0 {
		a.runSince = time.Now()
	}
	a.next++
	for {
		if since, ok := a.held[a.next]; ok {
			// A held ack keeps its age in the run.
			delete(a.held, a.next)
			if a.runN == 0 || since.Before(a.runSince) {
				a.runSince = since
			}
			a.run, a.runN = a.next, a.runN+1
			a.next++
			continue
		}
		if len(a.own) > 0 && a.own[0].lo == a.next {
			a.next = a.own[0].hi + 1
			a.own = slices.Delete(a.own, 0, 1)
			continue
		}
		break
	}
	if (n == 0 && a.runN > 0) || (ack && a.runN+len(a.held) == a.budget) {
		a.signal() // to arm the timer for the run, or send it
	}
}

// known reports whether the result of tag, above next, is known. a.mu
// must be held.
func (a *acker) known(tag uint64) bool {
	if _, ok := a.held[tag]; ok {
		return true
	}
	i := a.spanAfter(tag)
	return i > 0 && a.own[i-1].hi >= tag
}

// spanAfter returns the index of the first of a.own that starts above tag.
func (a *acker) spanAfter(tag uint64) int {
	i, _ := slices.BinarySearchFunc(a.own, tag+1, func(s span, t uint64) int {
		return cmp.Compare(s.lo, t)
	})
	return i
}

// settle adds tag, above next and not known, to the tags settled on their
// own. a.mu must be held.
func (a *acker) settle(tag uint64) {
	i := a.spanAfter(tag)
	after := i > 0 && a.own[i-1].hi+1 == tag
	before := i < len(a.own) && a.own[i].lo == tag+1
	switch {
	case after && before:
		a.own[i-1].hi = a.own[i].hi
		a.own = slices.Delete(a.own, i, i+1)
	case after:
		a.own[i-1].hi = tag
	case before:
		a.own[i].lo = tag
	default:
		a.own = slices.Insert(a.own, i, span{tag, tag})
	}
}

func (a *acker) signal() {
	select {
	case a.wake <- struct{}{}:
	default:
	}
}

// loop sends the acks until close.
func (a *acker) loop() {
	defer close(a.ended)
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		select {
		case <-a.wake:
		case <-t.C:
		case <-a.quit:
			a.flush(true)
			return
		}
		if wait := a.flush(false); wait > 0 {
			t.Reset(wait)
		}
	}
}

// flush sends the acks that are due, or all of them (all). It returns
// how long the acks kept may wait still (0: none is kept).
func (a *acker) flush(all bool) (wait time.Duration) {
	a.mu.Lock()
	to := a.to
	now := time.Now()
	kept := a.runN + len(a.held)
	var run uint64
	var n int
	if a.runN > 0 {
		if w := maxHoldAck - now.Sub(a.runSince); all || kept >= a.budget || w <= 0 {
			run, n = a.run, a.runN
			a.run, a.runN = 0, 0
			kept -= n
		} else {
			wait = w
		}
	}
	var lone []uint64
	if len(a.held) > 0 {
		// The highest first: those just above a gap are the likeliest
		// to join a run soon.
		tags := slices.Sorted(maps.Keys(a.held))
		for _, tag := range slices.Backward(tags) {
			if w := maxHoldAck - now.Sub(a.held[tag]); all || kept >= a.budget || w <= 0 {
				lone = append(lone, tag)
				delete(a.held, tag)
				a.settle(tag) // on its own, next
				kept--
			} else if wait == 0 || w < wait {
				wait = w
			}
		}
	}
	a.mu.Unlock()
	if run != 0 {
		// The multiple ack covers only tags below next, and lone only
		// tags above it: their order does not matter.
		a.send(to, run, n)
	}
	for _, tag := range lone {
		a.send(to, tag, 1)
	}
	return wait
}

// send acks tag, with multiple for the n deliveries up to it.
func (a *acker) send(to amqp.Acknowledger, tag uint64, n int) {
	err := to.Ack(tag, n > 1)
	a.observe(n, err)
	if err != nil {
		// The channel is gone: the server redelivers them.
		a.log.LogAttrs(context.Background(), slog.LevelDebug, "broker: ack not sent",
			slog.Uint64("delivery_tag", tag), slog.Int("deliveries", n), slog.String("error", err.Error()))
	}
}

func (a *acker) observe(n int, err error) {
	if a.obs != nil && a.obs.Ack != nil {
		a.obs.Ack(AckEvent{Queue: a.queue, Deliveries: n, Err: err})
	}
}

// close sends the acks not sent yet, refuses any later one, and ends a's
// goroutine. The acks are sent before close returns: the channel must stay
// open until then, but for a session lost already.
func (a *acker) close() {
	a.shut()
	<-a.ended
}

// closeWithin is close, but it waits at most d for the acks to be written.
// A write still blocked then (the server no longer reads the socket, or
// another write holds the connection) would hold the channel open for
// ever: closeWithin calls closeChannel, which must end it, and then waits
// for a's goroutine. Those acks are lost, as at a connection loss.
func (a *acker) closeWithin(d time.Duration, closeChannel func()) {
	a.shut()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-a.ended:
	case <-t.C:
		a.log.LogAttrs(context.Background(), slog.LevelWarn, "broker: acks still being written; closing the connection",
			slog.Duration("waited", d))
		closeChannel()
		<-a.ended
	}
}

// shut refuses later acks and tells a's goroutine to send the acks not
// sent yet, and end. It may be called more than once.
func (a *acker) shut() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.closed {
		a.closed = true
		close(a.quit)
	}
}

// kept returns the number of entries a keeps for the tags above next,
// for tests.
func (a *acker) kept() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.held) + len(a.own)
}
