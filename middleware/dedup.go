package middleware

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// Errors returned by [Dedup], always wrapped in a rabbitmw.RetryAfter: the
// message is tried again later, and [Retry] does not count these as failed
// attempts, since the handler did not fail (it did not run, or it ran and
// succeeded).
var (
	// ErrBusy: another consumer holds the claim on the message's key.
	ErrBusy = errors.New("middleware: message is being processed by another consumer")
	// ErrStoreUnavailable: the store did not answer, so the message was
	// not processed (fail closed), or its done mark could not be written.
	ErrStoreUnavailable = errors.New("middleware: idempotency store unavailable")
	// ErrLeaseLost: the claim was taken over or deleted while the handler
	// ran, so its result was not recorded.
	ErrLeaseLost = errors.New("middleware: claim lost")
)

// ErrAbandoned is returned by [Dedup] when the message's last attempt never
// finished: the store found its claim abandoned (store.Abandoned), because
// the consumer that held it died, or lost the store, before its lease
// ended, without marking the message done or releasing it. Dedup does not
// run the handler; the next claim of the message can take it. Unlike
// Dedup's other errors, it is a failed attempt, and [Retry] counts it: a
// message that kills every consumer that handles it is dead-lettered after
// MaxAttempts crashes instead of looping.
var ErrAbandoned = errors.New("middleware: an attempt never finished: its consumer died, or lost its lease, while handling the message")

// DedupOptions configures [Dedup]. The zero value selects the defaults.
// Dedup panics on a negative duration.
type DedupOptions struct {
	// Keying names a delivery's claim and done mark in the store. Beneath
	// a Retry, leave it zero: Dedup uses the key that Retry made (see
	// [Keying]).
	Keying
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
	// may then be processed twice.
	FailOpen bool
	// Observe, if set, is called with each of Dedup's events (see
	// [DedupEvent]), on the goroutine that found it, with the context of
	// the delivery it concerns. It is meant for metrics and traces: it
	// must be quick and safe for concurrent use.
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
// If the lease is lost while the handler runs (the key was taken over or
// deleted, or renewal failed for so long that the lease may have ended),
// Dedup cancels the handler's context with the cause, and does not mark the
// key done; the message is tried again after BusyDelay. If the handler
// ignores the cancellation and completes its effect anyway, the effect may
// happen twice: a lease bounds, it does not fence.
//
// If s cannot be reached, Dedup fails closed by default: the handler does
// not run and the message is tried again after UnavailableDelay, so nothing
// is processed twice and nothing is lost. If marking done fails that way
// after the handler succeeded, Dedup retries until the lease would end or
// ctx is done; if it still fails, the message is tried again later, and its
// effect repeats only if the lease has expired by then.
//
// The store calls that follow the handler (complete, release) run even if
// ctx has been cancelled meanwhile, so that a shutdown does not leave a
// finished message unmarked. Dedup panics if s is nil.
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
		keying:      newKeying(opts.Keying, "Dedup"),
		lease:       cmp.Or(opts.Lease, defaultLease),
		retention:   cmp.Or(opts.Retention, 24*time.Hour),
		busy:        cmp.Or(opts.BusyDelay, 5*time.Second),
		unavailable: cmp.Or(opts.UnavailableDelay, 5*time.Second),
		failOpen:    opts.FailOpen,
		observe:     opts.Observe,
	}
	cfg.renewer = newRenewer(s, cfg.lease)
	cfg.renewer.observe = opts.Observe
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return &dedup{dedupConfig: cfg, next: next}
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
}

type dedup struct {
	dedupConfig
	next rabbitmw.Handler
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
	token := newToken()
	start := time.Now()
	status, err := h.store.Claim(ctx, key, token, h.lease)
	switch {
	case err != nil:
		// The claim may have taken effect though its answer was lost:
		// release it, if this token holds it, rather than leave it to
		// block the message until the lease ends.
		rctx, rcancel := context.WithTimeout(bookkeeping(ctx), time.Second)
		h.store.Release(rctx, key, token)
		rcancel()
		notify(h.observe, ctx, DedupUnavailable, key, err)
		if h.failOpen && ctx.Err() == nil {
			return h.next.Handle(ctx, d)
		}
		return rabbitmw.RetryAfter(fmt.Errorf("%w: claim %q: %w", ErrStoreUnavailable, key, err), h.unavailable)
	case status == store.Done:
		notify(h.observe, ctx, DedupDuplicate, key, nil)
		return &keyError{key: key, err: rabbitmw.ErrDuplicate}
	case status == store.Processing:
		notify(h.observe, ctx, DedupBusy, key, nil)
		return rabbitmw.RetryAfter(&keyError{key: key, err: ErrBusy}, h.busy)
	case status == store.Abandoned:
		// Nothing to wait for: the next claim takes the key. Retry counts
		// the attempt, and tries again.
		notify(h.observe, ctx, DedupAbandoned, key, nil)
		return &keyError{key: key, err: ErrAbandoned}
	case status != store.Claimed:
		err = fmt.Errorf("%w: claim %q: invalid status %v", ErrStoreUnavailable, key, status)
		notify(h.observe, ctx, DedupUnavailable, key, err)
		return rabbitmw.RetryAfter(err, h.unavailable)
	}
	notify(h.observe, ctx, DedupClaimed, key, nil)

	hctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	l := h.renewer.start(ctx, key, token, start, cancel)

	finished := false
	defer func() {
		if !finished { // the handler panicked: release, and let the panic go on
			h.renewer.stop(l)
			h.store.Release(bookkeeping(ctx), key, token)
		}
	}()
	cc := &claimContext{Context: hctx, claim: Claim{key: key, token: token, retention: h.retention}, keyed: down}
	err = h.next.Handle(cc, d)
	finished = true
	// Why the handler's context ended, if it did, before anything later
	// can cancel it.
	cause := context.Cause(hctx)

	lost, validUntil := h.renewer.stop(l)
	if err == nil && cc.claim.marked.Load() {
		// The handler's own commit marked the key done: that is the
		// answer, even if a renewal since found the claim gone (done).
		return nil
	}
	if lost != nil {
		// Another owner has the key, or nobody: nothing to mark.
		notify(h.observe, ctx, DedupLeaseLost, key, lost)
		return rabbitmw.RetryAfter(errors.Join(err, lost), h.busy)
	}
	if err != nil {
		// Release at once if the store answers, so the next attempt need
		// not wait for the lease; if it does not, the lease frees the key.
		deadline := time.Now().Add(h.unavailable)
		if validUntil.Before(deadline) {
			deadline = validUntil
		}
		if _, rerr := h.persist(ctx, deadline, func(ctx context.Context) error {
			return h.store.Release(ctx, key, token)
		}); rerr != nil && !errors.Is(rerr, store.ErrLostClaim) {
			err = errors.Join(err, fmt.Errorf("middleware: dedup: release %q: %w", key, rerr))
		}
		if ctx.Err() == nil && errors.Is(cause, ErrStoreUnavailable) {
			// Dedup cut the handler short because the store could not
			// renew the lease: that is not the message's failure.
			return rabbitmw.RetryAfter(errors.Join(err, cause), h.unavailable)
		}
		return err
	}
	retried, cerr := h.persist(ctx, validUntil, func(ctx context.Context) error {
		return h.store.Complete(ctx, key, token, h.retention)
	})
	switch {
	case cerr == nil:
		return nil
	case errors.Is(cerr, store.ErrLostClaim) && retried:
		// Likelier than a takeover: an earlier attempt marked the key done
		// and its answer was lost. The redelivery will tell (a duplicate).
		notify(h.observe, ctx, DedupLeaseLost, key, cerr)
		return rabbitmw.RetryAfter(fmt.Errorf("%w: the handler succeeded; marking %q done failed, then found the claim gone, most likely marked done by the failed attempt: %w", ErrLeaseLost, key, cerr), h.busy)
	case errors.Is(cerr, store.ErrLostClaim):
		notify(h.observe, ctx, DedupLeaseLost, key, cerr)
		return rabbitmw.RetryAfter(fmt.Errorf("%w: the handler succeeded, but %q was taken over before it was marked done: %w", ErrLeaseLost, key, cerr), h.busy)
	default:
		return rabbitmw.RetryAfter(fmt.Errorf("%w: the handler succeeded, but marking %q done failed: %w", ErrStoreUnavailable, key, cerr), h.unavailable)
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
	return "middleware: dedup: key " + strconv.Quote(e.key) + ": " + e.err.Error()
}

func (e *keyError) Unwrap() error { return e.err }

// persist runs op, a store call that must not be lost after the handler
// ran, and retries it while the store cannot be reached, until deadline or
// until ctx is done. It reports whether op was tried more than once, and
// returns op's last error.
func (h *dedup) persist(ctx context.Context, deadline time.Time, op func(context.Context) error) (retried bool, err error) {
	err = op(bookkeeping(ctx))
	if err == nil || errors.Is(err, store.ErrLostClaim) {
		return false, err
	}
	wait := 50 * time.Millisecond
	for {
		if ctx.Err() != nil || time.Now().Add(wait).After(deadline) {
			return retried, err
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return retried, err
		}
		retried = true
		if err = op(bookkeeping(ctx)); err == nil || errors.Is(err, store.ErrLostClaim) {
			return true, err
		}
		wait = min(2*wait, time.Second)
	}
}

// bookkeeping returns a context for store calls that must happen even after
// ctx was cancelled: ctx itself while it is live (no allocation), else ctx
// without its cancellation.
func bookkeeping(ctx context.Context) context.Context {
	if ctx.Err() == nil {
		return ctx
	}
	return context.WithoutCancel(ctx)
}

// Tokens identify one claim: unique across processes and deliveries, and
// telling an operator who holds a key ("host/pid/random/sequence").
var (
	tokenPrefix = func() string {
		host, _ := os.Hostname()
		var b [6]byte
		if _, err := rand.Read(b[:]); err != nil {
			panic("middleware: reading random bytes: " + err.Error())
		}
		return host + "/" + strconv.Itoa(os.Getpid()) + "/" + hex.EncodeToString(b[:]) + "/"
	}()
	tokenSeq atomic.Uint64
)

// Tokens are cut from blocks of tokenBlockSize tokens written one after
// another in one string, so that a block costs one allocation rather than
// one per delivery. The current block is shared: a token costs an atomic
// increment, and the goroutine that finds the block used up makes the next
// one (when several do at once, all but one block are dropped, with their
// sequence numbers). A block stays in memory while any of its tokens does.
const tokenBlockSize = 32

type tokenBlock struct {
	s    string                // the tokens, one after another
	ends [tokenBlockSize]int32 // where each token ends in s
	next atomic.Int32          // the next token to hand out
}

var tokens atomic.Pointer[tokenBlock]

func newToken() string {
	for {
		b := tokens.Load()
		if b != nil {
			if i := b.next.Add(1) - 1; i < tokenBlockSize {
				return b.token(i)
			}
		}
		nb := newTokenBlock()
		nb.next.Store(1)
		if tokens.CompareAndSwap(b, nb) {
			return nb.token(0)
		}
	}
}

func (b *tokenBlock) token(i int32) string {
	start := int32(0)
	if i > 0 {
		start = b.ends[i-1]
	}
	return b.s[start:b.ends[i]]
}

// newTokenBlock writes a block of tokens with sequence numbers of their own.
func newTokenBlock() *tokenBlock {
	b := new(tokenBlock)
	first := tokenSeq.Add(tokenBlockSize) - tokenBlockSize + 1
	var num [16]byte
	longest := len(tokenPrefix) + len(strconv.AppendUint(num[:0], first+tokenBlockSize-1, 36))
	var sb strings.Builder
	sb.Grow(tokenBlockSize * longest)
	for i := range uint64(tokenBlockSize) {
		sb.WriteString(tokenPrefix)
		sb.Write(strconv.AppendUint(num[:0], first+i, 36))
		b.ends[i] = int32(sb.Len())
	}
	b.s = sb.String()
	return b
}
