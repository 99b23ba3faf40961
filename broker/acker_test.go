package broker

import (
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// settleBy is an amqp.Acknowledger that hands each settlement to its
// function, with its kind: "ack", "nack" or "reject". The fake channels
// of these tests embed it.
type settleBy func(kind string, tag uint64, multiple bool)

func (f settleBy) Ack(tag uint64, multiple bool) error {
	f("ack", tag, multiple)
	return nil
}

func (f settleBy) Nack(tag uint64, multiple, _ bool) error {
	f("nack", tag, multiple)
	return nil
}

func (f settleBy) Reject(tag uint64, _ bool) error {
	f("reject", tag, false)
	return nil
}

// A modelChannel is an amqp.Acknowledger that settles deliveries 1 to n as
// a RabbitMQ channel does, and records the frames it takes and the unknown
// delivery tags it refuses (RabbitMQ would close the channel).
type modelChannel struct {
	settleBy // m.settle

	mu      sync.Mutex
	unacked map[uint64]bool
	settled map[uint64]int
	frames  []string
	unknown []string
	acks    int // ack frames
	acked   int // deliveries they settled
}

func newModelChannel(n int) *modelChannel {
	m := &modelChannel{unacked: make(map[uint64]bool), settled: make(map[uint64]int)}
	m.settleBy = m.settle
	for tag := range uint64(n) {
		m.unacked[tag+1] = true
	}
	return m
}

func (m *modelChannel) settle(kind string, tag uint64, multiple bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	frame := kind + " " + strconv.FormatUint(tag, 10)
	if multiple {
		frame += " multiple"
	}
	m.frames = append(m.frames, frame)
	if !m.unacked[tag] {
		m.unknown = append(m.unknown, frame)
		return
	}
	tags := []uint64{tag}
	if multiple {
		tags = tags[:0]
		for t := range m.unacked {
			if t <= tag {
				tags = append(tags, t)
			}
		}
	}
	for _, t := range tags {
		delete(m.unacked, t)
		m.settled[t]++
	}
	if kind == "ack" {
		m.acks++
		m.acked += len(tags)
	}
}

// takeFrames returns the frames taken since the last call.
func (m *modelChannel) takeFrames() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	f := m.frames
	m.frames = nil
	return f
}

// check fails t if a frame had an unknown tag, or a delivery among the
// first n was not settled exactly once.
func (m *modelChannel) check(t *testing.T, n int) {
	t.Helper()
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.unknown) > 0 {
		t.Errorf("frames with an unknown delivery tag: %v; want none", m.unknown)
	}
	for tag := range uint64(n) {
		if got := m.settled[tag+1]; got != 1 {
			t.Errorf("delivery %d settled %d times; want 1", tag+1, got)
		}
	}
}

// The acker's bookkeeping, step by step, with flush called by the test.
// Steps: a3 the handler's ack of tag 3 (coalesced), n3 a nack, r3 a
// reject, c3 the ack after a confirmed copy (alone); f flush, F flush at
// close; 9ms the clock moves on. Prefetch 16 and 10 workers: a budget of
// 4 acks kept, and maxHoldAck 10 ms.
func TestAckerBookkeeping(t *testing.T) {
	tests := []struct {
		name  string
		steps string
		want  string // the frames after each flush, | between flushes
	}{
		{"one is kept", "a1 f", ""},
		{"one at the time bound", "a1 f 10ms f", " | ack 1"},
		{"in order, at the count bound", "a1 a2 a3 f a4 f", " | ack 4 multiple"},
		{"in order, at the time bound", "a1 a2 f 9ms f 1ms f", " |  | ack 2 multiple"},
		{"close sends the run", "a1 a2 a3 F", "ack 3 multiple"},
		{"flush with nothing new", "a1 F f", "ack 1 | "},
		{"in any order below the top", "a3 a1 a2 F", "ack 3 multiple"},
		{"gap waits", "a2 a3 f a1 F", " | ack 3 multiple"},
		{"a nack in the middle goes alone, the run around it", "a1 n2 a3 F", "nack 2 ack 3 multiple"},
		{"a nack at the top: the run ends below it", "a1 a2 n3 F", "nack 3 ack 2 multiple"},
		{"a reject in the middle", "a1 r2 a3 a4 F", "reject 2 ack 4 multiple"},
		{"the ack after a copy goes alone", "a1 c2 a3 F", "ack 2 ack 3 multiple"},
		{"only settlements of their own", "n1 c2 F", "nack 1 ack 2"},
		{"a lone ack in the run is sent alone", "n1 a2 n3 F", "nack 1 nack 3 ack 2"},
		{"two gaps, filled", "a2 a4 a1 a3 F", "ack 4 multiple"},
		{"two gaps, at the time bound", "a2 a4 a1 10ms f a3 F", "ack 2 multiple ack 4 | ack 3"},
		{"two gaps, runs of several", "a2 a4 a5 a1 a3 F", "ack 5 multiple"},
		{"a second result is ignored", "a1 a1 F c2 a2 F", "ack 1 | ack 2"},
		{"at the budget, the highest held goes alone", "a2 a3 a4 f a5 f a1 F", " | ack 5 | ack 4 multiple"},
		{"at the budget, as many as it takes", "a2 a3 a4 a5 a6 f a1 F", "ack 6 ack 5 | ack 4 multiple"},
		{"at the budget, the run goes first", "a1 a2 a4 a5 f a3 F", "ack 2 multiple | ack 5 multiple"},
		{"the budget counts the run and the held", "a1 a2 a4 f a5 f a3 F", " | ack 2 multiple | ack 5 multiple"},
		{"time bound: held acks go alone", "a2 a3 f 10ms f a1 F", " | ack 3 ack 2 | ack 1"},
		{"time bound not reached", "a2 f 9ms f a1 F", " |  | ack 2 multiple"},
		{"each held ack has its own time bound", "a2 9ms a3 1ms f a1 F", "ack 2 | ack 3 multiple"},
		{"held acks keep their age in the run", "a2 9ms a1 f 1ms f", " | ack 2 multiple"},
		{"lone acks, then a run over them", "a2 a3 10ms f a1 a4 F", "ack 3 ack 2 | ack 4 multiple"},
		{"close sends the run and the held", "a1 a3 a4 F", "ack 1 ack 4 ack 3"},
		{"held acks, then a nack above them", "a2 a3 n4 a1 F", "nack 4 ack 3 multiple"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ch := newModelChannel(0)
				a := makeAcker("q", 16, 10, &Observer{}, slog.New(slog.DiscardHandler))
				var got []string
				var frames []string
				for _, step := range strings.Fields(tt.steps) {
					switch step {
					case "f", "F":
						a.flush(step == "F")
						frames = append(frames, ch.takeFrames()...)
						got = append(got, strings.Join(frames, " "))
						frames = nil
						continue
					}
					if d, err := time.ParseDuration(step); err == nil {
						time.Sleep(d)
						continue
					}
					tag, err := strconv.ParseUint(step[1:], 10, 64)
					require.NoError(t, err, "step %q", step)
					ch.mu.Lock()
					if ch.settled[tag] == 0 {
						ch.unacked[tag] = true
					}
					ch.mu.Unlock()
					d := &amqp.Delivery{Acknowledger: ch, DeliveryTag: tag}
					a.adopt(d)
					switch step[0] {
					case 'a':
						require.NoError(t, ackLater(d), "ackLater")
					case 'n':
						require.NoError(t, d.Nack(false, true), "Nack")
					case 'r':
						require.NoError(t, d.Reject(false), "Reject")
					case 'c':
						require.NoError(t, d.Ack(false), "Ack")
					}
					frames = append(frames, ch.takeFrames()...)
				}
				if g := strings.Join(got, " | "); g != tt.want {
					t.Errorf("frames = %q; want %q", g, tt.want)
				}
				ch.mu.Lock()
				defer ch.mu.Unlock()
				if len(ch.unknown) > 0 {
					t.Errorf("frames with an unknown delivery tag: %v; want none", ch.unknown)
				}
			})
		})
	}
}

// The budget of the acks kept is three quarters of the window beyond the
// workers, at most maxPendingAcks, and at least one.
func TestAckBudget(t *testing.T) {
	for _, tt := range []struct{ prefetch, workers, want int }{
		{1, 1, 1}, {16, 16, 1}, {8, 16, 1}, {17, 16, 1}, {18, 16, 1}, {19, 16, 2},
		{32, 16, 12}, {32, 10, 16}, {64, 32, 24}, {128, 64, 32}, {65535, 16, 32},
	} {
		if got := ackBudget(tt.prefetch, tt.workers); got != tt.want {
			t.Errorf("ackBudget(%d, %d) = %d; want %d", tt.prefetch, tt.workers, got, tt.want)
		}
	}
}

// The acker's goroutine sends the acks kept at the bounds, with no flush
// from the test: a run at the time bound, a held ack at the time bound, a
// run at the budget.
func TestAckerGoroutine(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 27
		ch := newModelChannel(n)
		a := newAcker("q", 64, 32, &Observer{}, slog.New(slog.DiscardHandler)) // a budget of 24
		defer a.close()
		ds := make([]*amqp.Delivery, n+1)
		for tag := 1; tag <= n; tag++ {
			ds[tag] = &amqp.Delivery{Acknowledger: ch, DeliveryTag: uint64(tag)}
			a.adopt(ds[tag])
		}
		require.NoError(t, ackLater(ds[1]), "ackLater")
		require.NoError(t, ackLater(ds[2]), "ackLater")
		start := time.Now()
		synctest.Wait()
		assert.Equal(t, []string(nil), ch.takeFrames(), "frames while the run is kept")
		time.Sleep(maxHoldAck - time.Nanosecond)
		synctest.Wait()
		assert.Equal(t, []string(nil), ch.takeFrames(), "frames just before the bound")
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		assert.Equal(t, []string{"ack 2 multiple"}, ch.takeFrames(), "frames at the bound")
		assert.Equal(t, maxHoldAck, time.Since(start), "kept for")

		require.NoError(t, ackLater(ds[4]), "ackLater")
		synctest.Wait()
		assert.Equal(t, []string(nil), ch.takeFrames(), "frames while 4 is held")
		time.Sleep(maxHoldAck)
		synctest.Wait()
		assert.Equal(t, []string{"ack 4"}, ch.takeFrames(), "frames at the bound")

		for tag := 3; tag <= n-1; tag++ {
			if tag != 4 {
				require.NoError(t, ackLater(ds[tag]), "ackLater")
			}
		}
		synctest.Wait()
		assert.Equal(t, []string(nil), ch.takeFrames(), "frames with 23 acks kept")
		require.NoError(t, ackLater(ds[n]), "ackLater")
		synctest.Wait()
		assert.Equal(t, []string{"ack 27 multiple"}, ch.takeFrames(), "frames with 24 acks kept")
		ch.check(t, n)
	})
}

// close sends what is held, and refuses later acks; it may be called twice.
func TestAckerClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ch := newModelChannel(3)
		a := newAcker("q", 64, 0, &Observer{}, slog.New(slog.DiscardHandler))
		ds := make([]*amqp.Delivery, 4)
		for tag := 1; tag <= 3; tag++ {
			ds[tag] = &amqp.Delivery{Acknowledger: ch, DeliveryTag: uint64(tag)}
			a.adopt(ds[tag])
		}
		require.NoError(t, ackLater(ds[2]), "ackLater")
		a.close()
		assert.Equal(t, []string{"ack 2"}, ch.takeFrames(), "frames sent by close")
		require.ErrorIs(t, ackLater(ds[1]), amqp.ErrClosed, "ackLater after close")
		a.close()
		assert.Equal(t, []string(nil), ch.takeFrames(), "frames after close")
	})
}

// A delivery of another channel is not adopted: its tag is not the
// acker's, and its ack is sent alone, at once.
func TestAckerOtherChannel(t *testing.T) {
	ch, other := newModelChannel(1), newModelChannel(1)
	a := makeAcker("q", 64, 0, &Observer{}, slog.New(slog.DiscardHandler))
	d1 := &amqp.Delivery{Acknowledger: ch, DeliveryTag: 1}
	d2 := &amqp.Delivery{Acknowledger: other, DeliveryTag: 1}
	a.adopt(d1)
	a.adopt(d2)
	if d2.Acknowledger != amqp.Acknowledger(other) {
		t.Fatalf("the delivery of another channel was adopted")
	}
	require.NoError(t, ackLater(d2), "ackLater")
	assert.Equal(t, []string{"ack 1"}, other.takeFrames(), "frames on the other channel")
	require.NoError(t, ackLater(d1), "ackLater")
	a.flush(true)
	assert.Equal(t, []string{"ack 1"}, ch.takeFrames(), "frames on the acker's channel")
}

// Many workers settle 20,000 deliveries in a random order, some with a
// nack, a reject or an ack of their own; the acker's goroutine runs. Each
// delivery is settled once, no tag is unknown, and acks are coalesced.
func TestAckerConcurrent(t *testing.T) {
	const n, workers = 20000, 64
	ch := newModelChannel(n)
	a := newAcker("q", 2*workers, workers, &Observer{}, slog.New(slog.DiscardHandler))
	tags := make(chan uint64)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for tag := range tags {
				d := &amqp.Delivery{Acknowledger: ch, DeliveryTag: tag}
				a.adopt(d)
				var err error
				switch r := rand.IntN(100); {
				case r < 3:
					err = d.Nack(false, true)
				case r < 5:
					err = d.Reject(false)
				case r < 7:
					err = d.Ack(false)
				default:
					err = ackLater(d)
				}
				assert.NoError(t, err, "settle %d", tag)
			}
		})
	}
	for tag := range uint64(n) {
		tags <- tag + 1
	}
	close(tags)
	wg.Wait()
	a.close()
	ch.check(t, n)
	ch.mu.Lock()
	defer ch.mu.Unlock()
	t.Logf("%d acks in %d frames: %.2f deliveries per ack frame", ch.acked, ch.acks, float64(ch.acked)/float64(ch.acks))
	if ch.acks >= ch.acked {
		t.Errorf("%d ack frames for %d acks; want fewer frames", ch.acks, ch.acked)
	}
}

// A handler that never returns leaves a gap for the rest of its session:
// the acks after it go alone, at the budget or at the time bound, and the
// acker's memory does not grow with them (a consumer_timeout may be
// disabled, and the memory server has none). Its entries are the acks
// held, fewer than the budget, and the ranges settled on their own,
// apart from one another by a held ack: fewer than twice the budget.
func TestAckerGapKeepsBoundedState(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n, prefetch, workers = 10000, 16, 0
		ch := newModelChannel(n + 1)
		a := makeAcker("q", prefetch, workers, &Observer{}, slog.New(slog.DiscardHandler))
		stuck := &amqp.Delivery{Acknowledger: ch, DeliveryTag: 1}
		a.adopt(stuck)
		most := 0
		for tag := uint64(2); tag <= n+1; tag++ {
			d := &amqp.Delivery{Acknowledger: ch, DeliveryTag: tag}
			a.adopt(d)
			var err error
			if tag%7 == 0 {
				err = d.Nack(false, true)
			} else {
				err = ackLater(d)
			}
			require.NoError(t, err, "settle")
			if tag%5 == 0 {
				time.Sleep(maxHoldAck / 7) // some go at the time bound
			}
			a.flush(false) // at the budget, the highest held goes alone
			most = max(most, a.kept())
		}
		if most >= 2*a.budget {
			t.Errorf("entries kept behind the gap: at most %d for %d deliveries; want fewer than %d (twice the budget)", most, n, 2*a.budget)
		}
		require.NoError(t, ackLater(stuck), "ackLater of the stuck delivery")
		a.flush(true)
		ch.check(t, n+1)
		assert.Equal(t, 0, a.kept(), "entries kept once the gap is closed")
	})
}

// A windowChannel is a modelChannel behind a server's prefetch window: it
// delivers tags 1 to n on deliveries while fewer than prefetch are
// unsettled, as RabbitMQ does, and records when each ack is asked for and
// when it is sent.
type windowChannel struct {
	*modelChannel
	prefetch   int
	deliveries chan uint64
	freed      chan struct{} // cap 1

	mu       sync.Mutex
	asked    map[uint64]time.Time // acks asked for, not sent yet
	mostKept int                  // the most of them at once
	latest   time.Duration        // the longest an ack waited
}

// newWindowChannel returns a windowChannel, and starts its goroutine,
// which ends once it has delivered n.
func newWindowChannel(n, prefetch int) *windowChannel {
	w := &windowChannel{
		modelChannel: newModelChannel(0),
		prefetch:     prefetch,
		deliveries:   make(chan uint64, prefetch),
		freed:        make(chan struct{}, 1),
		asked:        make(map[uint64]time.Time),
	}
	go func() {
		defer close(w.deliveries)
		for tag := uint64(1); tag <= uint64(n); {
			w.modelChannel.mu.Lock()
			full := len(w.unacked) >= w.prefetch
			if !full {
				w.unacked[tag] = true
			}
			w.modelChannel.mu.Unlock()
			if full {
				<-w.freed
				continue
			}
			w.deliveries <- tag
			tag++
		}
	}()
	return w
}

// ask records that the ack of tag is asked for, now.
func (w *windowChannel) ask(tag uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.asked[tag] = time.Now()
	w.mostKept = max(w.mostKept, len(w.asked))
}

func (w *windowChannel) Ack(tag uint64, multiple bool) error {
	w.mu.Lock()
	for t, at := range w.asked {
		if t == tag || (multiple && t < tag) {
			w.latest = max(w.latest, time.Since(at))
			delete(w.asked, t)
		}
	}
	w.mu.Unlock()
	err := w.modelChannel.Ack(tag, multiple)
	select {
	case w.freed <- struct{}{}:
	default:
	}
	return err
}

// Handlers that take a few milliseconds, some much longer, and so finish
// out of order (as over the PostgreSQL inbox, about 6 ms a message at 16
// workers, where a strace of the consumer counted 0.78 ack frames a
// message): the acks behind the gaps they leave are coalesced, well under
// one frame per delivery; the acks kept never take all the deliveries the
// window holds beyond the workers' (prefetch - workers), which would
// leave a worker waiting for the server; and no ack waits longer than
// maxHoldAck.
func TestAckerSlowHandlersOutOfOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n, workers, prefetch = 4000, 16, 32
		w := newWindowChannel(n, prefetch)
		a := newAcker("q", prefetch, workers, &Observer{}, slog.New(slog.DiscardHandler))
		rng := rand.New(rand.NewPCG(1, 2))
		took := make([]time.Duration, n+1) // 3 ms, and 3 ms more on average
		for tag := range took {
			took[tag] = 3*time.Millisecond + time.Duration(rng.ExpFloat64()*float64(3*time.Millisecond))
		}
		start := time.Now()
		var wg sync.WaitGroup
		for range workers {
			wg.Go(func() {
				for tag := range w.deliveries {
					d := &amqp.Delivery{Acknowledger: w, DeliveryTag: tag}
					a.adopt(d)
					time.Sleep(took[tag])
					w.ask(tag)
					assert.NoError(t, ackLater(d), "ackLater")
				}
			})
		}
		wg.Wait()
		a.close()
		elapsed := time.Since(start)
		w.check(t, n)
		w.modelChannel.mu.Lock()
		defer w.modelChannel.mu.Unlock()
		perDelivery := float64(w.acks) / float64(w.acked)
		t.Logf("%d deliveries in %v: %d ack frames, %.3f per delivery; at most %d acks kept; the longest wait %v",
			n, elapsed, w.acks, perDelivery, w.mostKept, w.latest)
		if perDelivery > 0.6 {
			t.Errorf("%.3f ack frames per delivery; want at most 0.6", perDelivery)
		}
		if w.mostKept >= prefetch-workers {
			t.Errorf("at most %d acks kept; want fewer than %d (prefetch - workers)", w.mostKept, prefetch-workers)
		}
		if w.latest > maxHoldAck {
			t.Errorf("an ack waited %v; want at most %v (maxHoldAck)", w.latest, maxHoldAck)
		}
	})
}
