package middleware_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// eventLog records Dedup's events, with the context each came with.
type eventLog struct {
	mu     sync.Mutex
	kinds  []string
	keys   []string
	tagged int // events whose context carries the delivery's tag
}

type tagKey struct{}

func (l *eventLog) observe(ctx context.Context, e middleware.DedupEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.kinds = append(l.kinds, e.Kind.String())
	l.keys = append(l.keys, e.Key)
	if ctx.Value(tagKey{}) != nil {
		l.tagged++
	}
}

func (l *eventLog) got() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.kinds)
}

// Each of Dedup's answers reaches Observe once, with the delivery's
// context (through which a tracing layer finds its span) and the key.
func TestDedupObserve(t *testing.T) {
	s := &faultyStore{Store: store.NewMemory()}
	var log eventLog
	h := rabbitmw.Chain(middleware.Keys(middleware.Keying{Namespace: "ns"}), middleware.Dedup(s, middleware.DedupOptions{Observe: log.observe}))(nop)
	ctx := context.WithValue(context.Background(), tagKey{}, true)

	d, _ := deliverytest.New("m1", "")
	h.Handle(ctx, d) // claimed, then done
	h.Handle(ctx, d) // duplicate
	s.Store.Claim(ctx, "ns:m2", "other", time.Minute)
	d2, _ := deliverytest.New("m2", "")
	h.Handle(ctx, d2) // busy
	set(&s.claim, errBoom)
	d3, _ := deliverytest.New("m3", "")
	h.Handle(ctx, d3) // unavailable

	want := []string{"claimed", "duplicate", "busy", "unavailable"}
	assert.Equal(t, want, log.got(), "events")
	assert.Equal(t, []string{"ns:m1", "ns:m1", "ns:m2", "ns:m3"}, log.keys, "keys")
	assert.Equal(t, len(want), log.tagged, "events that came with the delivery's context")
}

// Renewals and a lost lease are events too, the renewals with the
// delivery's context though they run on the renewer's goroutines.
func TestDedupObserveLease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := store.NewMemory()
		var log eventLog
		const lease = 3 * time.Second
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease, Observe: log.observe})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				time.Sleep(lease + lease/2) // renewals at 1, 2, 3 and 4 s
				synctest.Wait()
				return nil
			}))
		ctx := context.WithValue(context.Background(), tagKey{}, true)
		d, _ := deliverytest.New("m1", "")
		require.NoError(t, h.Handle(ctx, d))
		want := []string{"claimed", "lease_renewed", "lease_renewed", "lease_renewed", "lease_renewed"}
		assert.Equal(t, want, log.got(), "events")
		assert.Equal(t, len(want), log.tagged, "events that came with the delivery's context")
	})
}

// An Observe that panics on a renewal, which runs on a goroutine of the
// renewer's, kills nothing: the panic comes back as its delivery's result,
// a *rabbitmw.PanicError with the stack where it happened, once the
// handler's success is recorded (its message is a duplicate from then on),
// and the renewals of the other deliveries go on.
func TestDedupObservePanicsOnRenewal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lease = 3 * time.Second
		var renewals atomic.Int32 // of m2
		observe := func(_ context.Context, e middleware.DedupEvent) {
			if e.Kind != middleware.DedupLeaseRenewed {
				return
			}
			if e.Key == "m1" {
				panic("observer bug")
			}
			renewals.Add(1)
		}
		s := store.NewMemory()
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease, Observe: observe})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				time.Sleep(lease + lease/2) // renewals at 1, 2, 3 and 4 s
				return nil
			}))
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, id := range []string{"m1", "m2"} {
			wg.Go(func() {
				d, _ := deliverytest.New(id, "")
				errs[i] = h.Handle(context.Background(), d)
			})
		}
		wg.Wait()

		var pe *rabbitmw.PanicError
		require.ErrorAs(t, errs[0], &pe, "m1's result")
		assert.Equal(t, "observer bug", pe.Value)
		assert.Contains(t, string(pe.Stack), "(*renewer).renew", "the stack of the renewal")
		assert.NoError(t, errs[1], "m2's result")
		assert.Equal(t, int32(4), renewals.Load(), "renewals of m2")

		d, _ := deliverytest.New("m1", "")
		assert.ErrorIs(t, h.Handle(context.Background(), d), rabbitmw.ErrDuplicate, "m1 again: its handler succeeded")
	})
}

// Dedup waits for a call of Observe on a renewal that began before its
// handler returned: a panic there, after the handler has returned, is
// still its delivery's result, never lost nor raised once the delivery
// is gone.
func TestDedupObservePanicsAsItsDeliveryEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const lease = 3 * time.Second
		observe := func(_ context.Context, e middleware.DedupEvent) {
			if e.Kind == middleware.DedupLeaseRenewed {
				time.Sleep(lease / 6) // the handler returns meanwhile
				panic("observer bug")
			}
		}
		h := middleware.Dedup(store.NewMemory(), middleware.DedupOptions{Lease: lease, Observe: observe})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				time.Sleep(lease/3 + lease/30) // the first renewal, at 1 s, and a little
				return nil
			}))
		d, _ := deliverytest.New("m1", "")
		start := time.Now()
		err := h.Handle(context.Background(), d)
		var pe *rabbitmw.PanicError
		require.ErrorAs(t, err, &pe)
		assert.Equal(t, "observer bug", pe.Value)
		assert.Equal(t, lease/3+lease/6, time.Since(start), "when the result came: once Observe had returned")
	})
}

// A panic of Observe on DedupClaimed, the claim won and the handler not
// yet run, goes on up the chain, and the claim is released first, as a
// panic of the handler releases it: the next delivery of the message is
// not held up for the lease, nor counted abandoned.
func TestDedupObservePanicsOnClaimed(t *testing.T) {
	s := store.NewMemory()
	ran := false
	observe := func(_ context.Context, e middleware.DedupEvent) {
		if e.Kind == middleware.DedupClaimed {
			panic("observer bug")
		}
	}
	h := middleware.Dedup(s, middleware.DedupOptions{Observe: observe})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { ran = true; return nil }))
	d, _ := deliverytest.New("m1", "")
	assert.PanicsWithValue(t, "observer bug", func() { h.Handle(context.Background(), d) }, "Observe's panic goes on")
	assert.False(t, ran, "the handler ran")
	got, _ := s.Claim(context.Background(), "m1", "next", time.Minute)
	assert.Equal(t, store.Claimed, got, "Claim after the panic (released)")
}

// A panic with the claim won, of Observe on DedupClaimed or of the
// handler, releases the claim; if the store does not answer the release,
// the claim is kept to release once the store answers a claim of the key
// again, as an unanswered claim's is: the next delivery is not held up
// for the lease.
func TestDedupPanicReleaseUnanswered(t *testing.T) {
	for _, c := range []struct {
		name            string
		observe, handle bool // which panics
	}{
		{"Observe on DedupClaimed", true, false},
		{"the handler", false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &faultyStore{Store: store.NewMemory()}
			var panicking atomic.Bool
			panicking.Store(true)
			observe := func(_ context.Context, e middleware.DedupEvent) {
				if c.observe && e.Kind == middleware.DedupClaimed && panicking.Load() {
					panic("bug")
				}
			}
			ran := 0
			h := middleware.Dedup(s, middleware.DedupOptions{Observe: observe})(rabbitmw.HandlerFunc(
				func(context.Context, *amqp.Delivery) error {
					if c.handle && panicking.Load() {
						panic("bug")
					}
					ran++
					return nil
				}))
			d, _ := deliverytest.New("m1", "")
			set(&s.release, errors.New("store down"))
			assert.PanicsWithValue(t, "bug", func() { h.Handle(context.Background(), d) })
			set(&s.release, nil)
			panicking.Store(false)
			require.NoError(t, h.Handle(context.Background(), d), "the next delivery, the store answering")
			assert.Equal(t, 1, ran, "handler runs after the panic")
		})
	}
}

// panickyRelease is a store whose Release records its context and
// panics.
type panickyRelease struct {
	store.Store
	ctx context.Context
}

func (p *panickyRelease) Release(ctx context.Context, key, token string) error {
	p.ctx = ctx
	panic("release bug")
}

// A Release that panics, after a panic with the claim won, still ends the
// context Dedup gave it (its timer is stopped, its watch of the consumer's
// context removed): the panic goes on, and nothing of the release stays
// behind.
func TestDedupPanicReleasePanics(t *testing.T) {
	for _, c := range []struct {
		name            string
		observe, handle bool // which panics first
	}{
		{"Observe on DedupClaimed", true, false},
		{"the handler", false, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &panickyRelease{Store: store.NewMemory()}
			observe := func(_ context.Context, e middleware.DedupEvent) {
				if c.observe && e.Kind == middleware.DedupClaimed {
					panic("bug")
				}
			}
			h := middleware.Dedup(s, middleware.DedupOptions{Observe: observe})(rabbitmw.HandlerFunc(
				func(context.Context, *amqp.Delivery) error {
					if c.handle {
						panic("bug")
					}
					return nil
				}))
			d, _ := deliverytest.New("m1", "")
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			assert.Panics(t, func() { h.Handle(ctx, d) })
			require.NotNil(t, s.ctx, "Release was called")
			assert.Error(t, s.ctx.Err(), "the release's context has ended")
			assert.NoError(t, ctx.Err(), "the consumer's context is untouched")
		})
	}
}

// A claim found taken over when the success is to be recorded is
// reported as lost.
func TestDedupObserveLeaseLost(t *testing.T) {
	s := &faultyStore{Store: store.NewMemory()}
	set(&s.complete, store.ErrLostClaim)
	var log eventLog
	h := middleware.Dedup(s, middleware.DedupOptions{Observe: log.observe})(nop)
	d, _ := deliverytest.New("m1", "")
	require.ErrorIs(t, h.Handle(context.Background(), d), middleware.ErrLeaseLost)
	assert.Equal(t, []string{"claimed", "lease_lost"}, log.got(), "events")
}

// A claim whose lease ended unfinished is reported as abandoned.
func TestDedupObserveAbandoned(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := store.NewMemory()
		var log eventLog
		h := middleware.Dedup(s, middleware.DedupOptions{Observe: log.observe})(nop)
		ctx := context.Background()
		s.Claim(ctx, "m1", "crashed", time.Second) // a consumer that died
		time.Sleep(2 * time.Second)
		d, _ := deliverytest.New("m1", "")
		require.ErrorIs(t, h.Handle(ctx, d), middleware.ErrAbandoned)
		assert.Equal(t, []string{"abandoned"}, log.got(), "events")
	})
}
