package middleware

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/backoff"
	"github.com/rabbitmw/rabbitmw/internal/text"
	"github.com/rabbitmw/rabbitmw/store"
)

// ErrRetriesExhausted is wrapped by the error with which [Retry]
// dead-letters a message that failed its last allowed attempt.
var ErrRetriesExhausted = errors.New("middleware: retries exhausted")

// RetryOptions configures [Retry]. The zero value selects the defaults.
// Retry panics on a negative MaxAttempts or TTL.
type RetryOptions struct {
	// MaxAttempts is how many attempts a message gets: the failure of the
	// last one dead-letters it. Default 5.
	MaxAttempts int
	// Backoff returns how long to wait before the attempt that follows
	// failed attempt number n (from 1). Default: Exponential(time.Second,
	// time.Minute). Zero or less requeues the message at once if the
	// store counted the failure; a failure that only the attempts header
	// counts is delayed all the same (by the broker package's shortest
	// delay), since only a delayed copy carries the new count.
	Backoff func(n int) time.Duration
	// TTL is how long a failure count is kept after the last failure.
	// Default 24 hours.
	TTL time.Duration
	// CountByHeader counts failures by the rabbitmw.HeaderAttempts header
	// alone, with no store: Retry must then be given a nil store, and no
	// TTL, which only a store uses. Only the broker
	// package's delayed retries update the header, and a count that lives
	// only in the message is lost with it, so prefer a store.
	CountByHeader bool
	// Permanent, if set, reports whether the error of a failed attempt is
	// one that retrying cannot fix: if so, the message is dead-lettered at
	// once, as if the error were marked rabbitmw.Permanent, with no more
	// attempts. It is called on the goroutine that handles the delivery,
	// with the result of the layers beneath, for the errors that Retry
	// counts (see [Retry]), so it must be quick and safe for concurrent
	// use. It saves wrapping each such error where it is made: for
	// example, func(err error) bool { return errors.As(err, new(*json.SyntaxError)) }.
	Permanent func(error) bool
}

// Retry returns a layer that counts the failed attempts of each message
// across redeliveries, consumers and restarts, asks for the message to be
// tried again after a growing delay, and dead-letters it, with its last
// error, when its last allowed attempt fails. It never acknowledges a
// failed message.
//
// Failures are counted in s (store.Fail, under the message's key), and
// cleared (store.ResetFailures) once the message succeeds or leaves the
// queue; both run even if ctx is cancelled meanwhile, for at most five
// seconds each, so that a consumer's shutdown does not lose them. The
// count is also carried in the message itself by the broker package, in the
// rabbitmw.HeaderAttempts header of each copy it republishes, and Retry
// takes the larger of the two: the limit holds even if s was wiped or
// cannot be reached. To count with the header alone, pass a nil s and set
// RetryOptions.CountByHeader; Retry panics if s is nil without it, or not
// nil with it.
//
// What the result of the layers beneath means to Retry:
//
//   - nil: success. If the delivery shows an earlier attempt (it was
//     redelivered or carries an attempt count), the count is cleared.
//   - a duplicate (rabbitmw.ErrDuplicate): returned unchanged.
//   - an error that is not the message's failure: returned unchanged and
//     not counted. These are the errors marked rabbitmw.NotCounted (Dedup's
//     ErrBusy, ErrStoreUnavailable and ErrLeaseLost are, and so may be
//     those of a rate limit or a circuit breaker beneath Retry), and any
//     error once ctx is done (the consumer is shutting down).
//   - a permanent error (rabbitmw.Permanent, or one that
//     RetryOptions.Permanent reports): counted, returned with its count,
//     dead-lettered, and the count cleared, since the message leaves the
//     queue.
//   - Dedup's ErrAbandoned, unmarked as Dedup returns it: the attempt
//     before never finished (its consumer died, or lost its lease). (If a
//     layer beneath, such as another Retry, already marked it with
//     rabbitmw.Permanent, rabbitmw.RetryAfter or rabbitmw.WithAttempts,
//     that settlement stands, and it is read as the errors below.) It is
//     counted as a failed attempt. At the limit the message is
//     dead-lettered, with that reason, without running the handler again.
//     Below it, if s did not record the failure (s is nil, or its Fail
//     failed), Retry returns it
//     wrapped in rabbitmw.RetryAfter with Backoff(n) and the count n: the
//     copy that the broker package republishes carries n, whereas the
//     redelivery after a crash of a retry in place would carry the count
//     of before, and the crashes would never add up. If s recorded it,
//     Retry tries the message again at once, in the same delivery (Dedup
//     claims it afresh), and reads that result as below. These retries
//     run one at a time among the handlers that one Retry layer wraps
//     (every chain built with it): a retry waits for the one running to
//     return, or for ctx to be done (the message is then delayed by
//     Backoff(n)). So the messages that were in flight together when
//     their consumer died are tried again apart, and a message that kills
//     its consumer does not take the same neighbours along at every
//     crash, to the dead-letter queue at last.
//   - any other error, including a panic turned into an error by Recover
//     and a timeout: a failed attempt. Below the limit, Retry returns it
//     wrapped in rabbitmw.RetryAfter with Backoff(n), or the delay the
//     error asked for if that is longer; at the limit, it returns it wrapped
//     in rabbitmw.Permanent and ErrRetriesExhausted. Either way the count n
//     is attached with rabbitmw.WithAttempts.
//
// Place Retry above [Dedup], as [Stack] does: beneath it, Retry never sees
// ErrAbandoned, and never counts a death (see Dedup, which refuses the
// order it can see).
func Retry(s store.Store, opts RetryOptions) rabbitmw.Middleware {
	switch {
	case s == nil && !opts.CountByHeader:
		panic("middleware: Retry: nil store (set RetryOptions.CountByHeader to count by the attempts header alone)")
	case s != nil && opts.CountByHeader:
		panic("middleware: Retry: RetryOptions.CountByHeader with a store")
	case opts.CountByHeader && opts.TTL != 0:
		panic("middleware: Retry: RetryOptions.CountByHeader with a TTL, which only a store uses")
	case opts.MaxAttempts < 0:
		panic(fmt.Sprintf("middleware: Retry: negative MaxAttempts %d", opts.MaxAttempts))
	case opts.TTL < 0:
		panic(fmt.Sprintf("middleware: Retry: negative TTL %v", opts.TTL))
	}
	cfg := retryConfig{
		store:     s,
		max:       opts.MaxAttempts,
		backoff:   opts.Backoff,
		keying:    newKeying(Keying{}, "Retry"),
		ttl:       cmp.Or(opts.TTL, 24*time.Hour),
		permanent: opts.Permanent,
		alone:     make(chan struct{}, 1),
	}
	if cfg.max == 0 {
		cfg.max = 5
	}
	if cfg.backoff == nil {
		cfg.backoff = Exponential(time.Second, time.Minute)
	}
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return &retry{retryConfig: cfg, next: next}
	}
}

// settleTimeout bounds each of Retry's store calls (counting a failure,
// clearing the count), which run even if ctx was cancelled meanwhile.
const settleTimeout = 5 * time.Second

type retryConfig struct {
	store     store.Store
	max       int
	backoff   func(int) time.Duration
	keying    *keying
	ttl       time.Duration
	permanent func(error) bool
	// alone is held by the retry of an abandoned message while it runs.
	alone chan struct{}
}

type retry struct {
	retryConfig
	next rabbitmw.Handler
}

func (h *retry) Handle(ctx context.Context, d *amqp.Delivery) error {
	if d == nil {
		return rabbitmw.ErrNoDelivery
	}
	if ctx == nil {
		ctx = context.Background()
	}
	err := h.handleNext(ctx, d)
	counted := 0 // failures of d counted by this delivery
	if abandoned(err) {
		// Counted even if ctx is done: the store no longer holds the
		// abandoned claim, so nothing else can count it.
		n, stored, cerr := h.count(ctx, d, 0)
		err = withCountError(err, cerr)
		if n >= h.max {
			h.reset(ctx, d)
			return rabbitmw.Permanent(rabbitmw.WithAttempts(&exhaustedError{n: n, err: err}, n))
		}
		if !stored {
			// Only the copy that a delay republishes carries n: a crash
			// of a retry in place would bring back the same headers, and
			// the count would start again from them.
			return rabbitmw.RetryAfter(rabbitmw.WithAttempts(err, n), h.delay(n, false))
		}
		ran, rerr := h.retryAlone(ctx, d)
		if !ran {
			return rabbitmw.RetryAfter(rabbitmw.WithAttempts(errors.Join(err, rerr), n), h.backoff(n))
		}
		err, counted = rerr, n
	}
	dec := rabbitmw.Decide(err)
	switch {
	case dec.Outcome == rabbitmw.Ack:
		if counted > 0 || d.Redelivered || rabbitmw.PriorAttempts(d) > 0 {
			h.reset(ctx, d)
		}
		return nil
	case dec.Outcome == rabbitmw.Duplicate, rabbitmw.IsNotCounted(err), ctx.Err() != nil:
		if counted > 0 {
			return rabbitmw.WithAttempts(err, counted)
		}
		return err
	}
	classified := dec.Outcome != rabbitmw.DeadLetter && h.permanent != nil && h.permanent(err)
	n, stored, cerr := h.count(ctx, d, counted)
	err = withCountError(err, cerr)
	switch {
	case dec.Outcome == rabbitmw.DeadLetter:
		h.reset(ctx, d)
		return rabbitmw.WithAttempts(err, n)
	case classified:
		h.reset(ctx, d)
		return rabbitmw.Permanent(rabbitmw.WithAttempts(err, n))
	case n >= h.max:
		h.reset(ctx, d)
		return rabbitmw.Permanent(rabbitmw.WithAttempts(&exhaustedError{n: n, err: err}, n))
	}
	delay := h.delay(n, stored)
	if dec.Outcome == rabbitmw.Delay && dec.Delay > delay {
		delay = dec.Delay
	}
	return rabbitmw.RetryAfter(rabbitmw.WithAttempts(err, n), delay)
}

// delay returns the delay before the attempt that follows failed attempt
// n: Backoff(n), but at least a nanosecond if the store did not record the
// failure (stored is false). The count then lives only in the attempts
// header, and only the copy that a delay republishes carries the new one:
// a requeue, which a delay of zero is, brings the message back with the
// header of before, and it would never reach the limit.
func (h *retry) delay(n int, stored bool) time.Duration {
	d := h.backoff(n)
	if !stored {
		d = max(d, time.Nanosecond)
	}
	return d
}

// handleNext runs the layers beneath for d, handing them the key of d: the
// one a layer above made (a [Keys] layer), or else Retry's own, by [Key].
func (h *retry) handleNext(ctx context.Context, d *amqp.Delivery) error {
	if h.store == nil { // counting by the header, with no key
		return h.next.Handle(ctx, d)
	}
	k, err := h.keying.handDown(ctx, d)
	if err != nil {
		return rabbitmw.Permanent(err)
	}
	return handleKeyed(h.next, ctx, d, k)
}

// retryAlone runs the layers beneath again for d, once no other retry of
// an abandoned message by this layer is running, and returns their result.
// If ctx is done first, it runs nothing and returns ctx's error.
func (h *retry) retryAlone(ctx context.Context, d *amqp.Delivery) (ran bool, err error) {
	if err := ctx.Err(); err != nil {
		return false, err
	}
	select {
	case h.alone <- struct{}{}:
		defer func() { <-h.alone }()
		return true, h.handleNext(ctx, d)
	case <-ctx.Done():
		return false, ctx.Err()
	}
}

// exhaustedError is the reason Retry gives for dead-lettering a message.
// It unwraps to the last error alone, so that what reads the chain (the
// broker's error-type header, errors.As) finds the handler's error; it is
// ErrRetriesExhausted by its Is method.
type exhaustedError struct {
	n   int
	err error
}

// Error reads cause first, "decode: unexpected EOF (middleware: retries
// exhausted after 5 attempts)", so that a text cut to a width, or grouped,
// shows what failed.
func (e *exhaustedError) Error() string {
	return fmt.Sprintf("%s (%v after %d attempts)", text.Error(e.err), ErrRetriesExhausted, e.n)
}

func (e *exhaustedError) Unwrap() error { return e.err }

func (e *exhaustedError) Is(target error) bool { return target == ErrRetriesExhausted }

// abandoned reports whether err is Dedup's ErrAbandoned as Dedup returns
// it, not a settlement that a layer beneath (another Retry) already decided
// and counted, such as its dead-letter at the limit.
func abandoned(err error) bool {
	if err == nil {
		return false
	}
	dec := rabbitmw.Decide(err)
	return dec.Outcome == rabbitmw.Requeue && dec.Attempts == 0 && errors.Is(err, ErrAbandoned)
}

// count records a failure of d and returns the number of failed attempts,
// including this one: the larger of the store's count and the count the
// delivery carries (or the count before, if this delivery counted one
// already), plus one. stored reports whether the store recorded the
// failure; if not, only a copy of the message that carries n in its
// header remembers it. A store error is returned with the header's count,
// so the failure is never lost, only counted less precisely.
func (h *retry) count(ctx context.Context, d *amqp.Delivery, before int) (n int, stored bool, err error) {
	n = max(rabbitmw.PriorAttempts(d), before) + 1
	if h.store == nil {
		return n, false, nil
	}
	key, err := h.keying.of(ctx, d)
	if err != nil {
		return n, false, nil // nothing to count under: the header alone counts
	}
	sctx := settling(ctx, time.Now().Add(settleTimeout))
	got, err := h.store.Fail(sctx, key, h.ttl)
	sctx.end()
	switch {
	case errors.Is(err, store.ErrKeyRejected):
		// No counter can be kept under key: the header alone counts, and
		// the reason goes with the failure, for the operator who will
		// have to mend the key (in Redis, one that holds a value of
		// another type).
		return n, false, fmt.Errorf("middleware: retry: the store refused to count the failure of %s; the attempts header counts it: %w", text.QuoteKey(key), err)
	case err != nil:
		return n, false, fmt.Errorf("middleware: retry: counting the failure of %s: %w", text.QuoteKey(key), err)
	}
	return max(n, int(min(got, 1<<30))), true, nil
}

// withCountError returns err, the failure of an attempt, joined to cerr,
// the error of counting it, if any. The result's type of failure (see
// rabbitmw.ErrorType) is err's: a store that timed out does not turn every
// failure counted meanwhile into a "timeout". A store's refusal of the key
// (store.ErrKeyRejected) is left out when err is one already: Dedup's
// claim was refused, and its reason says what the count's would.
func withCountError(err, cerr error) error {
	if cerr == nil || errors.Is(cerr, store.ErrKeyRejected) && errors.Is(err, store.ErrKeyRejected) {
		return err
	}
	return &countError{err: err, cerr: cerr}
}

// countError is an attempt's failure err joined to the error of counting
// it, cerr. It reads and unwraps as errors.Join(err, cerr) does.
type countError struct{ err, cerr error }

func (e *countError) Error() string     { return text.Error(e.err) + "\n" + text.Error(e.cerr) }
func (e *countError) Unwrap() []error   { return []error{e.err, e.cerr} }
func (e *countError) ErrorType() string { return rabbitmw.ErrorType(e.err) }

// reset clears d's failure count, on a best-effort basis: a count left
// behind expires after the TTL, and meanwhile only makes a later copy of
// the message (a resend after it succeeded or was dead-lettered) start
// with fewer attempts.
func (h *retry) reset(ctx context.Context, d *amqp.Delivery) {
	if h.store == nil {
		return
	}
	if key, err := h.keying.of(ctx, d); err == nil {
		sctx := settling(ctx, time.Now().Add(settleTimeout))
		h.store.ResetFailures(sctx, key)
		sctx.end()
	}
}

// Exponential returns a backoff for [RetryOptions]: the delay after failed
// attempt n is min·2^(n-1), at most max, with "equal jitter" (uniform in
// [d/2, d]), so consumers that fail together do not all come back together.
// It panics if min is not positive or max is less than min.
func Exponential(min, max time.Duration) func(n int) time.Duration {
	if min <= 0 || max < min {
		panic(fmt.Sprintf("middleware: Exponential(%v, %v): want 0 < min <= max", min, max))
	}
	return func(n int) time.Duration {
		d := backoff.Doubled(min, n-1, max) // n below 1 counts as 1
		half := d / 2
		return half + rand.N(d-half+1)
	}
}
