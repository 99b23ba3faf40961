package middleware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/clock"
	"github.com/rabbitmw/rabbitmw/internal/errchain"
	"github.com/rabbitmw/rabbitmw/internal/recording"
	"github.com/rabbitmw/rabbitmw/internal/text"
	"github.com/rabbitmw/rabbitmw/store"
)

// Errors returned by [Dedup], always wrapped in a rabbitmw.RetryAfter: the
// message is tried again later. Each is marked rabbitmw.NotCounted, and so
// is every error that wraps one: [Retry] does not count them as failed
// attempts, since the handler did not fail (it did not run, or it ran and
// succeeded).
var (
	// ErrBusy: another consumer holds the claim on the message's key.
	ErrBusy = rabbitmw.NotCounted(&sentinel{"middleware: message is being processed by another consumer", "busy"})
	// ErrStoreUnavailable: the store did not answer, so the message was
	// not processed (fail closed), or its done mark could not be written.
	ErrStoreUnavailable = rabbitmw.NotCounted(&sentinel{"middleware: idempotency store unavailable", "store_unavailable"})
	// ErrLeaseLost: the claim was taken over or deleted while the handler
	// ran, so its result was not recorded.
	ErrLeaseLost = rabbitmw.NotCounted(&sentinel{"middleware: claim lost", "lease_lost"})
)

// ErrAbandoned is returned by [Dedup] when the message's last attempt never
// finished: the store found its claim abandoned (store.Abandoned), because
// the consumer that held it died, or lost the store, before its lease
// ended, without marking the message done or releasing it. Dedup does not
// run the handler; the next claim of the message can take it. Unlike
// Dedup's other errors, it is a failed attempt, and [Retry] counts it: a
// message that kills every consumer that handles it is dead-lettered after
// MaxAttempts crashes instead of looping.
var ErrAbandoned error = &sentinel{"middleware: an attempt never finished: its consumer died, or lost its lease, while handling the message", "abandoned"}

// DedupOptions configures [Dedup]. The zero value selects the defaults.
// Dedup panics on a negative duration.
type DedupOptions struct {
	// Lease is how long a claim lasts unless renewed. While the handler
	// runs, Dedup renews it every Lease/3. Default 5 minutes.
	Lease time.Duration
	// Retention is how long a done mark is kept: duplicates that arrive
	// later than this are processed again. Default 24 hours.
	Retention time.Duration
	// BusyDelay is how long a delivery waits before it is tried again when
	// another consumer holds its claim. Default 5 seconds.
	BusyDelay time.Duration
	// UnavailableDelay is how long a delivery waits before it is tried
	// again when the store cannot be reached. Default 5 seconds.
	UnavailableDelay time.Duration
	// FailOpen, when the store cannot be reached for the claim, runs the
	// handler anyway, without a claim, instead of trying the message again
	// later. It trades the at-most-once effect for availability: a message
	// may then be processed twice. The handler's context then carries no
	// [Claim], and tells why ([FailOpenCause]).
	FailOpen bool
	// Observe, if set, is called with each of Dedup's events (see
	// [DedupEvent]), with the context of the delivery it concerns, before
	// Dedup returns that delivery's result. It is meant for metrics and
	// traces: it must be quick and safe for concurrent use.
	//
	// Each event but DedupLeaseRenewed is reported on the delivery's
	// goroutine, where a panic of Observe goes on up the chain, to
	// [Recover], as a panic of a layer would; on DedupClaimed, the claim
	// is released first, as on a panic of the handler. A renewal reports
	// DedupLeaseRenewed on a goroutine of its own, where a panic would end
	// the process: it is recovered there, and the claim's renewals go on.
	// Once the handler has returned and its attempt is recorded in the
	// store as if nothing had panicked (a success marked done, a failure
	// released), the delivery's result is then a [*rabbitmw.PanicError]
	// with the first such panic's value and the renewal's stack, in place
	// of the result Dedup would have returned. If the handler panics
	// itself, its panic goes on, and the renewal's is dropped.
	Observe func(ctx context.Context, e DedupEvent)
}

// Dedup returns a layer that lets each message's handler succeed at most
// once, however many times the message is delivered, across consumers that
// share s.
//
// For each delivery, Dedup computes the message's key and claims it in s
// with a fresh owner token and a lease, in one atomic operation. Then:
//
//   - key done: the message is a duplicate; Dedup returns an error that
//     wraps rabbitmw.ErrDuplicate (it is acknowledged) without calling
//     the handler;
//   - key claimed by another consumer (or by one that died, until its
//     lease ends): Dedup returns ErrBusy, to be tried again after
//     BusyDelay (not at once, which would spin);
//   - key abandoned (the lease of its last claim ended with neither done
//     mark nor release): Dedup returns ErrAbandoned without calling the
//     handler; the store has removed the abandoned claim;
//   - claim won: Dedup calls the handler, renewing the lease every Lease/3
//     while it runs. On success it marks the key done, if its token still
//     owns it (unless the handler marked it done itself: see [Claim]); on
//     error or panic it releases the claim, if its token still owns it, so
//     another attempt can claim it, and returns the error (or lets the
//     panic go on).
//
// If the handler directly beneath Dedup (or beneath its [Timeout]) is a
// [ClaimingHandler], Dedup first lets it claim the key itself, in the
// transaction of its effect, and claims as above only if it does not.
//
// If the lease is lost while the handler runs (the key was taken over or
// deleted, or renewal failed for so long that the lease may have ended),
// Dedup cancels the handler's context with the cause, and does not mark the
// key done; the message is tried again after BusyDelay. If the handler
// ignores the cancellation and completes its effect anyway, the effect may
// happen twice: a lease bounds, it does not fence.
//
// If s cannot be reached, Dedup fails closed by default: the handler does
// not run and the message is tried again after UnavailableDelay, so nothing
// is processed twice and nothing is lost. A claim whose answer was lost
// may have taken effect: Dedup releases it at once, or, when the store
// does not answer that either, with its next claim that the store answers
// (up to 256 such claims, in this process's memory), so that the message
// is not busy until the lease ends. If marking done fails that way
// after the handler succeeded, Dedup retries until the lease would end; if
// it still fails, the message is tried again later, and its effect repeats
// only if the lease has expired by then.
//
// Once the handler has returned, the store calls that record its attempt
// (the done mark, the release, and the release of a claim whose answer was
// lost) run under a context that ctx's cancellation does not end: a
// consumer that stops cancels its handlers' context at its shutdown
// deadline, possibly as a handler returns, and a finished message must
// still be marked done, or released, rather than be redelivered to wait
// out its lease and run again. Each is bounded instead: the done mark by
// the end of the lease, the release by UnavailableDelay and the end of the
// lease, at least a second each. A consumer of package broker that stops
// waits for them, up to those bounds, before it returns and lets its
// process exit. The goroutines that Dedup starts, and when each ends, are
// listed under "Goroutines" in the package documentation.
//
// Place Dedup beneath [Retry] ([Stack] does). Dedup returns ErrAbandoned
// without running the layers beneath it, so a Retry beneath Dedup never
// counts a death: a message that kills its consumer is requeued after
// each death, for ever, never dead-lettered. (Its other failures are
// counted.) Dedup panics, when the chain is built, on a Retry directly
// beneath it, or beneath Recover or Timeout; any other layer in between
// (Log, Keys, one of your own) hides the Retry from it.
//
// Dedup panics if s is nil.
func Dedup(s store.Store, opts DedupOptions) rabbitmw.Middleware {
	if s == nil {
		panic("middleware: Dedup: nil store")
	}
	for _, o := range []struct {
		name string
		d    time.Duration
	}{
		{"Lease", opts.Lease}, {"Retention", opts.Retention},
		{"BusyDelay", opts.BusyDelay}, {"UnavailableDelay", opts.UnavailableDelay},
	} {
		if o.d < 0 {
			panic(fmt.Sprintf("middleware: Dedup: negative %s %v", o.name, o.d))
		}
	}
	cfg := dedupConfig{
		store:       s,
		keying:      newKeying(Keying{}, "Dedup"),
		lease:       cmp.Or(opts.Lease, defaultLease),
		retention:   cmp.Or(opts.Retention, 24*time.Hour),
		busy:        cmp.Or(opts.BusyDelay, 5*time.Second),
		unavailable: cmp.Or(opts.UnavailableDelay, 5*time.Second),
		failOpen:    opts.FailOpen,
		observe:     opts.Observe,
	}
	var deadlines *deadlineQueue
	cfg.renewer, deadlines = newRenewer(s, cfg.lease)
	cfg.orphans = new(orphans)
	cfg.watchers = &watchers{parents: new(parentWatcher), deadlines: deadlines}
	cfg.renewer.observe = opts.Observe
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		if retryBeneath(next) {
			panic("middleware: Dedup: a Retry beneath Dedup never sees ErrAbandoned, so a message that kills its consumer is never dead-lettered: put Retry above Dedup (see Stack)")
		}
		h := &dedup{dedupConfig: cfg, next: next}
		h.timed, _ = next.(*timeout)
		if h.timed != nil {
			h.claiming, _ = h.timed.next.(ClaimingHandler)
		} else {
			h.claiming, _ = next.(ClaimingHandler)
		}
		return h
	}
}

// retryBeneath reports whether h is a Retry layer's handler, or has one
// beneath Recover and Timeout layers, whose handlers it can see into. Any
// other layer hides what is beneath it.
func retryBeneath(h rabbitmw.Handler) bool {
	for {
		switch x := h.(type) {
		case *retry:
			return true
		case recoverer:
			h = x.next
		case *timeout:
			h = x.next
		default:
			return false
		}
	}
}

// defaultLease is DedupOptions.Lease's default.
const defaultLease = 5 * time.Minute

type dedupConfig struct {
	store       store.Store
	keying      *keying
	lease       time.Duration
	retention   time.Duration
	busy        time.Duration
	unavailable time.Duration
	failOpen    bool
	observe     func(context.Context, DedupEvent)
	renewer     *renewer
	orphans     *orphans // shared by the handlers this Dedup wraps
	// watchers watch the parents of the handlers' contexts, and their
	// deadlines, given a Timeout's; shared, too.
	watchers *watchers
}

type dedup struct {
	dedupConfig
	next rabbitmw.Handler
	// timed is next if next is a Timeout layer's handler, which run calls
	// through: it runs the handler beneath it under the claim's context,
	// given the deadline, rather than under a context of Timeout's own
	// beneath it, with the same result (the stack's layers share one
	// context per delivery).
	timed *timeout
	// claiming is the handler directly beneath, or beneath timed, if it
	// claims keys in its own transaction.
	claiming ClaimingHandler
}

func (h *dedup) Handle(ctx context.Context, d *amqp.Delivery) error {
	return h.handleKeyed(ctx, d, keyed{})
}

// handleKeyed implements [keyedHandler]: above is the key that a layer
// above made for d, or none (above.by nil).
func (h *dedup) handleKeyed(ctx context.Context, d *amqp.Delivery, above keyed) error {
	if d == nil {
		return rabbitmw.ErrNoDelivery
	}
	if ctx == nil {
		ctx = context.Background()
	}
	key, down, err := h.keying.resolve(ctx, d, above)
	if errors.Is(err, ErrKeyMismatch) {
		return rabbitmw.Permanent(err)
	}
	if err != nil {
		return rabbitmw.Permanent(fmt.Errorf("middleware: dedup: no idempotency key: %w", err))
	}
	if h.claiming != nil {
		done, err := h.runClaiming(ctx, d, key, down)
		err = errchain.Safe(err)
		switch {
		case done:
			return err
		case errors.Is(err, ErrBusy):
			notify(h.observe, ctx, DedupBusy, key, nil)
			return rabbitmw.RetryAfter(&keyError{key: key, err: ErrBusy}, h.busy)
		}
	}
	token := newToken()
	start := time.Now()
	claimed, err := h.claim(ctx, key, token)
	if !claimed {
		if open, ok := err.(failedOpen); ok {
			// Without a claim; the handler can tell why (FailOpenCause).
			return handleKeyed(h.next, context.WithValue(ctx, failOpenKey{}, open.err), d, down)
		}
		return err
	}
	a := h.run(ctx, d, key, token, start, down)
	err = h.record(ctx, key, token, a)
	if a.panicked != nil {
		// Observe panicked on a renewal: the attempt is recorded as it
		// ran, and the panic is the delivery's failure (see
		// DedupOptions.Observe).
		return a.panicked
	}
	return err
}

// A failedOpen is claim's answer when the store cannot be reached and
// FailOpen asks for the handler to run anyway, without a claim: err is
// what [FailOpenCause] returns to the handler.
type failedOpen struct{ err error }

func (e failedOpen) Error() string { return e.err.Error() }

// claim claims key for token and reports whether the claim was won. If it
// was not, err is the delivery's result (a duplicate, a busy or abandoned
// key, an unreachable store), except that it is a failedOpen when the
// store cannot be reached and FailOpen asks for the handler to run
// anyway.
func (h *dedup) claim(ctx context.Context, key, token string) (claimed bool, err error) {
	status, err := h.store.Claim(ctx, key, token, h.lease)
	if err == nil && h.orphans.release(ctx, h.store, key) && status == store.Processing {
		// The key was held by a claim of ours whose answer was lost, and
		// is free now.
		status, err = h.store.Claim(ctx, key, token, h.lease)
	}
	switch {
	case errors.Is(err, store.ErrKeyRejected):
		// The store answered, took nothing, and would refuse the key
		// again: the message is at fault, and FailOpen, which is for a
		// store out of reach, does not apply.
		notify(h.observe, ctx, DedupRejected, key, err)
		return false, rabbitmw.Permanent(&keyError{key: key, err: err})
	case err != nil:
		// The claim may have taken effect though its answer was lost:
		// release it, if this token holds it, rather than leave it to
		// block the message until the lease ends; if the store does not
		// answer that either, release it once it answers again.
		h.releaseOrKeep(ctx, key, token, time.Now().Add(time.Second), time.Now().Add(h.lease))
		notify(h.observe, ctx, DedupUnavailable, key, err)
		err = fmt.Errorf("%w: claim %s: %w", ErrStoreUnavailable, text.QuoteKey(key), err)
		if h.failOpen && ctx.Err() == nil {
			return false, failedOpen{err}
		}
		return false, rabbitmw.RetryAfter(err, h.unavailable)
	case status == store.Done:
		notify(h.observe, ctx, DedupDuplicate, key, nil)
		return false, &keyError{key: key, err: rabbitmw.ErrDuplicate}
	case status == store.Processing:
		notify(h.observe, ctx, DedupBusy, key, nil)
		return false, rabbitmw.RetryAfter(&keyError{key: key, err: ErrBusy}, h.busy)
	case status == store.Abandoned:
		// Nothing to wait for: the next claim takes the key. Retry counts
		// the attempt, and tries again.
		notify(h.observe, ctx, DedupAbandoned, key, nil)
		return false, &keyError{key: key, err: ErrAbandoned}
	case status != store.Claimed:
		err = fmt.Errorf("%w: claim %s: invalid status %v", ErrStoreUnavailable, text.QuoteKey(key), status)
		notify(h.observe, ctx, DedupUnavailable, key, err)
		return false, rabbitmw.RetryAfter(err, h.unavailable)
	}
	h.claimed(ctx, key, token)
	return true, nil
}

// claimed reports DedupClaimed for the claim of key by token, won. If
// Observe panics, the claim is released before the panic goes on, as a
// panic of the handler releases it, so that the next delivery of the
// message does not wait for the lease nor find the claim abandoned.
func (h *dedup) claimed(ctx context.Context, key, token string) {
	returned := false
	defer func() {
		if !returned {
			h.releaseOrKeep(ctx, key, token, time.Now().Add(time.Second), time.Now().Add(h.lease))
		}
	}()
	notify(h.observe, ctx, DedupClaimed, key, nil)
	returned = true
}

// releaseOrKeep releases the claim of key by token, held until
// validUntil at most, within deadline, where nothing is to be recorded:
// a claim whose answer was lost, or one won when a panic came. If the
// store does not answer, the claim is kept to release once it answers a
// claim of key again (see orphans), so that the next delivery of the
// message is not held up until the lease ends.
func (h *dedup) releaseOrKeep(ctx context.Context, key, token string, deadline, validUntil time.Time) {
	rctx := settling(ctx, deadline)
	defer rctx.end()
	if err := h.store.Release(rctx, key, token); err != nil && !errors.Is(err, store.ErrLostClaim) {
		h.orphans.add(key, token, validUntil)
	}
}

// runClaiming offers the delivery d of key to the handler beneath, which
// claims key in its own transaction if it can (see [ClaimingHandler]),
// under the context that run would give it, and reports whether err is
// the delivery's result: the handler ran, or its context ended while it
// waited to claim.
func (h *dedup) runClaiming(ctx context.Context, d *amqp.Delivery, key string, down keyed) (done bool, err error) {
	var now, deadline time.Time
	if h.timed != nil {
		now = time.Now()
		deadline = now.Add(h.timed.d)
	}
	cc := newClaimContext(ctx, key, "", h.retention, deadline, h.watchers)
	cc.handDown(down)
	cc.watch(now)
	defer cc.end()
	ran, err := h.claiming.HandleClaiming(cc, d, h.store, key, h.lease, h.retention)
	switch {
	case ran:
		notify(h.observe, ctx, DedupClaimed, key, nil)
		if errors.Is(err, ErrLeaseLost) {
			// The handler's claim ended before its success was recorded.
			notify(h.observe, ctx, DedupLeaseLost, key, err)
		}
	case errors.Is(err, ErrBusy) || cc.Err() == nil:
		return false, err
	case err == nil:
		// Declined once its context ended (it could not try): a claim of
		// Dedup's would run the handler with a new deadline, past the
		// one that ended. Nothing ran: not the message's failure.
		err = rabbitmw.NotCounted(rabbitmw.RetryAfter(fmt.Errorf("middleware: dedup: key %s: the handler's context ended before it could claim: %w", text.QuoteKey(key), context.Cause(cc)), h.unavailable))
	}
	// The handler ran; or its context ended before it claimed, and the
	// delivery, which got no answer, gets no event.
	if h.timed != nil {
		err = h.timed.result(ctx, &cc.cancelContext, err)
	}
	return true, err
}

// An attempt is what running the handler under a claim leaves for record.
type attempt struct {
	err        error     // the handler's result
	marked     bool      // the handler marked the key done itself ([Claim.MarkedDone])
	cause      error     // why the handler's context ended, if it did
	lost       error     // why the lease was lost while it ran, if it was
	validUntil time.Time // until when the claim is known to be held
	panicked   error     // a panic of Observe on a renewal, a *rabbitmw.PanicError
	// settle is the context of the store call that records the attempt,
	// to be begun (see [settlingContext.begin]).
	settle *settlingContext
}

// run calls the handler under the claim of key by token, taken at start,
// renewing the lease while it runs, and cancelling its context if the
// lease is lost; its context carries down the key for the layers beneath
// (see [keying.resolve]). If the handler panics, run releases the claim
// and lets the panic go on.
func (h *dedup) run(ctx context.Context, d *amqp.Delivery, key, token string, start time.Time, down keyed) attempt {
	// The claim is won: the handler starts. start, plus the time since
	// on the monotonic clock alone, is the time that time.Now would read
	// (bar a step of the wall clock meanwhile), at half its cost: time.Now
	// reads both clocks, and a read is not cheap on every machine.
	now := start.Add(time.Since(start))
	var deadline time.Time
	if h.timed != nil {
		deadline = now.Add(h.timed.d)
	}
	cc := newClaimContext(ctx, key, token, h.retention, deadline, h.watchers)
	cc.handDown(down)
	cc.shared.byLease = true // its deadline is queued with its lease
	cc.watch(now)
	l := h.renewer.start(start, now, cc)

	finished := false
	defer func() {
		if !finished { // the handler panicked: release, and let the panic go on
			// The context ends first, as on return: stop takes its
			// deadline out of the queue, and the release may take long.
			cc.end()
			_, validUntil, _ := h.renewer.stop(l)
			h.releaseOrKeep(ctx, key, token, atLeastASecond(validUntil), validUntil)
		}
	}()
	a := attempt{settle: &cc.settle}
	if h.timed != nil {
		a.err = h.timed.result(ctx, &cc.cancelContext, h.timed.next.Handle(cc, d))
	} else {
		a.err = errchain.Safe(h.next.Handle(cc, d))
	}
	finished = true
	// Why the handler's context ended, if it did, as it ends now, before
	// anything later can cancel it.
	a.cause = cc.endCause()
	a.lost, a.validUntil, a.panicked = h.renewer.stop(l)
	a.marked = cc.claim.marked.Load()
	return a
}

// record writes what the attempt a of the claim of key by token leaves in
// the store (a done mark, or the release of the claim), and returns the
// delivery's result.
func (h *dedup) record(ctx context.Context, key, token string, a attempt) error {
	switch {
	case a.err == nil && a.marked:
		// The handler's own commit marked the key done: that is the
		// answer, even if a renewal since found the claim gone (done).
		return nil
	case a.lost != nil:
		// Another owner has the key, or nobody: nothing to mark.
		notify(h.observe, ctx, DedupLeaseLost, key, a.lost)
		return rabbitmw.RetryAfter(errors.Join(a.err, a.lost), h.busy)
	case a.err != nil:
		return h.release(ctx, key, token, a)
	}
	return h.complete(ctx, key, token, a)
}

// release releases the claim of key by token after the handler failed (the
// attempt a), and returns the delivery's result: the handler's error, with
// the release's if it failed.
func (h *dedup) release(ctx context.Context, key, token string, a attempt) error {
	// Release at once if the store answers, so the next attempt need not
	// wait for the lease; if it does not, the lease frees the key.
	err := a.err
	deadline := time.Now().Add(h.unavailable)
	if a.validUntil.Before(deadline) {
		deadline = a.validUntil
	}
	if _, rerr := h.persist(ctx, a.settle, deadline, func(ctx context.Context) error {
		return h.store.Release(ctx, key, token)
	}); rerr != nil && !errors.Is(rerr, store.ErrLostClaim) {
		err = errors.Join(err, fmt.Errorf("middleware: dedup: release %s: %w", text.QuoteKey(key), rerr))
	}
	if ctx.Err() == nil && errors.Is(a.cause, ErrStoreUnavailable) {
		// Dedup cut the handler short because the store could not renew
		// the lease: that is not the message's failure.
		return rabbitmw.RetryAfter(errors.Join(err, a.cause), h.unavailable)
	}
	return err
}

// complete marks key done under token after the handler succeeded (the
// attempt a), while the claim is held, and returns the delivery's result:
// nil, or the reason the message must be tried again.
func (h *dedup) complete(ctx context.Context, key, token string, a attempt) error {
	retried, err := h.persist(ctx, a.settle, a.validUntil, func(ctx context.Context) error {
		return h.store.Complete(ctx, key, token, h.retention)
	})
	switch {
	case err == nil:
		return nil
	case errors.Is(err, store.ErrLostClaim) && retried:
		// Likelier than a takeover: an earlier attempt marked the key done
		// and its answer was lost. The redelivery will tell (a duplicate).
		notify(h.observe, ctx, DedupLeaseLost, key, err)
		return rabbitmw.RetryAfter(fmt.Errorf("%w: the handler succeeded; marking %s done failed, then found the claim gone, most likely marked done by the failed attempt: %w", ErrLeaseLost, text.QuoteKey(key), err), h.busy)
	case errors.Is(err, store.ErrLostClaim):
		notify(h.observe, ctx, DedupLeaseLost, key, err)
		return rabbitmw.RetryAfter(fmt.Errorf("%w: the handler succeeded, but the claim of %s was no longer held when it was to be marked done (its lease had ended, or another owner had claimed it): %w", ErrLeaseLost, text.QuoteKey(key), err), h.busy)
	case errors.Is(err, store.ErrKeyRejected):
		// The store refuses the key now, and would refuse the next claim:
		// the message leaves with the reason, and the word that its
		// effect took place.
		notify(h.observe, ctx, DedupRejected, key, err)
		return rabbitmw.Permanent(fmt.Errorf("middleware: dedup: the handler succeeded, but the store refused to mark %s done: %w", text.QuoteKey(key), err))
	default:
		return rabbitmw.RetryAfter(fmt.Errorf("%w: the handler succeeded, but marking %s done failed: %w", ErrStoreUnavailable, text.QuoteKey(key), err), h.unavailable)
	}
}

// A keyError reports what Dedup found for a key. It is a type rather than
// fmt.Errorf because duplicates and busy keys are common enough for the cost
// of formatting to show: the text is built only when someone reads it.
type keyError struct {
	key string
	err error
}

func (e *keyError) Error() string {
	return "middleware: dedup: key " + text.QuoteKey(e.key) + ": " + e.err.Error()
}

func (e *keyError) Unwrap() error { return e.err }

// persist runs op, a store call that must not be lost after the handler
// ran, and retries it while the store cannot be reached, until deadline;
// not when it answered ErrLostClaim or ErrKeyRejected, which it would
// answer again.
// op runs under sctx, begun as a context of [settling]: the cancellation
// of ctx does not end it, so that a consumer that stops (and cancels its
// handlers' context at its shutdown deadline) still records a handler
// that has returned. The first try has at least a second even if deadline is
// sooner: the store checks the claim's owner on its own clock. persist
// reports whether op was tried more than once, and returns op's last
// error.
func (h *dedup) persist(ctx context.Context, sctx *settlingContext, deadline time.Time, op func(context.Context) error) (retried bool, err error) {
	sctx.begin(ctx, atLeastASecond(deadline))
	defer sctx.end()
	err = op(sctx)
	if final(err) {
		return false, err
	}
	wait := 50 * time.Millisecond
	for {
		if sctx.Err() != nil || time.Now().Add(wait).After(deadline) {
			return retried, err
		}
		if clock.Sleep(sctx, wait) != nil {
			return retried, err
		}
		retried = true
		if err = op(sctx); final(err) {
			return true, err
		}
		wait = min(2*wait, time.Second)
	}
}

// final reports whether err, a store's answer, is one that trying again
// would not change: none, ErrLostClaim or ErrKeyRejected.
func final(err error) bool {
	return err == nil || errors.Is(err, store.ErrLostClaim) || errors.Is(err, store.ErrKeyRejected)
}

// atLeastASecond returns deadline, or a second from now if that is later.
func atLeastASecond(deadline time.Time) time.Time {
	if time.Until(deadline) < time.Second { // the monotonic clock alone, on the common path
		return time.Now().Add(time.Second)
	}
	return deadline
}

// settling returns the context of the store calls that record an attempt
// after its handler returned: ctx's values, without its cancellation or
// deadline, ending at deadline instead. A consumer cancels its handlers'
// context at its shutdown deadline, possibly just as a handler returns;
// the done mark, release or failure count of that handler must still be
// written, or the message would be redelivered, wait out its lease, and
// run again. So the consumer that runs the handler, if it tracks such
// writes (package broker does), waits for it until deadline before it
// returns and lets its process exit. Its timer is made only if a store
// call asks for Done; end releases it, and must be called.
func settling(ctx context.Context, deadline time.Time) *settlingContext {
	c := new(settlingContext)
	c.begin(ctx, deadline)
	return c
}

// A settlingContext is the context of [settling]: a detached cancelContext
// whose store call is counted among the writes a stopping consumer waits
// for.
type settlingContext struct {
	cancelContext
	recording *recording.Tracker
}

// begin makes c, unused, the context of [settling](ctx, deadline).
func (c *settlingContext) begin(ctx context.Context, deadline time.Time) {
	c.parent, c.detached, c.deadline = ctx, true, deadline
	c.recording = recording.Begin(ctx, deadline)
}

// end releases c, and ends the count of its write. It must be called once.
func (c *settlingContext) end() {
	c.cancelContext.end()
	c.recording.End()
}
