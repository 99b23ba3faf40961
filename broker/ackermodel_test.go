package broker

import (
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A strictChannel is an amqp.Acknowledger that plays a RabbitMQ channel
// and knows what the consumer's handlers did: which deliveries are still
// in their handlers, which acks were asked for (ackLater) and when, and
// which settlements of their own are being sent. It records as a fault
// every frame that would lose a message or close the channel: a multiple
// ack over a delivery still in its handler, or over one whose settlement
// of its own is not on the wire yet; a frame for a tag settled already
// (unknown to the server), or for a delivery in its handler; and, if
// timed, an ack sent more than maxHoldAck after it was asked for.
type strictChannel struct {
	settleBy // c.frame
	timed    bool

	mu      sync.Mutex
	open    map[uint64]*tagState // delivered, not settled
	settled map[uint64]int
	faults  []string
	freed   chan struct{} // cap 1: a settlement freed the window
}

// The state of a delivery not settled. The zero value: in its handler.
type tagState struct {
	ack   bool      // its ack was asked for
	asked time.Time // when, if ack
	own   string    // "ack", "nack", "reject": its own settlement is being sent
}

func newStrictChannel(timed bool) *strictChannel {
	c := &strictChannel{
		timed:   timed,
		open:    make(map[uint64]*tagState),
		settled: make(map[uint64]int),
		freed:   make(chan struct{}, 1),
	}
	c.settleBy = c.frame
	return c
}

// deliver records that tag is delivered, and in its handler.
func (c *strictChannel) deliver(tag uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.open[tag] = &tagState{}
}

// unsettled returns the number of deliveries not settled.
func (c *strictChannel) unsettled() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.open)
}

// askAck records that tag's handler returned and its ack is asked for.
func (c *strictChannel) askAck(tag uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.open[tag].ack, c.open[tag].asked = true, time.Now()
}

// refused records that the ack of tag was refused (the acker is closed):
// the delivery stays unsettled, as in its handler.
func (c *strictChannel) refused(tag uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.open[tag].ack = false
}

// sendOwn records that tag is about to be settled on its own, by kind.
func (c *strictChannel) sendOwn(tag uint64, kind string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.open[tag].own = kind
}

// frame plays the server, for Ack, Nack and Reject (settleBy). c.mu
// must not be held.
func (c *strictChannel) frame(kind string, tag uint64, multiple bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	name := fmt.Sprintf("%s %d", kind, tag)
	if multiple {
		name += " multiple"
	}
	st, ok := c.open[tag]
	switch {
	case !ok:
		c.faults = append(c.faults, name+": unknown delivery tag (settled already, or never delivered)")
		return
	case multiple && (kind != "ack" || !st.ack):
		c.faults = append(c.faults, name+": a multiple settlement at a tag whose ack was not asked for")
		return
	case !multiple && !(kind == "ack" && st.ack) && st.own != kind:
		c.faults = append(c.faults, fmt.Sprintf("%s: the delivery's handler asked for no such settlement (%+v)", name, *st))
		return
	}
	tags := []uint64{tag}
	if multiple {
		tags = tags[:0]
		for t, s := range c.open {
			if t > tag {
				continue
			}
			if !s.ack {
				c.faults = append(c.faults, fmt.Sprintf("%s covers delivery %d, whose ack was not asked for (%+v): lost", name, t, *s))
			}
			tags = append(tags, t)
		}
	}
	for _, t := range tags {
		if s := c.open[t]; c.timed && s.ack && s.own == "" {
			if waited := time.Since(s.asked); waited > maxHoldAck {
				c.faults = append(c.faults, fmt.Sprintf("%s: the ack of %d sent %v after it was asked for; want at most %v", name, t, waited, maxHoldAck))
			}
		}
		delete(c.open, t)
		c.settled[t]++
	}
	select {
	case c.freed <- struct{}{}:
	default:
	}
}

// check fails t on any fault, and on a delivery among tags settled other
// than once.
func (c *strictChannel) check(t *testing.T, tags map[uint64]int) {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, f := range c.faults {
		t.Error(f)
	}
	for tag, want := range tags {
		if got := c.settled[tag]; got != want {
			t.Errorf("delivery %d settled %d times; want %d", tag, got, want)
		}
	}
}

// settleAt settles d as kind says ("later": ackLater; "ack", "nack",
// "reject": on its own), telling c first, and reports whether the
// settlement was taken (an acker closed refuses an ack). It may be called
// from any goroutine: it fails t, but does not stop it.
func settleAt(t *testing.T, c *strictChannel, d *amqp.Delivery, kind string) bool {
	t.Helper()
	var err error
	switch kind {
	case "later":
		c.askAck(d.DeliveryTag)
		if err = ackLater(d); err != nil {
			assert.ErrorIs(t, err, amqp.ErrClosed, "ackLater(%d)", d.DeliveryTag)
			c.refused(d.DeliveryTag)
			return false
		}
	case "ack":
		c.sendOwn(d.DeliveryTag, kind)
		err = d.Ack(false)
	case "nack":
		c.sendOwn(d.DeliveryTag, kind)
		err = d.Nack(false, true)
	case "reject":
		c.sendOwn(d.DeliveryTag, kind)
		err = d.Reject(false)
	}
	assert.NoError(t, err, "%s of %d", kind, d.DeliveryTag)
	return true
}

// randomKind draws a settlement: mostly an ack through the acker, some
// nacks, rejects and acks of their own (after a confirmed copy).
func randomKind(rng *rand.Rand) string {
	switch r := rng.IntN(100); {
	case r < 6:
		return "nack"
	case r < 10:
		return "reject"
	case r < 18:
		return "ack"
	default:
		return "later"
	}
}

// The windows the random tests run the acker with: a budget of one (no
// prefetch window, one below, at and just above the workers, a single
// worker), of two, the default's 12, and maxPendingAcks.
var ackerWindows = []struct{ prefetch, workers int }{
	{0, 16}, {4, 8}, {16, 16}, {17, 16}, {2, 1}, {19, 16}, {32, 16}, {128, 16},
}

// eachAckerWindow runs f in a synctest bubble for each of ackerWindows
// and seeds 0 to seeds-1.
func eachAckerWindow(t *testing.T, seeds uint64, f func(t *testing.T, prefetch, workers int, seed uint64)) {
	for _, w := range ackerWindows {
		for seed := range seeds {
			t.Run(fmt.Sprintf("prefetch=%d/workers=%d/seed=%d", w.prefetch, w.workers, seed), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) { f(t, w.prefetch, w.workers, seed) })
			})
		}
	}
}

// Random settlements of deliveries in a window, in any order, nacks,
// rejects and acks of their own among the acks, with the clock moving on
// by whole milliseconds (so that time bounds often fall on the instant a
// gap closes), the test calling flush as the acker's goroutine would,
// after every step. No frame loses a message or names a tag settled
// already; after every flush the acks kept are fewer than the budget and
// none has waited maxHoldAck; at the end every delivery is settled once,
// and the acker keeps nothing.
func TestAckerRandomBookkeeping(t *testing.T) {
	eachAckerWindow(t, 20, randomBookkeeping)
}

func randomBookkeeping(t *testing.T, prefetch, workers int, seed uint64) {
	const n = 600
	rng := rand.New(rand.NewPCG(seed, 7))
	c := newStrictChannel(false) // the test flushes after the clock moved
	a := makeAcker("q", prefetch, workers, &Observer{}, slog.New(slog.DiscardHandler))
	window := prefetch
	if window == 0 {
		window = 64 // no limit: as many as the test keeps in flight
	}
	var inHandler []*amqp.Delivery
	want := make(map[uint64]int)
	next := uint64(1)
	for decided := 0; decided < n; {
		for c.unsettled() < window && next <= n {
			d := &amqp.Delivery{Acknowledger: c, DeliveryTag: next}
			c.deliver(next)
			a.adopt(d)
			inHandler = append(inHandler, d)
			next++
		}
		switch r := rng.IntN(10); {
		case r < 7 && len(inHandler) > 0:
			// Mostly one of the oldest few: handlers finish nearly in
			// order; sometimes any of them.
			i := min(len(inHandler)-1, int(rng.ExpFloat64()*3))
			if rng.IntN(5) == 0 {
				i = rng.IntN(len(inHandler))
			}
			d := inHandler[i]
			inHandler = append(inHandler[:i], inHandler[i+1:]...)
			require.True(t, settleAt(t, c, d, randomKind(rng)), "settle")
			want[d.DeliveryTag] = 1
			decided++
		case r < 9:
			time.Sleep(time.Duration(rng.IntN(7)) * time.Millisecond)
		}
		a.flush(false)
		a.mu.Lock()
		kept := a.runN + len(a.held)
		a.mu.Unlock()
		if kept >= a.budget {
			t.Fatalf("after a flush, %d acks kept; want fewer than the budget, %d", kept, a.budget)
		}
		c.mu.Lock()
		for tag, s := range c.open {
			if s.ack && time.Since(s.asked) >= maxHoldAck {
				t.Errorf("after a flush, the ack of %d kept for %v; want less than %v", tag, time.Since(s.asked), maxHoldAck)
			}
		}
		c.mu.Unlock()
		if t.Failed() {
			break
		}
	}
	a.flush(true)
	c.check(t, want)
	assert.Equal(t, 0, a.kept(), "entries kept at the end")
}

// The acker's goroutine, with workers whose handlers take whole
// milliseconds (often as long as maxHoldAck, so that a time bound falls
// on the instant a gap closes) behind a prefetch window, settling at
// random; in some runs the acker is closed while the workers are still
// at it, as at a shutdown or a lost session. No frame loses a message or
// names a tag settled already, no ack waits longer than maxHoldAck, every
// ack the acker took is sent once, by close at the latest, and those it
// refused are not sent; whenever the clock moves on, the acks kept are
// fewer than the budget; the goroutines end.
func TestAckerRandomConcurrent(t *testing.T) {
	eachAckerWindow(t, 6, randomConcurrent)
}

func randomConcurrent(t *testing.T, prefetch, workers int, seed uint64) {
	const n = 1500
	rng := rand.New(rand.NewPCG(seed, 11))
	took := make([]time.Duration, n+1)
	kinds := make([]string, n+1)
	for tag := range took {
		took[tag] = time.Duration(rng.IntN(int(2*maxHoldAck/time.Millisecond)+1)) * time.Millisecond
		kinds[tag] = randomKind(rng)
	}
	closeAt := uint64(n + 1) // never: close once all are settled
	if seed%2 == 1 {
		closeAt = uint64(1 + rng.IntN(n))
	}
	c := newStrictChannel(true)
	a := newAcker("q", prefetch, workers, &Observer{}, slog.New(slog.DiscardHandler))
	window := prefetch
	if window == 0 {
		window = 4 * workers
	}
	start := time.Now()
	closing := make(chan struct{})
	deliveries := make(chan uint64)
	go func() { // the server: ends when it has delivered n, or at closing
		defer close(deliveries)
		for tag := uint64(1); tag <= n; {
			if c.unsettled() >= window {
				select {
				case <-c.freed:
					continue
				case <-closing:
					return
				}
			}
			c.deliver(tag)
			select {
			case deliveries <- tag:
				tag++
			case <-closing:
				return
			}
		}
	}()
	var mu sync.Mutex
	want := make(map[uint64]int)
	var closeOnce sync.Once
	shut := func() {
		closeOnce.Do(func() {
			close(closing)
			a.close()
		})
	}
	// At every instant, once the goroutines are blocked (every handler
	// takes whole milliseconds), the acks kept are fewer than the budget.
	watched := make(chan struct{})
	watching := make(chan struct{})
	go func() { // ends at watched
		defer close(watching)
		for {
			synctest.Wait()
			a.mu.Lock()
			kept := a.runN + len(a.held)
			a.mu.Unlock()
			if kept >= a.budget {
				t.Errorf("at %v, %d acks kept; want fewer than the budget, %d", time.Since(start), kept, a.budget)
			}
			select {
			case <-watched:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for tag := range deliveries {
				d := &amqp.Delivery{Acknowledger: c, DeliveryTag: tag}
				a.adopt(d)
				time.Sleep(took[tag])
				taken := settleAt(t, c, d, kinds[tag])
				mu.Lock()
				if taken {
					want[tag] = 1
				} else {
					want[tag] = 0
				}
				mu.Unlock()
				if tag == closeAt {
					shut()
				}
			}
		})
	}
	wg.Wait()
	close(watched)
	<-watching
	shut()
	c.check(t, want)
	if closeAt > n {
		assert.Len(t, want, n, "deliveries settled")
	}
}
