package middleware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// The renewer queues the deadline of a Timeout beneath Dedup with the
// claim's lease, and takes it out with it: the deadline still ends the
// handler's context, and once the deliveries have returned (at once,
// with their consumer's context ended, in a panic, past their deadline)
// nothing is left queued.
func TestRenewerQueuesTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = time.Second
		var mu sync.Mutex
		errs := map[string]error{}
		handler := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			switch d.MessageId[0] {
			case 'w': // waits for its deadline
				// Bounded, so that a deadline never queued fails the
				// test rather than leave it waiting while the lease's
				// renewals move the bubble's clock for ever.
				cause := errors.New("the deadline did not end the context")
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
				case <-time.After(10 * timeout):
				}
				mu.Lock()
				errs[d.MessageId] = cause
				mu.Unlock()
				return ctx.Err()
			case 'c': // its consumer stops meanwhile
				<-ctx.Done()
				return ctx.Err()
			case 'p':
				panic("boom")
			}
			return nil
		})
		h := Dedup(store.NewMemory(), DedupOptions{Lease: time.Minute})(Timeout(timeout)(handler)).(*dedup)
		deliver := func(kinds string) {
			var wg sync.WaitGroup
			for i := range 40 {
				id := fmt.Sprintf("%c%d", kinds[i%len(kinds)], i)
				wg.Go(func() {
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					if id[0] == 'c' {
						time.AfterFunc(timeout/2, cancel)
					}
					defer func() {
						if v := recover(); v != nil && id[0] != 'p' {
							t.Errorf("%s: panic %v", id, v)
						}
					}()
					err := h.Handle(ctx, &amqp.Delivery{MessageId: id})
					if id[0] == 'w' && !errors.Is(err, ErrTimeout) {
						t.Errorf("%s: %v; want ErrTimeout", id, err)
					}
				})
			}
			wg.Wait()
			assertNothingQueued(t, h, kinds)
		}
		// Before their deadlines, which would take them out of the queue.
		deliver("ncp")
		deliver("w")
		require.Len(t, errs, 40)
		for id, err := range errs {
			assert.Equal(t, context.DeadlineExceeded, err, "%s: the cause of its context's end", id)
		}
	})
}

// A delivery whose lease ends while its handler runs, so that its claim
// is no longer queued for renewal when it returns (the store said the
// claim was lost, or a renewal hung until the lease might end), still
// takes its Timeout's deadline out of the queue.
func TestRenewerTakesTheDeadlineOutAfterTheLease(t *testing.T) {
	for _, tc := range []struct {
		name   string
		extend func(ctx context.Context, key string) error
		want   error // the cause of the handler's context's end
	}{
		{"lost", func(context.Context, string) error { return store.ErrLostClaim }, ErrLeaseLost},
		{"hanging", func(ctx context.Context, _ string) error { <-ctx.Done(); return ctx.Err() }, ErrStoreUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var cause error
				handler := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					<-ctx.Done()
					cause = context.Cause(ctx)
					return ctx.Err()
				})
				s := &extendAs{Store: store.NewMemory(), extend: tc.extend}
				h := Dedup(s, DedupOptions{Lease: 3 * time.Second})(Timeout(time.Minute)(handler)).(*dedup)
				err := h.Handle(context.Background(), &amqp.Delivery{MessageId: "m1"})
				assert.ErrorIs(t, cause, tc.want, "the cause of the handler's context's end")
				assert.ErrorIs(t, err, tc.want)
				assertNothingQueued(t, h, tc.name)
			})
		})
	}
}

// assertNothingQueued asserts that h's renewer holds no deadline and no
// claim; what names the case in the failure messages.
func assertNothingQueued(t *testing.T, h *dedup, what string) {
	t.Helper()
	h.renewer.mu.Lock()
	defer h.renewer.mu.Unlock()
	assert.Nil(t, h.renewer.deadlines.list.head, "%s: deadlines left queued", what)
	assert.Nil(t, h.renewer.claims.head, "%s: claims left queued", what)
}

// extendAs is a Store whose Extend answers as extend does.
type extendAs struct {
	store.Store
	extend func(ctx context.Context, key string) error
}

func (s *extendAs) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	return s.extend(ctx, key)
}

// Deliveries at random through one Dedup, whose handlers' deadlines share
// its renewer's queue, under Timeouts directly beneath it, nested, beneath
// a layer in between or above it, and over a ClaimingHandler that runs the
// handler in its own claim or declines: each handler's context ends once,
// at the first of its deadline, its consumer's context's end (a
// cancellation with a cause, or a deadline of its own), the loss of its
// lease and its return or panic, with the cause of that first (any of
// those that come at the same instant), and stays so after the delivery;
// the deliveries' results say why; and nothing is left queued. The
// instants are whole seconds, so that ends fall together, with each other
// and with other deliveries' renewals (every 3 s), deadlines and returns.
func TestRenewerDeadlinesAtRandom(t *testing.T) {
	for seed := range uint64(25) {
		synctest.Test(t, func(t *testing.T) { deliverAtRandom(t, seed, time.Second, true) })
	}
}

// On the real clock, with the race detector, each handler's context
// ends once, with one of the causes, and stays so; and nothing is left
// queued. When, and which cause, the test cannot tell.
func TestRenewerDeadlinesAtRandomOnTheClock(t *testing.T) {
	for seed := range uint64(4) {
		deliverAtRandom(t, seed, 10*time.Millisecond, false)
	}
}

// deliverAtRandom runs the deliveries of TestRenewerDeadlinesAtRandom
// drawn from seed, whose instants are multiples of unit, and checks, if
// exact, when each handler's context ended, why, and each delivery's
// result, which only a testing/synctest bubble's clock can tell.
func deliverAtRandom(t *testing.T, seed uint64, unit time.Duration, exact bool) {
	lease := 9 * unit
	errParent := errors.New("the consumer stops")
	rng := rand.New(rand.NewPCG(seed, 1))
	type plan struct {
		begin    time.Duration // from the test's start
		chain    int
		ret      time.Duration // when the handler returns, if it has not ended; <0: never (it waits for its end)
		panics   bool
		parent   time.Duration // when the consumer's context ends; <=0: never
		deadline bool          // the consumer's context ends at its deadline, else it is cancelled
		lose     bool          // the first renewal finds the claim lost
	}
	type seen struct {
		start, ended time.Time
		ends         int
		cause, err   error
		ctx          context.Context
		result       error
		panicked     bool
		ended1       chan struct{} // closed at the first end
	}
	const n = 60
	plans, seens := make([]plan, n), make([]seen, n)
	for i := range seens {
		seens[i].ended1 = make(chan struct{})
	}
	var mu sync.Mutex // guards seens
	var keepers sync.WaitGroup
	s := &extendAs{Store: store.NewMemory(), extend: func(_ context.Context, key string) error {
		var i int
		fmt.Sscan(key, &i)
		if plans[i].lose {
			return store.ErrLostClaim
		}
		return nil
	}}
	handler := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		var i int
		fmt.Sscan(d.MessageId, &i)
		mu.Lock()
		seens[i].start, seens[i].ctx = time.Now(), ctx
		mu.Unlock()
		// A goroutine that keeps the context beyond the handler's return,
		// and reads it as Dedup ends it and records the attempt.
		keepers.Go(func() {
			for range 3 {
				_, _, _ = ctx.Err(), context.Cause(ctx), ctx.Value(claimKey{})
				runtime.Gosched()
			}
			<-ctx.Done()
			_, _ = ctx.Err(), context.Cause(ctx)
		})
		context.AfterFunc(ctx, func() {
			mu.Lock()
			defer mu.Unlock()
			seens[i].ends++
			if seens[i].ends == 1 {
				close(seens[i].ended1)
			}
			seens[i].ended, seens[i].cause, seens[i].err = time.Now(), context.Cause(ctx), ctx.Err()
		})
		p := plans[i]
		if p.ret < 0 {
			p.ret = 100 * unit // bounded, so that a deadline never armed fails the test
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(p.ret):
		}
		if p.panics {
			panic("kaboom")
		}
		return nil
	})
	dd := Dedup(s, DedupOptions{Lease: lease})
	hidden := func(h rabbitmw.Handler) rabbitmw.Handler { return rabbitmw.HandlerFunc(h.Handle) }
	chains := []struct {
		h       rabbitmw.Handler
		timeout time.Duration // the shortest, from the handler's start
		above   bool          // Timeout is above Dedup: its error is not ErrTimeout
		unowned bool          // the handler claims for itself: Dedup holds no lease
	}{
		{h: dd(Timeout(2 * unit)(handler)), timeout: 2 * unit},
		{h: dd(Timeout(3 * unit)(handler)), timeout: 3 * unit},
		{h: dd(Timeout(7 * unit)(handler)), timeout: 7 * unit},
		{h: dd(Timeout(6 * unit)(Timeout(2 * unit)(handler))), timeout: 2 * unit},
		{h: dd(Timeout(2 * unit)(Timeout(6 * unit)(handler))), timeout: 2 * unit},
		{h: dd(hidden(Timeout(3 * unit)(handler))), timeout: 3 * unit},
		{h: Timeout(4 * unit)(dd(handler)), timeout: 4 * unit, above: true},
		{h: dd(Timeout(3 * unit)(claimsItself{handler, true})), timeout: 3 * unit, unowned: true},
		{h: dd(Timeout(7 * unit)(claimsItself{handler, false})), timeout: 7 * unit},
	}
	at := func(max int) time.Duration { return time.Duration(rng.IntN(max)) * unit }
	for i := range plans {
		// The consumer's context lives as the handler starts.
		plans[i] = plan{begin: at(6), chain: rng.IntN(len(chains)), ret: at(9) - 2*unit,
			panics: rng.IntN(4) == 0, parent: at(9) - 2*unit, deadline: rng.IntN(2) == 0, lose: rng.IntN(3) == 0}
	}
	begun := time.Now()
	var wg sync.WaitGroup
	for i, p := range plans {
		wg.Go(func() {
			time.Sleep(p.begin)
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			switch {
			case p.parent <= 0:
			case p.deadline:
				var cancelDeadline context.CancelFunc
				ctx, cancelDeadline = context.WithTimeout(ctx, p.parent)
				defer cancelDeadline()
			default:
				time.AfterFunc(p.parent, func() { cancel(errParent) })
			}
			defer func() {
				if v := recover(); v != nil {
					mu.Lock()
					seens[i].panicked = true
					mu.Unlock()
				}
			}()
			err := chains[p.chain].h.Handle(ctx, &amqp.Delivery{MessageId: fmt.Sprint(i)})
			mu.Lock()
			seens[i].result = err
			mu.Unlock()
		})
	}
	wg.Wait()
	keepers.Wait()
	if exact {
		synctest.Wait() // the callbacks of AfterFunc have run
	} else {
		for i := range seens {
			select {
			case <-seens[i].ended1:
			case <-time.After(10 * time.Second):
				t.Fatalf("seed %d, delivery %d %+v: the handler's context has not ended 10 s after the delivery", seed, i, plans[i])
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for i, p := range plans {
		sn := seens[i]
		start := begun.Add(p.begin)
		if exact {
			require.Equal(t, start, sn.start, "%d: the handler started late", i)
		}
		// The ends that may come first, and when.
		type end struct {
			at    time.Duration
			cause error
		}
		ends := []end{{chains[p.chain].timeout, context.DeadlineExceeded}}
		if p.parent > 0 {
			cause := errParent
			if p.deadline {
				cause = context.DeadlineExceeded
			}
			ends = append(ends, end{p.parent, cause})
		}
		if p.lose && !chains[p.chain].unowned {
			ends = append(ends, end{lease / 3, ErrLeaseLost})
		}
		if p.ret >= 0 {
			ends = append(ends, end{p.ret, context.Canceled})
		}
		first := slices.MinFunc(ends, func(a, b end) int { return cmp.Compare(a.at, b.at) }).at
		what := fmt.Sprintf("seed %d, delivery %d %+v: ended after %v with %v (%v)", seed, i, p, sn.ended.Sub(start), sn.cause, sn.result)
		assert.Equal(t, 1, sn.ends, "%s: ends", what)
		var causes []error
		for _, e := range ends {
			if e.at == first || !exact {
				causes = append(causes, e.cause)
			}
		}
		if exact {
			assert.Equal(t, first, sn.ended.Sub(start), "%s: when", what)
		} else {
			// A renewal late on a busy machine.
			causes = append(causes, ErrStoreUnavailable)
		}
		if !slices.ContainsFunc(causes, func(c error) bool { return errors.Is(sn.cause, c) }) {
			t.Errorf("%s: cause; want one of %v", what, causes)
		}
		want := context.Canceled
		if errors.Is(sn.cause, context.DeadlineExceeded) {
			want = context.DeadlineExceeded
		}
		assert.Equal(t, want, sn.err, "%s: Err", what)
		// And so it stays, after the delivery.
		assert.Equal(t, want, sn.ctx.Err(), "%s: Err after", what)
		assert.Equal(t, sn.cause, context.Cause(sn.ctx), "%s: Cause after", what)
		select {
		case <-sn.ctx.Done():
		default:
			t.Errorf("%s: Done open after", what)
		}
		// The result, where one end came first.
		if len(causes) > 1 || !exact {
			continue
		}
		switch c := causes[0]; {
		case c == context.Canceled && p.panics:
			assert.True(t, sn.panicked, "%s: no panic", what)
		case c == context.Canceled:
			assert.NoError(t, sn.result, what)
		case c == ErrLeaseLost:
			assert.ErrorIs(t, sn.result, ErrLeaseLost, what)
		case c == errParent:
			assert.ErrorIs(t, sn.result, context.Canceled, what)
			assert.NotErrorIs(t, sn.result, ErrTimeout, what)
		case p.parent == first: // the consumer's deadline
			assert.NotErrorIs(t, sn.result, ErrTimeout, what)
		case chains[p.chain].above:
			assert.ErrorIs(t, sn.result, context.DeadlineExceeded, what)
		default:
			assert.ErrorIs(t, sn.result, ErrTimeout, what)
		}
	}
	h := chains[0].h.(*dedup)
	assertNothingQueued(t, h, "after the deliveries")
}

// claimsItself is a ClaimingHandler that runs h in its own claim, if run,
// else declines.
type claimsItself struct {
	rabbitmw.Handler
	run bool
}

func (c claimsItself) HandleClaiming(ctx context.Context, d *amqp.Delivery, _ store.Store, _ string, _, _ time.Duration) (bool, error) {
	if !c.run {
		return false, nil
	}
	return true, c.Handle(ctx, d)
}
