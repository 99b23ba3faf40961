package pgstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/recording"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// Errors of [Handler] and [SQLHandler].
var (
	// ErrNoClaim: the handler runs without a claim of middleware.Dedup
	// over the same Store, so it has no key to mark done: no Dedup runs in
	// front of it, or one over another store (the done mark then finds no
	// row for the key while Dedup's claim holds). The message is
	// dead-lettered: the chain is built wrong.
	ErrNoClaim = errors.New("pgstore: the transactional handler runs without a claim: put middleware.Dedup, over the same pgstore.Store, in front of it")
	// ErrTxSettled: the function committed or rolled back the transaction
	// itself, so the done mark could not join it. The message is
	// dead-lettered, not marked done: an effect it committed stands
	// without a mark, and would be applied again by every retry.
	ErrTxSettled = errors.New("pgstore: the function committed or rolled back the transaction itself; the message was not marked done")
)

// A TxFunc applies the effect of a delivery in tx: the transaction that
// [Handler] begins, and commits with the delivery's done mark if TxFunc
// returns nil. It must not commit or roll back tx, nor keep it after it
// returns. Its error is returned as the handler's (wrap it in
// rabbitmw.Permanent to dead-letter the message); a serialisation failure
// or deadlock (SQLSTATE 40001, 40P01) is an ordinary failure, tried again.
type TxFunc func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error

// An SQLTxFunc is a [TxFunc] on database/sql, for [SQLHandler].
type SQLTxFunc func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error

// HandlerOptions configures [Handler] and [SQLHandler]. The zero value
// selects the defaults.
type HandlerOptions struct {
	// TxOptions are the options of the transaction: its isolation level
	// (default: the database's, normally READ COMMITTED), access and
	// deferrable modes. SQLHandler uses its isolation level and access
	// mode.
	TxOptions pgx.TxOptions
	// RetryDelay is how long a delivery waits before it is tried again
	// when the database could not be reached, or the claim was lost
	// before the done mark. Default 5 seconds.
	RetryDelay time.Duration
	// CommitTimeout bounds the done mark and the commit, which run even if
	// the handler's context is cancelled once fn has returned (a consumer
	// that stops cancels it at its shutdown deadline): the mark checks the
	// claim's owner and lease on the database's clock, and once it is
	// written the transaction holds the claim's row, no other consumer can
	// take the message over, and committing is safe. Default 10 seconds.
	CommitTimeout time.Duration
}

// Handler returns the handler of a transactional inbox: it applies the
// effect of each delivery and marks the delivery's key done in one
// transaction, so that no effect is ever committed twice, whatever crashes.
// It runs beneath middleware.Dedup over the same Store s (the recommended
// stack, with Handler as the business handler), and for each delivery:
//
//  1. begins a transaction on s's pool;
//  2. calls fn with it;
//  3. if fn returned nil, marks the key of Dedup's claim done in the same
//     transaction, with a conditional UPDATE that matches only if the
//     claim's token still owns the key and its lease has not ended;
//  4. commits, and tells Dedup (middleware.Claim.MarkedDone) that the
//     mark is written, so that Dedup writes none.
//
// Results:
//
//   - fn's error: the transaction is rolled back, and the error returned
//     (Dedup releases the claim; Retry counts the attempt); but if the
//     connection broke or the server is shutting down (SQLSTATE class 08,
//     57P), it wraps middleware.ErrStoreUnavailable and is not counted: the
//     database is the store, and it was not the message's fault.
//   - a panic in fn: the transaction is rolled back, and the panic goes on
//     (Dedup releases; Recover turns it into a counted failure).
//   - the claim was lost (another consumer took the message over, or
//     nobody holds it): rolled back, nothing marked; an error wrapping
//     middleware.ErrLeaseLost, not counted. Only the owner's transaction
//     can commit the effect.
//   - the commit's answer was lost (the connection broke): an error
//     wrapping middleware.ErrStoreUnavailable, not counted. If the commit
//     took effect, the key is done and the redelivery is a duplicate; if
//     not, nothing was committed and the redelivery runs fn again.
//   - fn committed or rolled back tx: [ErrTxSettled], dead-lettered.
//   - no Dedup in front, or a Dedup over another store: [ErrNoClaim],
//     dead-lettered.
//
// The transaction touches the claim's row only at step 3, just before the
// commit, so Dedup's lease renewals (on connections of their own, see
// [Store]) never wait for a long-running fn, and fn never waits for a
// renewal longer than that one statement. Handler panics if s or fn is
// nil.
func Handler(s *Store, fn TxFunc, opts HandlerOptions) rabbitmw.Handler {
	if s == nil || fn == nil {
		panic("pgstore: Handler: nil store or function")
	}
	h := newInbox(s, opts)
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		return h.handle(ctx, func(ctx context.Context) (txn, error) {
			tx, err := s.pool.BeginTx(ctx, opts.TxOptions)
			if err != nil {
				return nil, err
			}
			return pgxTxn{tx}, nil
		}, func(ctx context.Context, t txn) error {
			return fn(ctx, t.(pgxTxn).Tx, d)
		})
	})
}

// SQLHandler is [Handler] on database/sql, for code written against
// *sql.Tx (sqlc, sqlx, GORM): fn gets a transaction of db, which must be
// the database of s, opened through pgx's driver, for example with
// stdlib.OpenDBFromPool(pool) (package github.com/jackc/pgx/v5/stdlib).
// Everything Handler says holds for it. SQLHandler panics if s, db or fn
// is nil.
func SQLHandler(s *Store, db *sql.DB, fn SQLTxFunc, opts HandlerOptions) rabbitmw.Handler {
	if s == nil || db == nil || fn == nil {
		panic("pgstore: SQLHandler: nil store, database or function")
	}
	h := newInbox(s, opts)
	txo := &sql.TxOptions{ReadOnly: opts.TxOptions.AccessMode == pgx.ReadOnly}
	switch opts.TxOptions.IsoLevel {
	case pgx.Serializable:
		txo.Isolation = sql.LevelSerializable
	case pgx.RepeatableRead:
		txo.Isolation = sql.LevelRepeatableRead
	case pgx.ReadCommitted:
		txo.Isolation = sql.LevelReadCommitted
	case pgx.ReadUncommitted:
		txo.Isolation = sql.LevelReadUncommitted
	}
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		return h.handle(ctx, func(ctx context.Context) (txn, error) {
			// database/sql rolls a transaction back when the context of
			// BeginTx ends: that would take the commit's decision away
			// from handle, so the transaction's context ends only when
			// sqlTxn says so. Statements still run under ctx.
			tctx, end := context.WithCancel(context.WithoutCancel(ctx))
			tx, err := db.BeginTx(tctx, txo)
			if err != nil {
				end()
				return nil, err
			}
			return sqlTxn{tx, end}, nil
		}, func(ctx context.Context, t txn) error {
			return fn(ctx, t.(sqlTxn).Tx, d)
		})
	})
}

// A txn is a transaction of either driver.
type txn interface {
	// broken reports whether the transaction's connection is gone.
	broken() bool
	// queryInt runs a statement that answers one integer.
	queryInt(ctx context.Context, sql string, args ...any) (int, error)
	commit(ctx context.Context) error
	rollback(ctx context.Context) error
}

type pgxTxn struct{ pgx.Tx }

func (t pgxTxn) broken() bool { return t.Conn().IsClosed() }

func (t pgxTxn) queryInt(ctx context.Context, sql string, args ...any) (n int, err error) {
	err = t.QueryRow(ctx, sql, args...).Scan(&n)
	return n, err
}
func (t pgxTxn) commit(ctx context.Context) error   { return t.Commit(ctx) }
func (t pgxTxn) rollback(ctx context.Context) error { return t.Rollback(ctx) }

// An sqlTxn is a transaction of database/sql, whose Commit and Rollback
// take no context: pgx's driver runs them under the context the
// transaction began with, so ending that context (end) bounds them.
// Commit marks the transaction done before it sends the COMMIT, so an end
// during the COMMIT does not roll it back: it abandons the connection, and
// the outcome is unknown.
type sqlTxn struct {
	*sql.Tx
	end context.CancelFunc
}

func (sqlTxn) broken() bool { return false } // database/sql does not say; lost reports driver.ErrBadConn

func (t sqlTxn) queryInt(ctx context.Context, sql string, args ...any) (n int, err error) {
	err = t.QueryRowContext(ctx, sql, args...).Scan(&n)
	return n, err
}
func (t sqlTxn) commit(ctx context.Context) error   { return t.settle(ctx, t.Commit) }
func (t sqlTxn) rollback(ctx context.Context) error { return t.settle(ctx, t.Rollback) }

// settle runs commit or rollback, ending the transaction's context if ctx
// is done first, and in any case when it returns.
func (t sqlTxn) settle(ctx context.Context, f func() error) error {
	stop := context.AfterFunc(ctx, t.end)
	defer t.end()
	defer stop()
	return f()
}

// lost reports whether err says the database could not be reached or
// went away: the connection broke (class 08), or the server is shutting
// down or starting (class 57P).
func lost(t txn, err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return strings.HasPrefix(pe.Code, "08") || strings.HasPrefix(pe.Code, "57P")
	}
	return errors.Is(err, driver.ErrBadConn) || t.broken()
}

// settled reports whether err says the transaction was already over.
func settled(err error) bool {
	return errors.Is(err, pgx.ErrTxClosed) || errors.Is(err, sql.ErrTxDone)
}

type inbox struct {
	s                    *Store
	retry, commitTimeout time.Duration
}

func newInbox(s *Store, opts HandlerOptions) *inbox {
	h := &inbox{s: s, retry: opts.RetryDelay, commitTimeout: opts.CommitTimeout}
	if h.retry <= 0 {
		h.retry = 5 * time.Second
	}
	if h.commitTimeout <= 0 {
		h.commitTimeout = 10 * time.Second
	}
	return h
}

func (h *inbox) unavailable(err error) error {
	return rabbitmw.RetryAfter(fmt.Errorf("%w: %w", middleware.ErrStoreUnavailable, err), h.retry)
}

// handle runs one delivery's transaction: begin, call, mark, commit.
func (h *inbox) handle(ctx context.Context, begin func(context.Context) (txn, error), call func(context.Context, txn) error) error {
	c, ok := middleware.ClaimFrom(ctx)
	if !ok {
		return rabbitmw.Permanent(ErrNoClaim)
	}
	key := c.Key()
	t, err := begin(ctx)
	if err != nil {
		return h.unavailable(fmt.Errorf("pgstore: begin the transaction of %q: %w", key, err))
	}
	open := true
	defer func() {
		// On every path but the commit, including a panic in call.
		if open {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.commitTimeout)
			t.rollback(rctx)
			cancel()
		}
	}()
	if err := call(ctx, t); err != nil {
		if ctx.Err() == nil && lost(t, err) {
			// Not the message's failure: the database is the store.
			return h.unavailable(fmt.Errorf("pgstore: the transaction of %q: %w", key, err))
		}
		return err
	}
	// fn has returned: its effect is in the transaction. The mark and the
	// commit run even if ctx is cancelled from now on (a consumer's
	// shutdown deadline, the Timeout layer, Dedup unsure of its lease):
	// the mark checks the claim's owner and lease on the database's clock,
	// and once it is written the transaction holds the claim's row.
	// A consumer that stops waits for them (see package recording) before
	// it lets its process exit.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.commitTimeout)
	defer cancel()
	rec := recording.Begin(ctx, time.Now().Add(h.commitTimeout))
	defer rec.End()
	marked, err := t.queryInt(sctx, h.s.markSQL, []byte(key), []byte(c.Token()), c.Retention())
	switch {
	case err != nil && ctx.Err() != nil && !lost(t, err) && !isPgError(err):
		// Cancelled before the mark, while fn ran: database/sql
		// reports a transaction it closed on cancellation as ErrTxDone,
		// which is not fn's doing.
		return fmt.Errorf("pgstore: mark %q done: %w (%w)", key, err, context.Cause(ctx))
	case settled(err):
		return rabbitmw.Permanent(fmt.Errorf("%w: key %q", ErrTxSettled, key))
	case err != nil && !lost(t, err) && isPgError(err):
		// The server refused: a serialisation failure, or a statement of
		// fn that failed with its error dropped (the transaction is
		// aborted). fn's attempt failed.
		return fmt.Errorf("pgstore: mark %q done: %w", key, err)
	case err != nil:
		return h.unavailable(fmt.Errorf("pgstore: mark %q done: %w", key, err))
	case marked < 0 && ctx.Err() == nil:
		// No row at all, while Dedup still holds its claim (it would have
		// cancelled ctx had its renewals found the row gone): the claim is
		// in another store.
		return rabbitmw.Permanent(fmt.Errorf("%w: key %q has no claim in this store: the Dedup in front holds its claim in another store", ErrNoClaim, key))
	case marked <= 0:
		return rabbitmw.RetryAfter(fmt.Errorf("%w: pgstore: %q is no longer owned by this claim (its lease ended, or another consumer took it over): the transaction was rolled back", middleware.ErrLeaseLost, key), h.retry)
	}
	open = false
	err = t.commit(sctx)
	switch {
	case err == nil:
		c.MarkedDone()
		return nil
	case isPgError(err) && !lost(t, err):
		// The server answered: the transaction did not commit.
		return fmt.Errorf("pgstore: commit the transaction of %q: %w", key, err)
	}
	return h.unavailable(fmt.Errorf("pgstore: commit the transaction of %q: its answer was lost, so whether it took effect is unknown (if it did, the redelivery finds the message done): %w", key, err))
}
