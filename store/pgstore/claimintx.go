package pgstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/recording"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// lockWait bounds how long a claim waits for a row that another
// transaction holds: the claim of [Handler] in its own transaction, and
// the Store's claim statements. A claim of [Handler] holds its row,
// uncommitted, for as long as the function runs; a claim that finds it
// answers processing (busy) after lockWait rather than wait for the
// function, so that a statement of claims sent for several keys is not
// held up by one of them for longer than that.
const lockWait = time.Second

// lockWaitSetting is lockWait as lock_timeout takes it.
var lockWaitSetting = fmt.Sprintf("%dms", lockWait.Milliseconds())

// lockTimedOut reports whether err is PostgreSQL's lock_not_available: a
// statement waited lockWait for a row lock, and gave up.
func lockTimedOut(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "55P03"
}

// A txHandler is the handler that [Handler] returns. Handle runs a
// delivery under the claim of Dedup in front of it; HandleClaiming, which
// Dedup calls first (see middleware.ClaimingHandler), claims the key in
// the transaction itself.
type txHandler struct {
	in     *inbox
	fn     TxFunc
	opts   pgx.TxOptions
	groups *grouper // nil unless HandlerOptions.GroupCommit
}

func (h *txHandler) Handle(ctx context.Context, d *amqp.Delivery) error {
	return h.in.handle(ctx, h.begin, func(ctx context.Context, t txn) error {
		return h.fn(ctx, t.(*pgxTxn).tx, d)
	})
}

// begin takes a connection of the pool, for a transaction that has not
// begun yet (see inboxTx).
func (h *txHandler) begin(ctx context.Context) (txn, error) {
	conn, err := h.in.s.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	t := &pgxTxn{s: h.in.s, conn: conn}
	t.tx = &inboxTx{conn: conn.Conn(), opts: h.opts, renew: t.renew}
	return t, nil
}

// HandleClaiming implements middleware.ClaimingHandler: for a delivery
// that was never delivered before, under a Dedup over the handler's own
// Store, it claims key as the first statement of the transaction, sent
// with the BEGIN: the key's row, inserted as a done mark of retention,
// unless the key has a row. Then it calls fn, and commits. One
// transaction, one row written, one commit. If the key has a row, it
// rolls back and leaves the delivery to Dedup's claim; if another
// transaction holds the key's row (an uncommitted claim of this kind, a
// copy of the message running on another consumer), it answers busy after
// lockWait. The claim ends with the transaction, which the server ends if
// it is left idle for the lease (see claimEnded). If ctx ends before the
// claim is made, it answers ctx's cause (see cut): Dedup's claim would
// run fn with a new deadline.
//
// A redelivered delivery is left to Dedup's claim, whose row is committed
// before fn runs: its earlier attempt may have killed its consumer, and a
// claim made in the transaction would leave no trace of that either. If
// the key has no row, that earlier attempt left none, so it is counted
// now, as one failed attempt, in the key's failure counter (which Retry
// reads); the counter is kept for retention at least. A row that another
// transaction holds, uncommitted, is waited for, lockWait at most: the
// earlier attempt may still run (its consumer's channel closed, not its
// transaction), and is counted only if it rolls back meanwhile.
func (h *txHandler) HandleClaiming(ctx context.Context, d *amqp.Delivery, st store.Store, key string, lease, retention time.Duration) (bool, error) {
	s := h.in.s
	switch {
	case st != store.Store(s):
		// Dedup claims in another store: its claim, which Handle finds,
		// reports the chain built wrong.
		return false, nil
	case d.Redelivered:
		// An error leaves the count as it was; Dedup's claim reports an
		// unreachable database.
		s.pool.Exec(ctx, s.countUnrecordedSQL, []byte(key), retention)
		return false, nil
	}
	if h.groups != nil {
		return h.groups.handle(ctx, d, key, lease, retention)
	}
	ran, err := h.handleAlone(ctx, d, key, lease, retention)
	if ran {
		s.counted(ctx) // as Store.Claim does, for the claims made here
	}
	return ran, err
}

// handleAlone is HandleClaiming for a delivery of key that may be claimed
// in a transaction, in a transaction of its own.
func (h *txHandler) handleAlone(ctx context.Context, d *amqp.Delivery, key string, lease, retention time.Duration) (bool, error) {
	c := &txClaim{key: key, start: time.Now(), lease: lease, retention: retention}
	t0, err := h.begin(ctx)
	switch {
	case err != nil && ctx.Err() != nil:
		// Not Dedup's claim, whose handler would run with a new
		// deadline: the one of ctx has passed.
		return false, h.in.cut(key, "a connection", context.Cause(ctx))
	case err != nil:
		return false, nil // Dedup's claim reports it
	}
	t := t0.(*pgxTxn)
	claimed, err := t.claim(ctx, c, lease, "")
	if err != nil || !claimed {
		h.in.rollback(ctx, t)
		if err != nil && !lockTimedOut(err) && ctx.Err() != nil {
			return false, h.in.cut(key, "its claim", context.Cause(ctx))
		}
		return false, claimBusy(key, err)
	}
	return true, h.in.finishClaimed(ctx, c, t, func(ctx context.Context) error { return h.fn(ctx, t.tx, d) })
}

// claimBusy returns HandleClaiming's error for a claim of key in a
// transaction that failed with err, or found the key's row (err nil):
// busy if another transaction holds the row, else none (Dedup claims).
func claimBusy(key string, err error) error {
	if lockTimedOut(err) {
		return fmt.Errorf("pgstore: claim %q in the transaction: another transaction holds it: %w", key, middleware.ErrBusy)
	}
	return nil
}

// A txClaim is a claim made in a transaction: the key's row, inserted as
// a done mark of retention by a statement sent at start, which set the
// session's idle_in_transaction_session_timeout to the lease.
type txClaim struct {
	key              string
	start            time.Time
	lease, retention time.Duration
}

// mayHaveIdled reports whether the server may have ended c's session for
// being idle for the lease: only once a lease has passed since the claim,
// the session's last sign of life that c knows of.
func (c *txClaim) mayHaveIdled() bool { return time.Since(c.start) >= idleTimeout(c.lease) }

// maxIdleTimeout is the longest idle_in_transaction_session_timeout that
// PostgreSQL takes: 2^31-1 milliseconds, about 24.8 days.
const maxIdleTimeout = math.MaxInt32 * time.Millisecond

// idleTimeout is the idle_in_transaction_session_timeout of a claim made
// in a transaction with the lease: the lease, at most maxIdleTimeout (a
// claim whose session the server ends sooner ends sooner, and nothing of
// its transaction commits after), and at least a millisecond (zero would
// turn the timeout off).
func idleTimeout(lease time.Duration) time.Duration {
	return min(max(lease, time.Millisecond), maxIdleTimeout)
}

// claim sends the claim c, with the lease, in one round trip, and reports
// whether it inserted the key's row: first the BEGIN, unless the
// transaction began already, then the savepoint of that name, unless it
// is "" (see savepointName), then the claim. If it did not insert, or
// failed, the caller rolls back (to the savepoint).
func (t *pgxTxn) claim(ctx context.Context, c *txClaim, lease time.Duration, savepoint string) (bool, error) {
	var b pgx.Batch
	begin := !t.tx.began
	if begin {
		b.BeginTx(t.tx.opts)
	}
	if savepoint != "" {
		b.Queue("SAVEPOINT " + savepoint)
	}
	b.Queue(t.s.claimInTxSQL, []byte(c.key), c.retention.Microseconds(), strconv.FormatInt(idleTimeout(lease).Milliseconds(), 10))
	br := t.conn.Conn().SendBatch(ctx, &b)
	if begin {
		t.tx.tx = br.Tx()
	}
	var tag pgconn.CommandTag
	var err error
	for range b.Len() { // the last result is the claim's
		if tag, err = br.Exec(); err != nil {
			break
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	t.tx.began = t.conn.Conn().PgConn().TxStatus() != 'I'
	if err != nil {
		return false, err
	}
	return tag.RowsAffected() == 1, nil
}

// markAgainAfter is how long the function of a claim made in the
// transaction may run, for a done mark of retention, before its mark is
// written again at the commit (see finishClaimed).
func markAgainAfter(retention time.Duration) time.Duration {
	return min(retention/100, time.Second)
}

// finishClaimed runs call in t, whose first statement claimed c, and
// commits if call returned nil: as handle, with no done mark to write
// (the claim is one) and no claim of Dedup's to tell.
func (h *inbox) finishClaimed(ctx context.Context, c *txClaim, t *pgxTxn, call func(context.Context) error) error {
	open := true
	defer h.rollbackIfOpen(ctx, t, &open)
	switch err := call(ctx); {
	case idleTimedOut(err):
		return h.claimEnded(ctx, c, err)
	case t.broken() && !t.tx.settled:
		// (One that settled tx itself is judged on that, below.)
		return h.closed(ctx, t, c, err)
	case err != nil:
		return h.failed(ctx, t, c.key, err)
	}
	if t.tx.settled || t.conn.Conn().PgConn().TxStatus() == 'I' {
		// fn committed or rolled back tx itself.
		return errTxSettled(c.key)
	}
	if t.conn.Conn().PgConn().IsBusy() {
		return fmt.Errorf("pgstore: the transaction of %q: %w", c.key, errRowsOpen)
	}
	// As in handle, the commit runs even if ctx is cancelled from now on:
	// the transaction has held the key's row since its first statement,
	// so no other consumer runs the message meanwhile.
	sent, err := h.commitClaims(ctx, t, c)
	open = !sent
	if sent {
		defer t.release()
	}
	return h.claimResult(ctx, t, c, sent, err)
}

// commitClaims commits t, whose statements claimed cs, within
// commitTimeout even if ctx is cancelled, and reports whether it sent the
// COMMIT, and the error of the commit or of the statement before it. A
// claim's mark lasts its retention from the claim, not from the success,
// as Dedup's Retention says: so the mark of a claim sent longer than
// markAgainAfter(retention) ago is written again first, in a statement of
// its own, so that a copy that arrives within the retention after the
// success is a duplicate.
func (h *inbox) commitClaims(ctx context.Context, t *pgxTxn, cs ...*txClaim) (sent bool, err error) {
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.commitTimeout)
	defer cancel()
	rec := recording.Begin(ctx, time.Now().Add(h.commitTimeout))
	defer rec.End()
	for _, c := range cs {
		if time.Since(c.start) <= markAgainAfter(c.retention) {
			continue
		}
		if _, err := t.tx.Exec(sctx, h.s.markAgainSQL, []byte(c.key), c.retention.Microseconds()); err != nil {
			return false, fmt.Errorf("mark %q done again: %w", c.key, err)
		}
	}
	return true, t.tx.Commit(sctx)
}

// claimResult returns the result of a delivery claimed in t by c, whose
// commit returned err, or, if the COMMIT was not sent, the statement
// before it.
func (h *inbox) claimResult(ctx context.Context, t *pgxTxn, c *txClaim, sent bool, err error) error {
	key := c.key
	switch {
	case err == nil:
		return nil
	case idleTimedOut(err):
		return h.claimEnded(ctx, c, err)
	case errors.Is(err, pgx.ErrTxCommitRollback):
		// A statement of fn failed, and fn dropped its error: the server
		// rolled the transaction back. fn's attempt failed.
		return fmt.Errorf("pgstore: commit the transaction of %q: a statement in it failed: %w", key, err)
	case isPgError(err) && !lost(t, err):
		// The server answered: the transaction did not commit.
		return fmt.Errorf("pgstore: commit the transaction of %q: %w", key, err)
	case !sent:
		// Rolled back: nothing committed.
		return h.unavailable(fmt.Errorf("pgstore: commit the transaction of %q: %w", key, err))
	}
	return h.unavailable(fmt.Errorf("pgstore: commit the transaction of %q: its answer was lost, so whether it took effect is unknown (if it did, the redelivery finds the message done): %w", key, err))
}

// idleTimedOut reports whether err is the server's
// idle_in_transaction_session_timeout: it ended the session of a claim
// made in the transaction, which its consumer left idle for the lease.
func idleTimedOut(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "25P03"
}

// claimEnded returns the result of a delivery whose claim c, made in its
// transaction, ended with its lease (err says so): rolled back, nothing
// committed, as a lost claim of Dedup's. The function waited longer than
// the lease between two statements, or its consumer stalled: the next
// delivery of the key goes to Dedup's claim, whose lease is renewed while
// the function runs, through a forgotten row of the key (unless the key
// has a row already: another consumer's claim, or its done mark), which
// no prune deletes before c's retention ends.
func (h *inbox) claimEnded(ctx context.Context, c *txClaim, err error) error {
	h.forget(ctx, c)
	return rabbitmw.RetryAfter(fmt.Errorf("%w: pgstore: the transaction that claimed %q was idle for longer than the lease, and the server ended it: rolled back: %w", middleware.ErrLeaseLost, c.key, err), h.retry)
}

// closed returns the result of a delivery whose claim c, made in t, ended
// with t's connection, which closed while the function ran: rolled back,
// nothing committed. The function returned err, nil or an error that does
// not say why.
//
// The server may have ended the session, left idle for the lease (the
// function dropped the error that said so; if it waits longer than the
// lease once, it does every time). Then the next delivery of the key goes
// to Dedup's claim, as after claimEnded: else it would be claimed in its
// transaction again, end the same way, and never be counted. Otherwise
// (less than a lease since the claim) the connection broke or the
// database went away, and writing that row would wait, up to
// CommitTimeout, on the database that is gone, holding the worker and
// passing the delivery's deadline for nothing.
//
// The result is the function's error, as failed makes it when the
// function returned one. If it returned nil: that the claim ended before
// its success was recorded, if it may have idled; else that the store is
// unavailable, as on the path of Dedup's claim, where the done mark finds
// the connection closed.
func (h *inbox) closed(ctx context.Context, t txn, c *txClaim, err error) error {
	idled := c.mayHaveIdled()
	switch {
	case err != nil:
		err = h.failed(ctx, t, c.key, err)
	case idled:
		err = rabbitmw.RetryAfter(fmt.Errorf("%w: pgstore: the connection of the transaction that claimed %q closed while its function ran, which returned nil (the server ends a transaction left idle for the lease): rolled back", middleware.ErrLeaseLost, c.key), h.retry)
	default:
		err = h.unavailable(fmt.Errorf("pgstore: the connection of the transaction that claimed %q closed while its function ran, which returned nil, less than a lease after the claim (it broke, or the database went away): rolled back", c.key))
	}
	if idled {
		h.forget(ctx, c)
	}
	return err
}

// forget writes the row that sends the next delivery of c's key to
// Dedup's claim (see forgottenSQL), within commitTimeout even if ctx is
// done. An error leaves the next delivery to a claim in its transaction.
func (h *inbox) forget(ctx context.Context, c *txClaim) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.commitTimeout)
	defer cancel()
	h.s.pool.Exec(rctx, h.s.forgottenSQL, []byte(c.key), c.retention.Microseconds())
}

var _ middleware.ClaimingHandler = (*txHandler)(nil)
