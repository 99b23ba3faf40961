package middleware

import (
	"context"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// A Claim is the claim that [Dedup] holds on a delivery's key while the
// handler beneath it runs. The handler finds it with [ClaimFrom].
//
// It exists for handlers that write the done mark themselves, in the same
// transaction as their effect, in a store that shares the effect's database
// (package pgstore's transactional handler is one): such a handler marks
// Key done under Token, in its transaction, only if Token still owns Key,
// commits, and then calls MarkedDone, so that Dedup writes no second done
// mark. Any other handler can ignore it.
type Claim struct {
	key, token string
	retention  time.Duration
	marked     atomic.Bool
}

// Key returns the store key that Dedup claimed, with its namespace.
func (c *Claim) Key() string { return c.key }

// Token returns the owner token of the claim: the one that owns Key in the
// store while the claim lasts.
func (c *Claim) Token() string { return c.token }

// Retention returns how long Dedup keeps a done mark
// ([DedupOptions].Retention, or its default).
func (c *Claim) Retention() time.Duration { return c.retention }

// MarkedDone tells Dedup that the handler has marked Key done in the store
// under Token itself, and that the mark is durable (its transaction
// committed). If the handler then returns nil, Dedup writes no done mark
// and returns nil. Call it only after the commit succeeded: if the commit's
// answer was lost, return an error instead, and the redelivery finds the
// key done if the commit took effect. It is safe to call from any
// goroutine.
func (c *Claim) MarkedDone() { c.marked.Store(true) }

// A ClaimingHandler is a handler that can claim a delivery's key itself,
// in the transaction that applies its effect, where [Dedup] would claim it
// in a store call of its own: one transaction, and one commit, per message
// instead of two. Package pgstore's transactional handler is one.
//
// Dedup finds it only as the handler directly beneath it, or beneath the
// [Timeout] layer directly beneath it; any other layer in between hides
// it, and Dedup then claims as it does for any handler. Before its own
// claim, Dedup calls HandleClaiming with its store s, the delivery's key
// in s, the lease and the done mark's retention ([DedupOptions].Lease and
// Retention), under the context it would give the handler (with the
// Timeout's deadline), which carries no [Claim]. The handler claims only
// in s, and only if s is the store it writes its done marks in; its claim
// must end, as a lease does, if its consumer stops making progress for
// the lease. The answers:
//
//   - ran true: the handler claimed the key and ran, and err is its
//     result, all recorded by the handler: nil means the key is marked
//     done and the mark is durable; an error, that the attempt left
//     nothing in the store, no claim to release. Dedup returns err as it
//     is (with [ErrTimeout] if the deadline passed). An err that wraps
//     [ErrLeaseLost] says that the handler's claim ended before its
//     success was recorded: Dedup reports it as [DedupLeaseLost].
//   - ran false, with an error that wraps [ErrBusy]: another transaction
//     holds the key. Dedup answers busy, as if its claim had found the key
//     processing.
//   - ran false, with another error or none, once ctx has ended: the
//     handler did not claim, nor run, and left nothing, since its context
//     ended while it waited to (for a connection, or a transaction that
//     it shares with other deliveries, say). Dedup returns err as it is,
//     or, if there is none, ctx's cause, marked rabbitmw.NotCounted, to
//     be tried again after [DedupOptions].UnavailableDelay (either with
//     [ErrTimeout] if the deadline passed), and reports no event: the
//     delivery got no answer. It does not claim: the handler would run
//     with a new deadline, for longer than the [Timeout] allows.
//   - ran false, any other error or none, while ctx lives: the handler
//     did not run and left nothing (s is not its store; the key was in s
//     already: done, claimed, released or abandoned; or it could not
//     try). Dedup claims the key as usual, and calls Handle under the
//     claim.
//
// A panic goes on through Dedup, which has nothing to release.
type ClaimingHandler interface {
	rabbitmw.Handler
	HandleClaiming(ctx context.Context, d *amqp.Delivery, s store.Store, key string, lease, retention time.Duration) (ran bool, err error)
}

type claimKey struct{}

// ClaimFrom returns the claim that Dedup holds for the delivery whose
// handler received ctx, and false if no Dedup runs in front of the handler
// or Dedup runs it without a claim (see [FailOpenCause]).
func ClaimFrom(ctx context.Context) (*Claim, bool) {
	c, ok := ctx.Value(claimKey{}).(*Claim)
	return c, ok
}

type failOpenKey struct{}

// FailOpenCause returns why Dedup runs the handler that received ctx
// without a claim: its store could not be reached for the claim, and
// [DedupOptions].FailOpen asks for the handler to run anyway. The error
// wraps [ErrStoreUnavailable] and the store's error. It is nil if the
// handler runs beneath no Dedup, or under Dedup's claim.
//
// A handler that needs the claim (one that writes its done mark itself)
// reads it when [ClaimFrom] finds none, to tell a store out of reach,
// which the message is to be tried again for, from a chain built without
// Dedup.
func FailOpenCause(ctx context.Context) error {
	err, _ := ctx.Value(failOpenKey{}).(error)
	return err
}

// claimContext is Dedup's state of one delivery whose key it claimed, in
// one allocation: the handler's context, cancelled when the handler
// returns, the claim is lost or, when Dedup runs a [Timeout] layer's
// handler itself, its deadline passes; the Claim it carries; the key that
// Dedup hands down, if its ctx does not (see [Keying]); and the context
// of the store call that records the attempt once the handler returned.
type claimContext struct {
	cancelContext
	shared sharedWatch // the cancelContext's
	claim  Claim
	// The key that Dedup hands down (see [keyed]), if keyedBy is set: the
	// claim's key, made by keyedBy for the delivery keyedFor, without an
	// error. It is kept in these two fields, rather than a keyed, which
	// would hold the key a second time ([claimContext.handedDown]).
	keyedBy  *keying
	keyedFor *amqp.Delivery
	settle   settlingContext
}

// newClaimContext returns the claim context of key by token under parent,
// with a deadline unless it is zero, watched by w if not nil.
func newClaimContext(parent context.Context, key, token string, retention time.Duration, deadline time.Time, w *watchers) *claimContext {
	c := &claimContext{
		cancelContext: cancelContext{parent: parent, deadline: deadline},
		shared:        sharedWatch{by: w},
		claim:         Claim{key: key, token: token, retention: retention},
	}
	c.cancelContext.shared = &c.shared
	return c
}

// Value implements context.Context: the Claim for [ClaimFrom], the
// cancelContext's values otherwise.
func (c *claimContext) Value(key any) any {
	switch {
	case key == (claimKey{}) && c.claim.token != "":
		// Not when a ClaimingHandler claims the key itself.
		return &c.claim
	case key == (keyedKey{}) && c.keyedBy != nil:
		return c // keyedFrom reads it with handedDown
	}
	return c.cancelContext.Value(key)
}

// handDown sets k as the key that c hands down to the layers beneath: a
// key that Dedup resolved without an error, c's claim's (k.by nil: none).
func (c *claimContext) handDown(k keyed) {
	c.keyedBy, c.keyedFor = k.by, k.d
}

// handedDown returns the key that c hands down, set by handDown.
func (c *claimContext) handedDown() keyed {
	return keyed{d: c.keyedFor, by: c.keyedBy, key: c.claim.key}
}
