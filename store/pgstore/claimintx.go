package pgstore

import (
	"context"
	"errors"
	"fmt"
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
	in   *inbox
	fn   TxFunc
	opts pgx.TxOptions
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
// it is left idle for the lease (see claimEnded).
//
// A redelivered delivery is left to Dedup's claim, whose row is committed
// before fn runs: its earlier attempt may have killed its consumer, and a
// claim made in the transaction would leave no trace of that either. If
// the key has no row, that earlier attempt left none, so it is counted
// now, as one failed attempt, in the key's failure counter (which Retry
// reads); the counter is kept for retention at least.
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
	start := time.Now()
	t0, err := h.begin(ctx)
	if err != nil {
		return false, nil // Dedup's claim reports it
	}
	t := t0.(*pgxTxn)
	claimed, err := t.claim(ctx, key, lease, retention)
	if err != nil || !claimed {
		h.in.rollback(ctx, t)
		if lockTimedOut(err) {
			return false, fmt.Errorf("pgstore: claim %q in the transaction: another transaction holds it: %w", key, middleware.ErrBusy)
		}
		return false, nil
	}
	err = h.in.finishClaimed(ctx, key, retention, start, t, func(ctx context.Context) error { return h.fn(ctx, t.tx, d) })
	if s.pruneEvery > 0 && s.claims.Add(1)%uint64(s.pruneEvery) == 0 {
		// As Store.Claim does, for the claims made here. Errors are
		// dropped: the next prune tries again.
		s.Prune(ctx, 2*s.pruneEvery)
	}
	return true, err
}

// claim begins the transaction with the claim of key, in one round trip,
// and reports whether it inserted the key's row. If it did not, or failed,
// the caller rolls back.
func (t *pgxTxn) claim(ctx context.Context, key string, lease, retention time.Duration) (bool, error) {
	var b pgx.Batch
	b.BeginTx(t.tx.opts)
	b.Queue(t.s.claimInTxSQL, []byte(key), retention.Microseconds(), strconv.FormatInt(max(lease.Milliseconds(), 1), 10))
	br := t.conn.Conn().SendBatch(ctx, &b)
	t.tx.tx = br.Tx()
	_, err := br.Exec() // the BEGIN's
	var tag pgconn.CommandTag
	if err == nil {
		tag, err = br.Exec()
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

// finishClaimed runs call in t, whose first statement, sent at start,
// claimed key as a done mark of retention, and commits if call returned
// nil: as handle, with no done mark to write (the claim is one) and no
// claim of Dedup's to tell. The claim's mark lasts retention from the
// claim, not from the success, as Dedup's Retention says: if call ran for
// longer than markAgainAfter(retention), its retention starts again
// before the commit, in a statement of its own, so that a copy that
// arrives within the retention after the success is a duplicate.
func (h *inbox) finishClaimed(ctx context.Context, key string, retention time.Duration, start time.Time, t *pgxTxn, call func(context.Context) error) error {
	open := true
	defer h.rollbackIfOpen(ctx, t, &open)
	if err := call(ctx); err != nil {
		if idleTimedOut(err) {
			return h.claimEnded(ctx, key, err)
		}
		return h.failed(ctx, t, key, err)
	}
	if t.tx.settled || t.conn.Conn().PgConn().TxStatus() == 'I' {
		// fn committed or rolled back tx itself.
		return errTxSettled(key)
	}
	// As in handle, the commit runs even if ctx is cancelled from now on:
	// the transaction has held the key's row since its first statement,
	// so no other consumer runs the message meanwhile.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.commitTimeout)
	defer cancel()
	rec := recording.Begin(ctx, time.Now().Add(h.commitTimeout))
	defer rec.End()
	if time.Since(start) > markAgainAfter(retention) {
		_, err := t.tx.Exec(sctx, h.s.markAgainSQL, []byte(key), retention.Microseconds())
		switch {
		case err == nil:
		case idleTimedOut(err):
			return h.claimEnded(ctx, key, err)
		case lost(t, err):
			return h.unavailable(fmt.Errorf("pgstore: mark %q done again: %w", key, err))
		default:
			// Rolled back: nothing committed.
			return fmt.Errorf("pgstore: mark %q done again: %w", key, err)
		}
	}
	err := t.tx.Commit(sctx)
	open = false
	defer t.release()
	switch {
	case err == nil:
		return nil
	case idleTimedOut(err):
		return h.claimEnded(ctx, key, err)
	case errors.Is(err, pgx.ErrTxCommitRollback):
		// A statement of fn failed, and fn dropped its error: the server
		// rolled the transaction back. fn's attempt failed.
		return fmt.Errorf("pgstore: commit the transaction of %q: a statement in it failed: %w", key, err)
	case isPgError(err) && !lost(t, err):
		// The server answered: the transaction did not commit.
		return fmt.Errorf("pgstore: commit the transaction of %q: %w", key, err)
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

// claimEnded returns the result of a delivery of key whose claim, made in
// its transaction, ended with its lease (err says so): rolled back,
// nothing committed, as a lost claim of Dedup's. The function waited
// longer than the lease between two statements, or its consumer stalled:
// the next delivery of key goes to Dedup's claim, whose lease is renewed
// while the function runs, through a forgotten row of key (unless the key
// has a row already: another consumer's claim, or its done mark).
func (h *inbox) claimEnded(ctx context.Context, key string, err error) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.commitTimeout)
	h.s.pool.Exec(rctx, h.s.forgottenSQL, []byte(key))
	cancel()
	return rabbitmw.RetryAfter(fmt.Errorf("%w: pgstore: the transaction that claimed %q was idle for longer than the lease, and the server ended it: rolled back: %w", middleware.ErrLeaseLost, key, err), h.retry)
}

var _ middleware.ClaimingHandler = (*txHandler)(nil)
