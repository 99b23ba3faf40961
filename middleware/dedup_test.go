package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

func TestDedup(t *testing.T) {
	ctx := context.Background()
	unreachable := errors.New("dial tcp: connection refused")
	tests := []struct {
		name    string
		id      string
		body    string
		opts    middleware.DedupOptions
		keying  middleware.Keying    // given to a Keys layer above Dedup, if set
		prepare func(s *faultyStore) // state before the delivery
		handler func(ctx context.Context, d *amqp.Delivery) error

		wantCalls   int              // handler calls
		wantOutcome rabbitmw.Outcome // rabbitmw.Decide of the result
		wantDelay   time.Duration    // for Delay
		wantIs      error            // the result wraps it
		wantSettle  string           // how the recorder saw it settled
		wantState   store.Status     // Claim by a stranger afterwards
		wantKey     string           // the key the state is checked under (default: id)
	}{
		{
			name: "new message is processed and marked done",
			id:   "m1", wantCalls: 1, wantOutcome: rabbitmw.Ack, wantSettle: "acked", wantState: store.Done,
		},
		{
			name: "done message is a duplicate, acked without running the handler",
			id:   "m1",
			prepare: func(s *faultyStore) {
				s.Claim(ctx, "m1", "old", time.Minute)
				s.Complete(ctx, "m1", "old", time.Hour)
			},
			wantCalls: 0, wantOutcome: rabbitmw.Duplicate, wantIs: rabbitmw.ErrDuplicate, wantSettle: "acked", wantState: store.Done,
		},
		{
			name:      "message held by another consumer is delayed, not requeued at once",
			id:        "m1",
			opts:      middleware.DedupOptions{BusyDelay: 7 * time.Second},
			prepare:   func(s *faultyStore) { s.Claim(ctx, "m1", "other", time.Minute) },
			wantCalls: 0, wantOutcome: rabbitmw.Delay, wantDelay: 7 * time.Second, wantIs: middleware.ErrBusy,
			wantSettle: "requeued", wantState: store.Processing,
		},
		{
			name:      "handler error releases the claim and is returned",
			id:        "m1",
			handler:   func(context.Context, *amqp.Delivery) error { return errBoom },
			wantCalls: 1, wantOutcome: rabbitmw.Requeue, wantIs: errBoom, wantSettle: "requeued", wantState: store.Claimed,
		},
		{
			name:      "permanent handler error releases the claim and dead-letters",
			id:        "m1",
			handler:   func(context.Context, *amqp.Delivery) error { return rabbitmw.Permanent(errBoom) },
			wantCalls: 1, wantOutcome: rabbitmw.DeadLetter, wantIs: errBoom, wantSettle: "dead-lettered", wantState: store.Claimed,
		},
		{
			name:      "store unreachable fails closed: handler not run, delayed",
			id:        "m1",
			opts:      middleware.DedupOptions{UnavailableDelay: 3 * time.Second},
			prepare:   func(s *faultyStore) { set(&s.claim, unreachable) },
			wantCalls: 0, wantOutcome: rabbitmw.Delay, wantDelay: 3 * time.Second, wantIs: middleware.ErrStoreUnavailable,
			wantSettle: "requeued", wantState: store.Claimed,
		},
		{
			name:      "store unreachable with FailOpen runs the handler",
			id:        "m1",
			opts:      middleware.DedupOptions{FailOpen: true},
			prepare:   func(s *faultyStore) { set(&s.claim, unreachable) },
			wantCalls: 1, wantOutcome: rabbitmw.Ack, wantSettle: "acked", wantState: store.Claimed,
		},
		{
			name:      "key refused by the store: dead-lettered with the reason, handler not run",
			id:        "m1",
			prepare:   func(s *faultyStore) { set(&s.claim, fmt.Errorf("too long: %w", store.ErrKeyRejected)) },
			wantCalls: 0, wantOutcome: rabbitmw.DeadLetter, wantIs: store.ErrKeyRejected,
			wantSettle: "dead-lettered", wantState: store.Claimed,
		},
		{
			name:      "key refused by the store, FailOpen: dead-lettered all the same, handler not run",
			id:        "m1",
			opts:      middleware.DedupOptions{FailOpen: true},
			prepare:   func(s *faultyStore) { set(&s.claim, fmt.Errorf("too long: %w", store.ErrKeyRejected)) },
			wantCalls: 0, wantOutcome: rabbitmw.DeadLetter, wantIs: store.ErrKeyRejected,
			wantSettle: "dead-lettered", wantState: store.Claimed,
		},
		{
			name: "no message id: keyed by the MD5 of the body",
			body: "hello", wantKey: "5d41402abc4b2a76b9719d911017c592",
			wantCalls: 1, wantOutcome: rabbitmw.Ack, wantSettle: "acked", wantState: store.Done,
		},
		{
			name:      "no message id and no body: dead-lettered with the reason, handler not run",
			wantCalls: 0, wantOutcome: rabbitmw.DeadLetter, wantIs: middleware.ErrNoKey, wantSettle: "dead-lettered",
		},
		{
			name: "namespace keeps services apart",
			id:   "m1", keying: middleware.Keying{Namespace: "billing"},
			prepare: func(s *faultyStore) { // done for another service only
				s.Claim(ctx, "m1", "old", time.Minute)
				s.Complete(ctx, "m1", "old", time.Hour)
			},
			wantKey:   "billing:m1",
			wantCalls: 1, wantOutcome: rabbitmw.Ack, wantSettle: "acked", wantState: store.Done,
		},
		{
			name: "done mark survives a transient store error after the handler",
			id:   "m1",
			prepare: func(s *faultyStore) {
				set(&s.complete, unreachable)
				time.AfterFunc(120*time.Millisecond, func() { set(&s.complete, nil) })
			},
			wantCalls: 1, wantOutcome: rabbitmw.Ack, wantSettle: "acked", wantState: store.Done,
		},
		{
			name: "handler succeeds but the claim was taken over: not done, delayed, not a failure",
			id:   "m1",
			opts: middleware.DedupOptions{BusyDelay: time.Second},
			prepare: func(s *faultyStore) {
				set(&s.complete, store.ErrLostClaim)
			},
			wantCalls: 1, wantOutcome: rabbitmw.Delay, wantDelay: time.Second, wantIs: middleware.ErrLeaseLost,
			wantSettle: "requeued", wantState: store.Processing,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := &faultyStore{Store: store.NewMemory()}
				if tt.prepare != nil {
					tt.prepare(s)
				}
				var calls atomic.Int32
				h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					calls.Add(1)
					if tt.handler != nil {
						return tt.handler(ctx, d)
					}
					return nil
				})
				d, rec := deliverytest.New(tt.id, tt.body)
				layers := []rabbitmw.Middleware{middleware.Dedup(s, tt.opts)}
				if tt.keying.Namespace != "" {
					layers = append([]rabbitmw.Middleware{middleware.Keys(tt.keying)}, layers...)
				}
				err := rabbitmw.Chain(layers...)(h).Handle(ctx, d)

				assert.EqualValues(t, tt.wantCalls, calls.Load(), "handler calls")
				dec := rabbitmw.Decide(err)
				assert.Equal(t, tt.wantOutcome, dec.Outcome, "Decide(%v)", err)
				assert.Equal(t, tt.wantDelay, dec.Delay, "Decide(%v).Delay", err)
				if tt.wantIs != nil {
					assert.ErrorIs(t, err, tt.wantIs)
				}
				assert.Equal(t, tt.wantSettle, deliverytest.Settle(t, d, rec, err), "settled")
				if tt.wantState != 0 {
					set(&s.claim, nil)
					key := tt.wantKey
					if key == "" {
						key = tt.id
					}
					got, err := s.Store.Claim(ctx, key, "stranger", time.Minute)
					assert.NoError(t, err)
					assert.Equal(t, tt.wantState, got, "Claim(%q) afterwards", key)
				}
			})
		})
	}
}

// A panicking handler must not leave its message claimed until the lease
// ends: Dedup releases the claim and lets the panic go on to Recover.
func TestDedupReleasesOnPanic(t *testing.T) {
	s := store.NewMemory()
	h := middleware.Dedup(s, middleware.DedupOptions{})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { panic("kaboom") }))
	d, _ := deliverytest.New("m1", "")
	assert.PanicsWithValue(t, "kaboom", func() { h.Handle(context.Background(), d) }, "the handler's panic goes on")
	got, _ := s.Claim(context.Background(), "m1", "next", time.Minute)
	assert.Equal(t, store.Claimed, got, "Claim after the panic (released)")
}

// While the handler runs past a third of the lease, the claim is renewed:
// nobody else can claim the message, and it ends done.
func TestDedupRenewsLease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		s := &faultyStore{Store: store.NewMemory()}
		const lease = 150 * time.Millisecond
		var during store.Status
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				time.Sleep(3 * lease)
				during, _ = s.Store.Claim(ctx, "m1", "other", time.Minute)
				time.Sleep(lease)
				return ctx.Err()
			}))
		d, _ := deliverytest.New("m1", "")
		require.NoError(t, h.Handle(ctx, d))
		assert.Equal(t, store.Processing, during, "Claim by another consumer after 3 leases (renewed)")
		assert.GreaterOrEqual(t, s.Calls("extend"), int64(3), "Extend calls in 4 leases (every lease/3)")
		got, _ := s.Store.Claim(ctx, "m1", "other", time.Minute)
		assert.Equal(t, store.Done, got, "Claim afterwards")
	})
}

// If the claim is taken over while the handler runs (here it is deleted;
// that every store reports an Extend of an absent claim as ErrLostClaim is
// storetest's to check), the handler's context is cancelled with the
// cause, and nothing is marked done.
func TestDedupLostLeaseCancelsHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		s := &recordingStore{Store: store.NewMemory()}
		const lease = 150 * time.Millisecond
		var cause error
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease, BusyDelay: time.Second})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				// An operator, or a hand-written consumer, deletes the claim.
				s.mu.Lock()
				token := s.tokens[0]
				s.mu.Unlock()
				if err := s.Store.Release(ctx, "m1", token); err != nil {
					return err
				}
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
					return ctx.Err()
				case <-time.After(10 * lease):
					return errors.New("handler was not cancelled")
				}
			}))
		d, _ := deliverytest.New("m1", "")
		err := h.Handle(ctx, d)
		assert.ErrorIs(t, cause, middleware.ErrLeaseLost, "the handler's context's cause")
		assert.ErrorIs(t, cause, store.ErrLostClaim, "the handler's context's cause")
		if dec := rabbitmw.Decide(err); dec.Outcome != rabbitmw.Delay || dec.Delay != time.Second || !errors.Is(err, middleware.ErrLeaseLost) {
			t.Errorf("result %v decides %v after %v; want delayed by BusyDelay with ErrLeaseLost", err, dec.Outcome, dec.Delay)
		}
		got, _ := s.Store.Claim(ctx, "m1", "stranger", time.Minute)
		assert.Equal(t, store.Claimed, got, "Claim afterwards: nothing written after the claim was lost")
	})
}

// If renewal keeps failing until the lease may end, the handler is
// cancelled, and the result is a store outage (not counted by Retry).
func TestDedupUnrenewableLeaseCancelsHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &faultyStore{Store: store.NewMemory()}
		set(&s.extend, errors.New("i/o timeout"))
		const lease = 150 * time.Millisecond
		var cause error
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease, UnavailableDelay: 2 * time.Second})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
					return ctx.Err()
				case <-time.After(10 * lease):
					return errors.New("handler was not cancelled")
				}
			}))
		d, _ := deliverytest.New("m1", "")
		start := time.Now()
		err := h.Handle(context.Background(), d)
		assert.ErrorIs(t, cause, middleware.ErrStoreUnavailable, "the handler's context's cause")
		// Renewals every lease/3 fail; the one at 2/3 of the lease sees that the
		// next would come too late, and cancels: not the handler's own fallback
		// after 10 leases.
		assert.Equal(t, 2*lease/3, time.Since(start), "handler cancelled after 2/3 of the lease")
		if dec := rabbitmw.Decide(err); dec.Outcome != rabbitmw.Delay || dec.Delay != 2*time.Second || !errors.Is(err, middleware.ErrStoreUnavailable) {
			t.Errorf("result %v decides %v after %v; want delayed by UnavailableDelay with ErrStoreUnavailable", err, dec.Outcome, dec.Delay)
		}
	})
}

// The result of a finished handler is recorded even if the consumer's
// context was cancelled meanwhile (a shutdown).
func TestDedupCompletesAfterCancel(t *testing.T) {
	s := store.NewMemory()
	ctx, cancel := context.WithCancel(context.Background())
	h := middleware.Dedup(s, middleware.DedupOptions{})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { cancel(); return nil }))
	d, _ := deliverytest.New("m1", "")
	require.NoError(t, h.Handle(ctx, d))
	got, _ := s.Claim(context.Background(), "m1", "x", time.Minute)
	assert.Equal(t, store.Done, got, "Claim afterwards")
}

// The happy path costs two store round trips (claim, complete) and a
// duplicate one (claim).
func TestDedupRoundTrips(t *testing.T) {
	_, c, rt := redistest.Start(t)
	s := redisstore.New(c, redisstore.Options{})
	h := middleware.Dedup(s, middleware.DedupOptions{})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { return nil }))
	ctx := context.Background()
	d, _ := deliverytest.New("warm-up", "") // load the scripts
	h.Handle(ctx, d)
	for _, tc := range []struct {
		name string
		want int64
	}{{"first delivery", 2}, {"duplicate", 1}} {
		d, _ := deliverytest.New("m1", "")
		before := rt.Count()
		h.Handle(ctx, d)
		assert.Equal(t, tc.want, rt.Count()-before, "%s: round trips", tc.name)
	}
}

func TestDedupTokensAreDistinct(t *testing.T) {
	// Each claim takes the next of one sequence: claim from several goroutines.
	const goroutines, claims = 4, 100
	s := &recordingStore{Store: store.NewMemory()}
	h := middleware.Dedup(s, middleware.DedupOptions{})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { return errBoom }))
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for range claims {
				d, _ := deliverytest.New(fmt.Sprint("m", g), "")
				h.Handle(context.Background(), d)
			}
		})
	}
	wg.Wait()
	seen := map[string]bool{}
	for _, tok := range s.tokens {
		require.False(t, seen[tok] || tok == "" || tok == "done" || strings.ContainsAny(tok, " \n"), "token %q reused or malformed", tok)
		seen[tok] = true
	}
	assert.Len(t, seen, goroutines*claims, "distinct tokens")
}

type recordingStore struct {
	store.Store
	mu     sync.Mutex
	tokens []string
}

func (r *recordingStore) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	r.mu.Lock()
	r.tokens = append(r.tokens, token)
	r.mu.Unlock()
	return r.Store.Claim(ctx, key, token, lease)
}

// Many claims renewed by the one timer of a Dedup layer, started at
// staggered times and ending at different times: each keeps its claim for
// as long as its handler runs, and is done afterwards.
func TestDedupRenewsManyLeases(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		s := &faultyStore{Store: store.NewMemory()}
		const lease = 150 * time.Millisecond
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				var n int
				fmt.Sscan(d.MessageId, &n)
				deadline := time.Now().Add(lease * time.Duration(1+n%4)) // 1 to 4 leases
				for time.Now().Before(deadline) {
					if got, _ := s.Store.Claim(ctx, d.MessageId, "thief", time.Minute); got != store.Processing {
						return fmt.Errorf("claim of %s during its handler = %v; want processing", d.MessageId, got)
					}
					time.Sleep(lease / 5)
				}
				return ctx.Err()
			}))
		var wg sync.WaitGroup
		for i := range 20 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				time.Sleep(time.Duration(i) * lease / 7)
				d, _ := deliverytest.New(fmt.Sprint(i), "")
				assert.NoError(t, h.Handle(ctx, d))
			}()
		}
		wg.Wait()
		for i := range 20 {
			got, _ := s.Store.Claim(ctx, fmt.Sprint(i), "x", time.Minute)
			assert.Equal(t, store.Done, got, "message %d afterwards", i)
		}
	})
}

// hangingStore's Extend blocks, ignoring its context, as a Redis client
// does without ContextTimeoutEnabled when the network drops every packet.
type hangingStore struct {
	store.Store
	release  chan struct{}
	once     sync.Once
	returned atomic.Bool
}

// open lets the hanging calls return.
func (h *hangingStore) open() { h.once.Do(func() { close(h.release) }) }

func newHangingStore() *hangingStore {
	return &hangingStore{Store: store.NewMemory(), release: make(chan struct{})}
}

func (h *hangingStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	<-h.release
	h.returned.Store(true)
	return errors.New("i/o timeout")
}

// unblock ends the hanging calls and waits until they have returned, and
// so until the renewals that made them have ended. It runs in the test's
// synctest bubble.
func (h *hangingStore) unblock() {
	h.open()
	synctest.Wait()
}

// The handler is cancelled before its lease ends even when a renewal never
// returns: the renewer decides on the clock, not on the store's answer.
func TestDedupHangingRenewalCancelsHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newHangingStore()
		defer s.unblock()
		const lease = 300 * time.Millisecond
		var (
			cause       error
			extendFirst bool
		)
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				select {
				case <-ctx.Done():
					cause, extendFirst = context.Cause(ctx), s.returned.Load()
					return ctx.Err()
				case <-time.After(10 * lease):
					return errors.New("handler was not cancelled")
				}
			}))
		d, _ := deliverytest.New("m1", "")
		err := h.Handle(context.Background(), d)
		assert.False(t, extendFirst, "the handler was cancelled only after the hanging renewal returned; want it cancelled before the lease ends")
		assert.ErrorIs(t, cause, middleware.ErrStoreUnavailable, "the handler's context's cause")
		assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	})
}

// failThenHangStore's first Extend fails at once (the store refuses the
// connection); the next ones hang, as hangingStore's do (the network then
// drops every packet).
type failThenHangStore struct {
	*hangingStore
	extends atomic.Int32
}

func (s *failThenHangStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	if s.extends.Add(1) == 1 {
		return errors.New("connection refused")
	}
	return s.hangingStore.Extend(ctx, key, token, lease)
}

// A renewal that failed leaves the lease as it was: the next one, started
// when the lease ends within an interval, cannot be waited for. The
// handler is cancelled then, with an interval left to stop, not when the
// lease ends and another consumer may claim the message.
func TestDedupFailedThenHangingRenewalCancelsHandler(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &failThenHangStore{hangingStore: newHangingStore()}
		defer s.unblock()
		const lease = 300 * time.Millisecond
		var (
			cause     error
			cancelled time.Duration
		)
		start := time.Now()
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease})(rabbitmw.HandlerFunc(
			func(ctx context.Context, d *amqp.Delivery) error {
				select {
				case <-ctx.Done():
					cause, cancelled = context.Cause(ctx), time.Since(start)
					return ctx.Err()
				case <-time.After(10 * lease):
					return errors.New("handler was not cancelled")
				}
			}))
		d, _ := deliverytest.New("m1", "")
		err := h.Handle(context.Background(), d)
		assert.Equal(t, 2*lease/3, cancelled, "the handler was cancelled after %v; want it cancelled when the second renewal starts, a third of the lease before it ends", cancelled)
		assert.ErrorIs(t, cause, middleware.ErrStoreUnavailable, "the handler's context's cause")
		assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	})
}

// flakyRenewalStore's Extend, drawn at random: fails at once, or after a
// while (up to two leases), or reaches the store late, or at once.
type flakyRenewalStore struct {
	store.Store
	mu  sync.Mutex
	rng *rand.Rand
}

func (s *flakyRenewalStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	s.mu.Lock()
	n, wait := s.rng.IntN(10), time.Duration(s.rng.IntN(int(2*lease)))
	s.mu.Unlock()
	switch {
	case n < 3:
		return errors.New("connection refused")
	case n < 4:
		time.Sleep(wait)
		return errors.New("i/o timeout")
	case n < 7:
		time.Sleep(wait)
	}
	return s.Store.Extend(ctx, key, token, lease)
}

// Whatever the renewals meet, two handlers of a message never run at once
// when each stops within an interval (a third of the lease) of its
// context's end, and each message's effect happens once: a handler is
// cancelled an interval before its lease may end.
func TestDedupLeaseKeepsHandlersApart(t *testing.T) {
	for seed := range 50 {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				const lease = 300 * time.Millisecond
				s := &flakyRenewalStore{Store: store.NewMemory(), rng: rand.New(rand.NewPCG(uint64(seed), 1))}
				x := newExclusive(t, uint64(seed), lease, 3*lease)
				h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease, BusyDelay: 10 * time.Millisecond, UnavailableDelay: 10 * time.Millisecond})(x)
				x.deliver(h, 5, 3, false)
				time.Sleep(2 * lease) // the renewals still in flight return
			})
		})
	}
}

// A handler that finishes while a renewal hangs is marked done at once: the
// delivery does not wait for the renewal, which could outlast the lease and
// let another consumer apply the effect again.
func TestDedupFinishedHandlerDoesNotWaitForRenewal(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := newHangingStore()
		defer s.unblock()
		const lease = 300 * time.Millisecond
		time.AfterFunc(3*lease, s.open) // so that a Dedup that waits ends too
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease})(rabbitmw.HandlerFunc(
			func(context.Context, *amqp.Delivery) error {
				time.Sleep(lease / 2) // past the first renewal, at lease/3, which hangs
				return nil
			}))
		d, _ := deliverytest.New("m1", "")
		start := time.Now()
		require.NoError(t, h.Handle(context.Background(), d))
		assert.Less(t, time.Since(start), lease, "Handle waited for the hanging renewal")
		require.False(t, s.returned.Load(), "the renewal returned before the handler finished; the test proves nothing")
		got, _ := s.Store.Claim(context.Background(), "m1", "other", time.Minute)
		assert.Equal(t, store.Done, got, "Claim afterwards")
	})
}

// lostReplyStore applies a Claim but reports an error, as a client does
// when the reply is lost to a timeout.
type lostReplyStore struct{ store.Store }

func (s lostReplyStore) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	s.Store.Claim(ctx, key, token, lease)
	return 0, errors.New("i/o timeout")
}

// A claim that took effect though its answer was lost is released, so that
// it does not keep the message busy until the lease ends.
func TestDedupReleasesAnUnansweredClaim(t *testing.T) {
	s := lostReplyStore{store.NewMemory()}
	h := middleware.Dedup(s, middleware.DedupOptions{})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { return nil }))
	d, _ := deliverytest.New("m1", "")
	require.ErrorIs(t, h.Handle(context.Background(), d), middleware.ErrStoreUnavailable)
	got, _ := s.Store.Claim(context.Background(), "m1", "next", time.Minute)
	assert.Equal(t, store.Claimed, got, "Claim after the unanswered claim (released)")
}

// FailOpen runs the handler when the store is down, not when the claim
// failed because the delivery's context is done.
func TestDedupFailOpenNotOnDoneContext(t *testing.T) {
	s := &faultyStore{Store: store.NewMemory()}
	set(&s.claim, context.Canceled)
	var calls atomic.Int32
	h := middleware.Dedup(s, middleware.DedupOptions{FailOpen: true})(rabbitmw.HandlerFunc(
		func(context.Context, *amqp.Delivery) error { calls.Add(1); return nil }))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d, _ := deliverytest.New("m1", "")
	assert.Error(t, h.Handle(ctx, d), "Handle with a done context and a failed claim")
	assert.Zero(t, calls.Load(), "handler calls on a done context")
}

// A claim whose lease ended without a done mark or a release (its consumer
// died) is reported as ErrAbandoned: the handler does not run, the message
// is requeued (Retry counts the attempt), and the next claim takes the key.
// Finding it costs one round trip, like any claim.
func TestDedupAbandonedClaim(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		s := &faultyStore{Store: store.NewMemory()}
		var calls int
		h := middleware.Dedup(s, middleware.DedupOptions{Lease: time.Minute})(rabbitmw.HandlerFunc(
			func(context.Context, *amqp.Delivery) error { calls++; return nil }))
		_, err := s.Claim(ctx, "m1", "dead consumer", time.Minute)
		require.NoError(t, err)
		time.Sleep(time.Minute)
		before := s.Calls("claim") + s.Calls("release")
		d, rec := deliverytest.New("m1", "")
		err = h.Handle(ctx, d)
		assert.Zero(t, calls, "handler calls")
		assert.ErrorIs(t, err, middleware.ErrAbandoned)
		assert.Equal(t, rabbitmw.Requeue, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
		assert.EqualValues(t, 1, s.Calls("claim")+s.Calls("release")-before, "store calls for an abandoned message (the claim)")
		assert.Equal(t, "requeued", deliverytest.Settle(t, d, rec, err), "settled")
		d, _ = deliverytest.New("m1", "")
		assert.NoError(t, h.Handle(ctx, d), "the next delivery")
		assert.Equal(t, 1, calls, "handler calls after the next delivery")
	})
}

// A Retry beneath Dedup never sees ErrAbandoned (Dedup returns it without
// running what is beneath it): a message that kills its consumer was
// requeued uncounted after each death, for ever, never dead-lettered as
// Retry promises. So Dedup refuses, when the chain is built, a Retry it
// can see beneath it: directly, or beneath Recover or Timeout.
func TestDedupRefusesRetryBeneathIt(t *testing.T) {
	st := store.NewMemory()
	retry := middleware.Retry(st, middleware.RetryOptions{})
	byHeader := middleware.Retry(nil, middleware.RetryOptions{CountByHeader: true})
	const msg = "middleware: Dedup: a Retry beneath Dedup never sees ErrAbandoned, so a message that kills its consumer is never dead-lettered: put Retry above Dedup (see Stack)"
	for name, beneath := range map[string][]rabbitmw.Middleware{
		"Retry":                   {retry},
		"Retry by the header":     {byHeader},
		"Recover, then Retry":     {middleware.Recover(), retry},
		"Timeout, then Retry":     {middleware.Timeout(time.Second), retry},
		"Recover, Timeout, Retry": {middleware.Recover(), middleware.Timeout(time.Second), retry},
	} {
		t.Run(name, func(t *testing.T) {
			chain := rabbitmw.Chain(append([]rabbitmw.Middleware{middleware.Dedup(st, middleware.DedupOptions{})}, beneath...)...)
			assert.PanicsWithValue(t, msg, func() { chain(plainHandler{}) })
		})
	}
	// Above Dedup, as Stack puts it, Retry is where it belongs.
	assert.NotPanics(t, func() {
		rabbitmw.Chain(retry, middleware.Recover(), middleware.Dedup(st, middleware.DedupOptions{}), middleware.Timeout(time.Second))(plainHandler{})
	})
}

// lostAnswers is a store that, while down, applies a Claim and then loses
// its answer (the server went away as it answered), and refuses the rest.
type lostAnswers struct {
	store.Store
	down atomic.Bool
}

var errAnswerLost = errors.New("read tcp: connection reset by peer")

func (s *lostAnswers) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	if s.down.Load() {
		s.Store.Claim(ctx, key, token, lease)
		return 0, errAnswerLost
	}
	return s.Store.Claim(ctx, key, token, lease)
}

func (s *lostAnswers) Release(ctx context.Context, key, token string) error {
	if s.down.Load() {
		return errAnswerLost
	}
	return s.Store.Release(ctx, key, token)
}

// A claim that took effect though its answer was lost, and whose release
// failed as well, must not keep its message busy until the lease ends:
// once the store answers again, the message is processed.
func TestDedupReleasesClaimsWhoseAnswerWasLost(t *testing.T) {
	for _, next := range [][]string{{"m1"}, {"m2", "m1"}} {
		t.Run(strings.Join(next, ","), func(t *testing.T) {
			ctx := context.Background()
			s := &lostAnswers{Store: store.NewMemory()}
			var calls sync.Map
			h := middleware.Dedup(s, middleware.DedupOptions{})(rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
				calls.Store(d.MessageId, true)
				return nil
			}))
			s.down.Store(true)
			d, _ := deliverytest.New("m1", "")
			require.ErrorIs(t, h.Handle(ctx, d), middleware.ErrStoreUnavailable, "Handle while the store is down")
			s.down.Store(false)
			for _, id := range next {
				d, _ := deliverytest.New(id, "")
				assert.NoError(t, h.Handle(ctx, d), "Handle(%s) once the store is back", id)
			}
			_, ok := calls.Load("m1")
			assert.True(t, ok, "m1 was not processed once the store was back: its lost claim still held it")
		})
	}
}

// A context that the handler derives from its own ends when the lease may
// be lost, before the lease ends, so that no other consumer can claim the
// message while the handler's work under it goes on; and when the
// consumer's context is cancelled. Whatever layers lie between Dedup and
// the handler, and however the context is derived.
func TestDedupDerivedContextsEnd(t *testing.T) {
	const lease = 300 * time.Millisecond
	derivations := []struct {
		name   string
		derive func(context.Context) (context.Context, func())
	}{
		{"WithCancel", func(ctx context.Context) (context.Context, func()) {
			return context.WithCancel(ctx)
		}},
		{"WithTimeout", func(ctx context.Context) (context.Context, func()) {
			return context.WithTimeout(ctx, time.Hour)
		}},
		{"WithValue", func(ctx context.Context) (context.Context, func()) {
			return context.WithValue(ctx, errBoom, 1), func() {}
		}},
		{"WithCancelCause twice", func(ctx context.Context) (context.Context, func()) {
			ctx, cancel1 := context.WithCancelCause(ctx)
			ctx, cancel2 := context.WithCancelCause(ctx)
			return ctx, func() { cancel2(nil); cancel1(nil) }
		}},
		{"AfterFunc", func(ctx context.Context) (context.Context, func()) {
			// A context ended by context.AfterFunc's callback, as a
			// handler that hands the news to a client does.
			ended, cancel := context.WithCancelCause(context.Background())
			stop := context.AfterFunc(ctx, func() { cancel(context.Cause(ctx)) })
			return ended, func() { stop(); cancel(nil) }
		}},
	}
	stacks := []struct {
		name  string
		stack func(store.Store) rabbitmw.Middleware
	}{
		{"Dedup", func(s store.Store) rabbitmw.Middleware {
			return middleware.Dedup(s, middleware.DedupOptions{Lease: lease})
		}},
		{"Dedup Timeout", func(s store.Store) rabbitmw.Middleware {
			return rabbitmw.Chain(middleware.Dedup(s, middleware.DedupOptions{Lease: lease}), middleware.Timeout(time.Hour))
		}},
		{"Dedup Recover Timeout", func(s store.Store) rabbitmw.Middleware {
			return rabbitmw.Chain(middleware.Dedup(s, middleware.DedupOptions{Lease: lease}), middleware.Recover(), middleware.Timeout(time.Hour))
		}},
		{"Dedup Dedup Timeout", func(s store.Store) rabbitmw.Middleware {
			// The outer Dedup's claim is the one whose renewal hangs.
			return rabbitmw.Chain(middleware.Dedup(s, middleware.DedupOptions{Lease: lease}),
				middleware.Dedup(store.NewMemory(), middleware.DedupOptions{Lease: time.Hour}), middleware.Timeout(time.Hour))
		}},
	}
	for _, st := range stacks {
		for _, dv := range derivations {
			t.Run(st.name+"/"+dv.name+"/lease", func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					s := newHangingStore()
					defer s.unblock()
					var (
						ended, start time.Time
						during       store.Status
						cause        error
					)
					h := st.stack(s)(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
						ctx, cancel := dv.derive(ctx)
						defer cancel()
						select {
						case <-ctx.Done():
						case <-time.After(10 * lease):
							return errors.New("the derived context did not end")
						}
						ended, cause = time.Now(), context.Cause(ctx)
						during, _ = s.Store.Claim(context.Background(), "m1", "other", lease)
						return ctx.Err()
					}))
					d, _ := deliverytest.New("m1", "")
					start = time.Now()
					err := h.Handle(context.Background(), d)
					require.False(t, ended.IsZero(), "the handler's derived context did not end: %v", err)
					assert.Less(t, ended.Sub(start), lease, "the derived context ended after the lease")
					assert.Equal(t, store.Processing, during, "another consumer's Claim when the derived context ended")
					assert.ErrorIs(t, cause, middleware.ErrStoreUnavailable, "the derived context's cause")
				})
			})
			t.Run(st.name+"/"+dv.name+"/consumer", func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					consumer, stop := context.WithCancelCause(context.Background())
					stopped := errors.New("consumer stopped")
					var cause error
					h := st.stack(store.NewMemory())(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
						ctx, cancel := dv.derive(ctx)
						defer cancel()
						time.AfterFunc(time.Second, func() { stop(stopped) })
						select {
						case <-ctx.Done():
						case <-time.After(time.Hour):
							return errors.New("the derived context did not end")
						}
						cause = context.Cause(ctx)
						return ctx.Err()
					}))
					d, _ := deliverytest.New("m1", "")
					h.Handle(consumer, d)
					assert.ErrorIs(t, cause, stopped, "the derived context's cause")
				})
			})
		}
	}
}

// Handlers under more consumers' contexts than a Dedup watches at once
// each end with their own consumer's cancellation, and only with it;
// their derived contexts still carry their claim and their consumer's
// values once ended.
func TestDedupManyConsumers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const consumers, each = 20, 3
		type valueKey struct{}
		h := rabbitmw.Chain(middleware.Dedup(store.NewMemory(), middleware.DedupOptions{}), middleware.Timeout(time.Hour))(
			rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				ctx, cancel := context.WithCancel(ctx)
				defer cancel()
				<-ctx.Done()
				c, ok := middleware.ClaimFrom(ctx)
				switch {
				case !ok || c.Key() != d.MessageId:
					return fmt.Errorf("ClaimFrom = %v, %v; want the claim of %q", c, ok, d.MessageId)
				case ctx.Value(valueKey{}) != d.ConsumerTag:
					return fmt.Errorf("value %v; want %q", ctx.Value(valueKey{}), d.ConsumerTag)
				}
				return context.Cause(ctx)
			}))
		stops := make([]context.CancelCauseFunc, consumers)
		results := make([][each]error, consumers)
		var wg sync.WaitGroup
		for i := range consumers {
			tag := fmt.Sprintf("consumer-%d", i)
			var ctx context.Context
			ctx, stops[i] = context.WithCancelCause(context.WithValue(context.Background(), valueKey{}, tag))
			for j := range each {
				d, _ := deliverytest.New(fmt.Sprintf("m%d-%d", i, j), "")
				d.ConsumerTag = tag
				wg.Go(func() { results[i][j] = h.Handle(ctx, d) })
			}
		}
		synctest.Wait()
		for i := range consumers {
			stops[i](fmt.Errorf("stop %d", i))
			synctest.Wait()
			for k := range consumers {
				for j := range each {
					switch {
					case k <= i:
						assert.EqualError(t, results[k][j], fmt.Sprintf("stop %d", k), "handler %d of consumer %d after consumer %d stopped", j, k, i)
					default:
						assert.NoError(t, results[k][j], "handler %d of consumer %d, running, after consumer %d stopped", j, k, i)
					}
				}
			}
		}
		wg.Wait()
	})
}

// A handler that panics with contexts derived from its own, and
// goroutines waiting on them, leaves nothing running: its context ends as
// the panic goes through Dedup, and its claim is released.
func TestDedupPanicEndsDerivedContexts(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := store.NewMemory()
		var waiters sync.WaitGroup
		h := rabbitmw.Chain(middleware.Recover(), middleware.Dedup(s, middleware.DedupOptions{}), middleware.Timeout(time.Hour))(
			rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				derived, cancel := context.WithTimeout(context.WithValue(ctx, errBoom, 1), time.Hour)
				_ = cancel // not called: the panic comes first
				waiters.Go(func() { <-derived.Done() })
				context.AfterFunc(ctx, func() {})
				panic("kaboom")
			}))
		d, _ := deliverytest.New("m1", "")
		err := h.Handle(context.Background(), d)
		var pe *rabbitmw.PanicError
		require.ErrorAs(t, err, &pe)
		waiters.Wait() // the derived context ended
		got, _ := s.Claim(context.Background(), "m1", "next", time.Minute)
		assert.Equal(t, store.Claimed, got, "Claim after the panic (released)")
	})
}

// A handler that panics beneath Dedup and its Timeout ends its context as
// the panic goes through, as Timeout's own context would (it is ended by
// a deferred call): before Dedup releases the claim, and so never past
// its deadline, however long the release takes. A goroutine the handler
// left waiting on its context learns of the end at once.
func TestDedupPanicEndsContextBeforeRelease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = time.Second
		var (
			hctx          context.Context
			start, ended  time.Time
			cause         error
			liveAtRelease bool
			waiter        sync.WaitGroup
		)
		s := &slowRelease{Store: store.NewMemory(), before: func() {
			liveAtRelease = hctx.Err() == nil
			time.Sleep(10 * timeout) // the store is slow to answer
		}}
		h := rabbitmw.Chain(middleware.Dedup(s, middleware.DedupOptions{}), middleware.Timeout(timeout))(
			rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				hctx, start = ctx, time.Now()
				waiter.Go(func() {
					<-ctx.Done()
					ended, cause = time.Now(), context.Cause(ctx)
				})
				panic("kaboom")
			}))
		d, _ := deliverytest.New("m1", "")
		assert.PanicsWithValue(t, "kaboom", func() { h.Handle(context.Background(), d) })
		waiter.Wait()
		assert.False(t, liveAtRelease, "the handler's context was live while Dedup released its claim")
		assert.Equal(t, time.Duration(0), ended.Sub(start), "the handler's context ended this long after its panic (cause %v); its deadline was %v", cause, timeout)
		assert.Equal(t, context.Canceled, cause)
	})
}

// slowRelease is a Store whose Release calls before first.
type slowRelease struct {
	store.Store
	before func()
}

func (s *slowRelease) Release(ctx context.Context, key, token string) error {
	s.before()
	return s.Store.Release(ctx, key, token)
}

// ownDone is a consumer's context that the context package does not know:
// its Done channel is its own, so that context.AfterFunc, and the
// contexts derived from it, watch it each with a goroutine. It takes its
// values from the context it is made under.
type ownDone struct {
	context.Context
	done chan struct{}

	mu  sync.Mutex
	err error
}

func newOwnDone(parent context.Context) *ownDone {
	return &ownDone{Context: parent, done: make(chan struct{})}
}

func (c *ownDone) Done() <-chan struct{} { return c.done }

func (c *ownDone) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

// cancel ends c with context.Canceled, once.
func (c *ownDone) cancel() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil {
		c.err = context.Canceled
		close(c.done)
	}
}

// Dedup starts no goroutine that outlives the deliveries that needed it,
// under a consumer's context that the context package does not know
// (whose end it must watch with a goroutine), however its handler uses
// its context, one delivery after another or several at once: once they
// have returned, with the consumer's context still live, nothing Dedup
// started runs.
func TestDedupLeavesNoGoroutineUnderAnOwnContext(t *testing.T) {
	handlers := []struct {
		name string
		h    rabbitmw.HandlerFunc
	}{
		{"ignores its context", func(context.Context, *amqp.Delivery) error { return nil }},
		{"watches its context", func(ctx context.Context, _ *amqp.Delivery) error {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(time.Millisecond):
				return nil
			}
		}},
		{"derives a context", func(ctx context.Context, _ *amqp.Delivery) error {
			ctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			<-time.After(time.Millisecond)
			return ctx.Err()
		}},
	}
	stacks := []struct {
		name  string
		stack func(store.Store) rabbitmw.Middleware
	}{
		{"Dedup", func(s store.Store) rabbitmw.Middleware { return middleware.Dedup(s, middleware.DedupOptions{}) }},
		{"Stack", func(s store.Store) rabbitmw.Middleware { return middleware.Stack(s, middleware.StackOptions{}) }},
	}
	for _, st := range stacks {
		for _, hd := range handlers {
			for _, at := range []int{1, 4} {
				t.Run(fmt.Sprintf("%s/%s/%d at once", st.name, hd.name, at), func(t *testing.T) {
					before := goleak.IgnoreCurrent()
					consumer := newOwnDone(context.Background())
					defer consumer.cancel()
					h := st.stack(store.NewMemory())(hd.h)
					var wg sync.WaitGroup
					for i := range at {
						wg.Go(func() {
							for j := range 3 {
								d, _ := deliverytest.New(fmt.Sprintf("m%d-%d", i, j), "")
								assert.NoError(t, h.Handle(consumer, d))
							}
						})
					}
					wg.Wait()
					goleak.VerifyNone(t, before)
				})
			}
		}
	}
}

// Under a consumer's context that takes a goroutine to watch, deliveries
// that start and end at random, one after another and many at the same
// instant, let Dedup's watch of that context end and come back while
// their ends and starts race. Each handler under way when the consumer's
// context ends sees its end at once, none sees it earlier, and nothing
// Dedup started runs once they have all returned, before it ends and
// after (run with -race).
func TestDedupOwnContextWatchComesAndGoes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const deliveries = 300
		const cancelAt = 40 * time.Millisecond // after the first phase's deliveries
		rng := rand.New(rand.NewPCG(7, 11))
		type plan struct{ start, run time.Duration }
		plans := map[string]plan{}
		for i := range deliveries {
			p := plan{time.Duration(rng.IntN(20)) * time.Millisecond, time.Duration(rng.IntN(4)) * time.Millisecond}
			if i >= deliveries/2 { // the second phase, across the consumer's end
				p = plan{time.Duration(20+rng.IntN(40)) * time.Millisecond, time.Duration(rng.IntN(40)) * time.Millisecond}
			}
			plans[fmt.Sprint("m", i)] = p
		}
		consumer := newOwnDone(context.Background())
		t0 := time.Now()
		var mu sync.Mutex
		ran := map[string][2]time.Time{} // when each handler started and returned
		h := middleware.Dedup(store.NewMemory(), middleware.DedupOptions{})(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			start := time.Now()
			defer func() {
				mu.Lock()
				ran[d.MessageId] = [2]time.Time{start, time.Now()}
				mu.Unlock()
			}()
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(plans[d.MessageId].run):
				return nil
			}
		}))
		deliver := func(from, to int) {
			var wg sync.WaitGroup
			for i := from; i < to; i++ {
				id := fmt.Sprint("m", i)
				wg.Go(func() {
					time.Sleep(time.Until(t0.Add(plans[id].start)))
					d, _ := deliverytest.New(id, "")
					h.Handle(consumer, d)
				})
			}
			wg.Wait()
		}
		before := goleak.IgnoreCurrent()
		deliver(0, deliveries/2)
		synctest.Wait()
		require.NoError(t, goleak.Find(before), "with the consumer's context live, once the deliveries have returned")

		time.AfterFunc(time.Until(t0.Add(cancelAt)), consumer.cancel)
		deliver(deliveries/2, deliveries)
		synctest.Wait()
		require.NoError(t, goleak.Find(before), "once the consumer's context has ended")

		mu.Lock()
		defer mu.Unlock()
		for id, p := range plans {
			if _, ok := ran[id]; !ok && p.start < cancelAt {
				t.Errorf("%s, to start at %v, did not run", id, p.start)
			}
		}
		end := t0.Add(cancelAt)
		for id, r := range ran {
			want := r[0].Add(plans[id].run) // its own end
			if want.After(end) {
				want = end // the consumer's, unless it started later
				if r[0].After(end) {
					want = r[0]
				}
			}
			assert.True(t, r[1].Equal(want), "%s, started at %v, running %v: returned at %v; want %v",
				id, r[0].Sub(t0), plans[id].run, r[1].Sub(t0), want.Sub(t0))
		}
	})
}

type msgIDKey struct{}

// claimCheckingStore records which token claimed which key, and checks that
// every renewal extends a key by the token that claimed it, in the context
// of that key's delivery. Its renewals take a random time, some longer than
// their delivery, so that a claim's pooled renewal state is reused while a
// renewal of it is in flight.
type claimCheckingStore struct {
	store.Store
	mu     sync.Mutex
	rng    *rand.Rand
	tokens map[string]string // token -> key
	bad    []string
}

func (s *claimCheckingStore) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	s.mu.Lock()
	s.tokens[token] = key
	s.mu.Unlock()
	return s.Store.Claim(ctx, key, token, lease)
}

func (s *claimCheckingStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	s.mu.Lock()
	if s.tokens[token] != key {
		s.bad = append(s.bad, fmt.Sprintf("Extend(%s) by the token of %s", key, s.tokens[token]))
	}
	if id := ctx.Value(msgIDKey{}); id != key {
		s.bad = append(s.bad, fmt.Sprintf("Extend(%s) in the context of %v", key, id))
	}
	wait := time.Duration(s.rng.IntN(int(lease)))
	s.mu.Unlock()
	time.Sleep(wait)
	return s.Store.Extend(ctx, key, token, lease)
}

// Renewals that outlive their deliveries, and pooled renewal state reused
// meanwhile, never extend one delivery's claim with another's key, token or
// context, nor report a renewal under another delivery's key or context.
func TestDedupRenewalsKeepToTheirDelivery(t *testing.T) {
	for seed := range 20 {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				const lease = 300 * time.Millisecond
				rng := rand.New(rand.NewPCG(uint64(seed), 2))
				s := &claimCheckingStore{Store: store.NewMemory(), rng: rand.New(rand.NewPCG(uint64(seed), 3)), tokens: map[string]string{}}
				var mu sync.Mutex
				var badEvents []string
				observe := func(ctx context.Context, e middleware.DedupEvent) {
					if id := ctx.Value(msgIDKey{}); id != e.Key {
						mu.Lock()
						badEvents = append(badEvents, fmt.Sprintf("event %v of %s in the context of %v", e.Kind, e.Key, id))
						mu.Unlock()
					}
				}
				waits := make([]time.Duration, 40)
				for i := range waits {
					waits[i] = time.Duration(rng.IntN(int(lease)))
				}
				h := middleware.Dedup(s, middleware.DedupOptions{Lease: lease, Observe: observe})(rabbitmw.HandlerFunc(
					func(ctx context.Context, d *amqp.Delivery) error {
						var i int
						fmt.Sscanf(d.MessageId, "m%d", &i)
						select {
						case <-time.After(waits[i]):
						case <-ctx.Done():
						}
						return nil
					}))
				var wg sync.WaitGroup
				for c := range 4 {
					wg.Go(func() {
						for i := c; i < len(waits); i += 4 {
							d, _ := deliverytest.New(fmt.Sprintf("m%d", i), "")
							ctx := context.WithValue(context.Background(), msgIDKey{}, d.MessageId)
							h.Handle(ctx, d)
						}
					})
				}
				wg.Wait()
				time.Sleep(2 * lease) // the renewals still in flight return
				s.mu.Lock()
				assert.Empty(t, s.bad)
				s.mu.Unlock()
				mu.Lock()
				assert.Empty(t, badEvents)
				mu.Unlock()
			})
		})
	}
}

// A store that refuses the key after the claim (store.ErrKeyRejected from
// Extend, Complete or Release: over Redis, the claim key overwritten
// meanwhile by a value of another type) will refuse it again: Dedup tries
// no more. A refused renewal is a lost lease, which cancels the handler at
// once; a refused done mark dead-letters the message, saying the handler
// succeeded; a refused release is the handler's error, with the refusal.
func TestDedupKeyRejectedAfterClaim(t *testing.T) {
	rejected := fmt.Errorf("redisstore: Redis key %q holds a value of another type: %w", "msg:m1", store.ErrKeyRejected)
	tests := []struct {
		name    string
		op      string // the call that is refused
		handler func(ctx context.Context) error

		wantOutcome rabbitmw.Outcome
		wantIs      []error
		wantText    string        // in the result's text
		wantCalls   int64         // of op
		wantTook    time.Duration // from the claim to the result
	}{
		{
			name: "renewal refused: the lease is lost, the handler cancelled at once",
			op:   "extend",
			handler: func(ctx context.Context) error {
				<-ctx.Done()
				return context.Cause(ctx)
			},
			wantOutcome: rabbitmw.Delay, wantIs: []error{middleware.ErrLeaseLost, store.ErrKeyRejected},
			wantCalls: 1, wantTook: 10 * time.Second, // the first renewal, at Lease/3
		},
		{
			name:        "done mark refused: dead-lettered, saying the handler succeeded",
			op:          "complete",
			handler:     func(context.Context) error { return nil },
			wantOutcome: rabbitmw.DeadLetter, wantIs: []error{store.ErrKeyRejected},
			wantText:  "the handler succeeded",
			wantCalls: 1,
		},
		{
			name:        "release refused: the handler's error, with the refusal",
			op:          "release",
			handler:     func(context.Context) error { return errBoom },
			wantOutcome: rabbitmw.Requeue, wantIs: []error{errBoom, store.ErrKeyRejected},
			wantCalls: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := &faultyStore{Store: store.NewMemory()}
				switch tt.op {
				case "extend":
					set(&s.extend, rejected)
				case "complete":
					set(&s.complete, rejected)
				case "release":
					set(&s.release, rejected)
				}
				h := middleware.Dedup(s, middleware.DedupOptions{Lease: 30 * time.Second})(rabbitmw.HandlerFunc(
					func(ctx context.Context, _ *amqp.Delivery) error { return tt.handler(ctx) }))
				d, _ := deliverytest.New("m1", "")
				start := time.Now()
				err := h.Handle(context.Background(), d)

				assert.Equal(t, tt.wantTook, time.Since(start), "from the claim to the result")
				assert.Equal(t, tt.wantOutcome, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
				for _, target := range tt.wantIs {
					assert.ErrorIs(t, err, target)
				}
				if err != nil {
					assert.Contains(t, err.Error(), tt.wantText)
					assert.Contains(t, err.Error(), `"msg:m1" holds a value of another type`)
				}
				assert.Equal(t, tt.wantCalls, s.Calls(tt.op), "%s calls", tt.op)
			})
		})
	}
}
