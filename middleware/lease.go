package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/rabbitmw/rabbitmw/internal/text"
	"github.com/rabbitmw/rabbitmw/store"
)

// A renewer keeps alive the claims that one Dedup layer holds while their
// handlers run. Every claim has the same lease and is renewed at the same
// interval, so the claims due for renewal form a queue in order of due
// time: one timer, armed for the head of the queue, serves them all. A
// delivery that ends before its first renewal (nearly all of them) costs a
// queue insertion and removal under a mutex, and no goroutine, timer or
// allocation of its own.
//
// Renewals run on goroutines started by the timer's callback, one per
// claim due. Nothing waits for a renewal, since a store client may ignore
// its context's deadline and block for its own timeouts: a renewed claim
// stays queued while its renewal runs, due again one interval later, and
// if the renewal has not returned by then, the renewer decides on the clock
// alone whether to cancel the handler. Nor does stop wait for it, which
// would hold a finished handler's done mark until the lease might have
// ended: a renewal still in flight when its delivery ends runs on until
// the store answers (within its context's timeout, one interval, for a
// client that honours it), then ends and recycles the claim's state. Its
// answer no longer matters then: completing and releasing a claim check
// its owner.
//
// A renewal that extended its claim reports it to Observe on its own
// goroutine, where no Recover catches a panic: the renewal recovers it
// and keeps it for the delivery, and stop, which waits for such a call,
// returns it.
type renewer struct {
	store        store.Store
	lease, every time.Duration
	pool         sync.Pool // of *claimLease
	observe      func(context.Context, DedupEvent)

	// mu is also the lock of deadlines, which holds the deadlines of the
	// handlers' contexts: start and stop queue and unqueue a claim and
	// its handler's deadline under one lock.
	mu        *sync.Mutex
	deadlines *deadlineQueue
	claims    timerList[claimLease, *claimLease] // queued for renewal, in order of due time
	// observed, whose lock is mu, is signalled when the last call of
	// Observe of a stopped claim's renewals returns.
	observed sync.Cond
}

// A claimLease is the renewal state of one claim.
type claimLease struct {
	// handler is the handler's context, cancelled if the claim is lost.
	// It holds the claim's key and token, and its parent is the
	// delivery's context: a renewal runs outside the call chain, on the
	// timer's goroutine, and uses that (without its cancellation) to pass
	// the delivery's values to the store. Those fields never change.
	handler *claimContext

	// Guarded by renewer.mu.
	timerLinks[claimLease]
	renewAt    time.Time // when it is due for renewal, while queued
	stopped    bool      // the delivery has ended
	renewing   bool      // a renewal is in flight; it owns l once stopped
	observing  int       // calls of Observe by its renewals under way
	waiting    bool      // stop waits for them, and owns l until it returns
	panicked   error     // the first panic of those calls, a *rabbitmw.PanicError
	lost       error     // set when the store said the claim is gone
	validUntil time.Time // the end of the lease as of the last renewal
}

func (l *claimLease) links() *timerLinks[claimLease] { return &l.timerLinks }
func (l *claimLease) due() time.Time                 { return l.renewAt }

// queue queues l for its renewal at the given time; now is the current
// time. r.mu must be held.
func (r *renewer) queue(l *claimLease, at, now time.Time) {
	l.renewAt = at
	r.claims.push(l, now)
}

// newRenewer returns a renewer of claims in s, each for lease, that
// queues its handlers' deadlines in a deadlineQueue of its own, which
// it returns too.
func newRenewer(s store.Store, lease time.Duration) (*renewer, *deadlineQueue) {
	mu := new(sync.Mutex)
	r := &renewer{store: s, lease: lease, every: lease / 3, mu: mu, deadlines: newDeadlineQueue(mu)}
	r.observed.L = mu
	r.pool.New = func() any { return new(claimLease) }
	r.claims.fire = r.fire
	return r, r.deadlines
}

// start queues the claim of hctx (its key by its token, under its
// parent, the delivery's context), taken at claimedAt, for renewal every
// lease/3 until stop; now is the current time. The handler's context
// hctx is cancelled, with the cause, when a renewal finds the claim lost,
// and when the lease may end within an interval with no renewal to extend
// it (the last failed, or has not returned): the claim is then probably
// lost, though the store cannot say, and the handler gets the rest of the
// lease to stop. If hctx's deadline is queued by its lease (byLease), start
// queues it among r's deadlines, and stop takes it out.
func (r *renewer) start(claimedAt, now time.Time, hctx *claimContext) *claimLease {
	l := r.pool.Get().(*claimLease)
	l.handler = hctx
	c := &hctx.cancelContext
	r.mu.Lock()
	l.stopped, l.renewing, l.lost = false, false, nil
	l.validUntil = claimedAt.Add(r.lease)
	r.queue(l, claimedAt.Add(r.every), now)
	if c.byLease() && !c.deadline.IsZero() {
		// Even if c has ended since its watch began (its parent ended):
		// the queue's timer, or stop, takes it out.
		r.deadlines.list.push(c, now)
	}
	r.mu.Unlock()
	return l
}

// stop ends the renewals of l, without waiting for one in flight, but
// waiting for the calls of Observe that its renewals have begun. It
// reports whether the store said the claim was lost, until when the
// lease runs as of the last renewal that returned, and the first panic of
// those calls of Observe (a *rabbitmw.PanicError), if one panicked. l must
// not be used after stop.
func (r *renewer) stop(l *claimLease) (lost error, validUntil time.Time, panicked error) {
	r.mu.Lock()
	l.stopped = true // no renewal calls Observe from now on
	if l.queued {
		r.claims.unlink(l)
	}
	if c := &l.handler.cancelContext; c.byLease() && c.shared.deadlineLinks.queued {
		r.deadlines.list.unlink(c)
	}
	for l.observing > 0 {
		// A renewal that returns meanwhile, even once the last call has
		// signalled, leaves l to stop: stop still reads it.
		l.waiting = true
		r.observed.Wait()
	}
	l.waiting = false
	lost, validUntil, panicked = l.lost, l.validUntil, l.panicked
	recycle := !l.renewing // else the renewal in flight recycles l
	r.mu.Unlock()
	if recycle {
		r.recycle(l)
	}
	return lost, validUntil, panicked
}

// recycle returns l to the pool. Nothing may refer to l any more: it is
// stopped, not queued, and no renewal of it is in flight.
func (r *renewer) recycle(l *claimLease) {
	l.handler, l.lost, l.panicked = nil, nil, nil
	r.pool.Put(l)
}

// fire starts the renewals that are due, cancels the handlers whose
// lease may end before the renewal in flight, or the one it starts after
// a failed one, returns, and re-arms the timer for the rest.
func (r *renewer) fire() {
	r.mu.Lock()
	now, ok := r.claims.fired()
	if !ok {
		r.mu.Unlock()
		return
	}
	type expiry struct {
		key      string
		handler  *claimContext
		starting bool // a renewal starts; else the last has not returned
	}
	var expired []expiry
	for l := r.claims.due(now); l != nil; l = r.claims.due(now) {
		r.claims.unlink(l)
		switch {
		case !l.renewing:
			if r.mayEnd(l, now) {
				// The last renewal failed, a moment too early to cancel
				// (see renew), or the claim took that long: the lease may
				// end before this one returns. It still may extend the
				// claim, for a handler slow to stop.
				expired = append(expired, expiry{l.handler.claim.key, l.handler, true})
			}
			l.renewing = true
			go r.renew(l)
			r.queue(l, now.Add(r.every), now)
		case r.mayEnd(l, now):
			// The renewal started an interval ago has not returned, and
			// may not before the lease ends. l is not queued again.
			expired = append(expired, expiry{l.handler.claim.key, l.handler, false})
		default:
			r.queue(l, now.Add(r.every), now)
		}
	}
	r.claims.rearm(now)
	r.mu.Unlock()
	for _, e := range expired {
		if e.starting {
			e.handler.cancel(fmt.Errorf("%w: the lease on %s may end before a renewal returns: it ends within %v, and no renewal extended it", ErrStoreUnavailable, text.QuoteKey(e.key), r.every))
			continue
		}
		e.handler.cancel(fmt.Errorf("%w: the lease on %s could not be renewed before it ends: the store has not answered for %v", ErrStoreUnavailable, text.QuoteKey(e.key), r.every))
	}
}

// mayEnd reports whether l's lease ends within one interval of now.
// r.mu must be held.
func (r *renewer) mayEnd(l *claimLease, now time.Time) bool {
	return !l.validUntil.After(now.Add(r.every))
}

// renew extends l's claim once, and reports it to Observe if it did. It
// cancels the handler if the claim is lost, or if the renewal failed and
// the lease may end before the next. If the delivery ended meanwhile, it
// only recycles l, unless stop, waiting for a call of Observe, does.
func (r *renewer) renew(l *claimLease) {
	c := &l.handler.claim
	ctx, cancel := context.WithTimeout(context.WithoutCancel(l.handler.parent), r.every)
	at := time.Now()
	err := r.store.Extend(ctx, c.key, c.token, r.lease)
	cancel()

	r.mu.Lock()
	l.renewing = false
	if l.stopped {
		recycle := !l.waiting // else stop recycles l once it wakes
		r.mu.Unlock()
		if recycle {
			r.recycle(l)
		}
		return
	}
	var cause error
	switch {
	case err == nil:
		l.validUntil = at.Add(r.lease)
		if !l.queued {
			// fire gave up on this renewal and cancelled the handler; the
			// renewal came back after all. Go on renewing: a handler that
			// is slow to stop keeps its claim for as long as it runs.
			now := time.Now()
			r.queue(l, now.Add(r.every), now)
		}
	case errors.Is(err, store.ErrLostClaim):
		l.lost = fmt.Errorf("%w: %s was taken over or deleted while the handler ran: %w", ErrLeaseLost, text.QuoteKey(c.key), err)
		cause = l.lost
	case errors.Is(err, store.ErrKeyRejected):
		// The store refuses the key now (in Redis, something else wrote
		// a value of another type over the claim), and will refuse it
		// again: the claim is lost as surely.
		l.lost = fmt.Errorf("%w: the store refused %s while the handler ran: %w", ErrLeaseLost, text.QuoteKey(c.key), err)
		cause = l.lost
	case r.mayEnd(l, time.Now()):
		cause = fmt.Errorf("%w: the lease on %s could not be renewed before it ends: %w", ErrStoreUnavailable, text.QuoteKey(c.key), err)
	}
	if cause != nil && l.queued {
		r.claims.unlink(l)
	}
	observe := err == nil && r.observe != nil
	if observe {
		l.observing++ // stop waits for it
	}
	handler := l.handler
	r.mu.Unlock()
	if observe {
		r.observeRenewal(l, handler.parent, c.key)
	}
	if cause != nil {
		handler.cancel(cause)
	}
}

// observeRenewal reports the renewal of l's claim of key to Observe, with
// ctx, its delivery's context. A panic of Observe, on this goroutine of
// the renewer's, would end the process: it is recovered instead and kept
// for the delivery, which stop returns it to. The renewals go on.
func (r *renewer) observeRenewal(l *claimLease, ctx context.Context, key string) {
	var panicked error
	func() {
		defer recoverInto(&panicked)
		notify(r.observe, ctx, DedupLeaseRenewed, key, nil)
	}()
	r.mu.Lock()
	if l.panicked == nil {
		l.panicked = panicked
	}
	l.observing--
	if l.observing == 0 && l.stopped {
		r.observed.Broadcast()
	}
	r.mu.Unlock()
}
