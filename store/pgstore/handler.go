package pgstore

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
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
	// dead-lettered: the chain is built wrong. (A Dedup with FailOpen
	// runs the handler without a claim when its claim could not reach the
	// database: the handler then answers ErrStoreUnavailable, to be tried
	// again after RetryDelay, and runs nothing.)
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
// returns, nor leave rows of it unclosed (the connection is then busy,
// and the attempt fails, rolled back). Its error is returned as the handler's (wrap it in
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
	// deferrable modes. SQLHandler uses its isolation level. The access
	// mode cannot be read only: the transaction writes the done mark.
	TxOptions pgx.TxOptions
	// RetryDelay is how long a delivery waits before it is tried again
	// when the database could not be reached, or the claim was lost
	// before the done mark, or its context ended while it waited for a
	// connection, or a group (with GroupCommit), to claim its key in the
	// transaction, or before it could run again alone after its group's
	// commit was refused. Default 5 seconds.
	RetryDelay time.Duration
	// CommitTimeout bounds the done mark and the commit, which run even if
	// the handler's context is cancelled once fn has returned (a consumer
	// that stops cancels it at its shutdown deadline): the mark checks the
	// claim's owner and lease on the database's clock, and once it is
	// written the transaction holds the claim's row, no other consumer can
	// take the message over, and committing is safe. Default 10 seconds.
	CommitTimeout time.Duration
	// GroupCommit lets up to GroupCommit deliveries that Handler claims in
	// the transaction share one transaction, and one commit (see "Group
	// commit" in the package documentation). 0 or 1 (the default): each
	// has a transaction of its own. At most 32. SQLHandler ignores it.
	//
	// Each delivery keeps its guarantee: its claim and its function's
	// effect run within a savepoint of its own, and commit together or not
	// at all, and its handler returns nil only once the group's commit
	// succeeded. The price: a delivery's result waits for the members of
	// its group after it, and its commit; the members' functions run one
	// after another, on one connection; a commit that the server refuses
	// runs every member again, alone; a member that stalls holds its
	// group-mates, as long as its context or the lease lets it.
	GroupCommit int
}

// Handler returns the handler of a transactional inbox: it applies the
// effect of each delivery and marks the delivery's key done in one
// transaction, so that no effect is ever committed twice, whatever crashes.
// It runs beneath middleware.Dedup over the same Store s (the recommended
// stack, with Handler as the business handler).
//
// A delivery that was never delivered before is claimed in the
// transaction (Handler is a middleware.ClaimingHandler, which Dedup finds
// directly beneath it or beneath its Timeout): Handler begins the
// transaction with an INSERT of the key's row as a done mark, in the round
// trip of the BEGIN, calls fn, and commits (writing the mark again first
// if fn ran for longer than a second, or a hundredth of the retention, so
// that the retention starts at the success). The row, uncommitted, holds
// the key meanwhile: another claim of the key waits for it a second at
// most, then is answered busy. No lease is renewed: the claim ends, as a
// lost one, if the transaction is left idle for the lease (see the
// package documentation). If the key has a row, the transaction is rolled
// back, and Dedup claims as below. If the context ends while the claim
// waits for a connection of the pool (or for its answer), nothing ran:
// Handler returns the context's cause, not counted, tried again after
// RetryDelay, rather than leave the delivery to Dedup's claim, under
// which fn would run with a new deadline. The results are those listed
// below.
//
// A redelivered delivery is claimed by Dedup, in a transaction of its
// own: its attempt before may have killed its consumer, leaving nothing
// if its claim was in the transaction (see the package documentation).
// For each delivery that Dedup claimed, Handler:
//
//  1. takes a connection of s's pool, for a transaction;
//  2. calls fn with the transaction;
//  3. if fn returned nil, marks the key of Dedup's claim done in the same
//     transaction, with a conditional UPDATE that matches only if the
//     claim's token still owns the key and its lease has not ended;
//  4. commits, if the mark matched, and tells Dedup
//     (middleware.Claim.MarkedDone) that the mark is written, so that
//     Dedup writes none.
//
// The BEGIN costs no round trip of its own: it is sent with fn's first
// Exec or QueryRow (fn's other ways to the connection, and an Exec
// without arguments or a statement with query options, send it first, on
// its own; none runs a statement outside the transaction), or with the
// mark if fn sent nothing. Steps 3 and 4 travel in one round trip: the
// mark fails when it matches nothing, and the server then skips the
// COMMIT.
//
// Results:
//
//   - fn's error: the transaction is rolled back, and the error returned
//     (Dedup releases the claim; Retry counts the attempt); but if the
//     connection broke or the server is shutting down (SQLSTATE class 08,
//     57P), it wraps middleware.ErrStoreUnavailable and is not counted: the
//     database is the store, and it was not the message's fault. (A
//     connection that pgx closed to stop a statement at a deadline of
//     fn's own, with the error saying so, is fn's failure, counted.)
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
//   - fn committed or rolled back tx: [ErrTxSettled], dead-lettered (a
//     claim made in tx committed with it: the key is then done).
//   - no Dedup in front, or a Dedup over another store: [ErrNoClaim],
//     dead-lettered.
//   - a Dedup with FailOpen in front, whose claim could not reach the
//     database, runs Handler without a claim: an error wrapping
//     middleware.ErrStoreUnavailable, not counted, tried again after
//     RetryDelay; fn does not run.
//
// The transaction touches the claim's row only at step 3, just before the
// commit, so Dedup's lease renewals (on connections of their own, see
// [Store]) never wait for a long-running fn, and fn never waits for a
// renewal longer than that one statement. Handler panics if s or fn is
// nil, opts.GroupCommit is out of range, or opts.TxOptions is read only.
func Handler(s *Store, fn TxFunc, opts HandlerOptions) rabbitmw.Handler {
	if s == nil || fn == nil {
		panic("pgstore: Handler: nil store or function")
	}
	if opts.TxOptions.AccessMode == pgx.ReadOnly {
		panic(errReadOnly("Handler"))
	}
	if opts.GroupCommit < 0 || opts.GroupCommit > maxGroupCommit {
		panic(fmt.Sprintf("pgstore: Handler: GroupCommit %d out of [0, %d]", opts.GroupCommit, maxGroupCommit))
	}
	h := &txHandler{in: newInbox(s, opts), fn: fn, opts: opts.TxOptions}
	if opts.GroupCommit > 1 {
		h.groups = newGrouper(h, opts.GroupCommit)
	}
	return h
}

// SQLHandler is [Handler] on database/sql, for code written against
// *sql.Tx (sqlc, sqlx, GORM): fn gets a transaction of db, which must be
// the database of s, opened through pgx's driver, for example with
// stdlib.OpenDBFromPool(pool) (package github.com/jackc/pgx/v5/stdlib).
// Everything Handler says of a delivery under Dedup's claim holds for it;
// it claims no key in its transaction, so Dedup claims every delivery.
// SQLHandler panics if s, db or fn is nil, or opts.TxOptions is read
// only.
func SQLHandler(s *Store, db *sql.DB, fn SQLTxFunc, opts HandlerOptions) rabbitmw.Handler {
	if s == nil || db == nil || fn == nil {
		panic("pgstore: SQLHandler: nil store, database or function")
	}
	if opts.TxOptions.AccessMode == pgx.ReadOnly {
		panic(errReadOnly("SQLHandler"))
	}
	h := newInbox(s, opts)
	txo := new(sql.TxOptions)
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
			// The transaction's connection is held apart, so that
			// markAndCommit can ask pgx whether fn left it busy; the wait
			// for it ends with ctx (a pool whose connections are all in
			// use). database/sql rolls a transaction back when the
			// context of BeginTx ends: that would take the commit's
			// decision away from handle, so the transaction's context
			// ends only when sqlTxn says so. Statements still run under
			// ctx.
			conn, err := db.Conn(ctx)
			if err != nil {
				return nil, err
			}
			tctx, end := context.WithCancel(context.WithoutCancel(ctx))
			tx, err := conn.BeginTx(tctx, txo)
			if err != nil {
				conn.Close()
				end()
				return nil, err
			}
			return sqlTxn{Tx: tx, conn: conn, s: s, end: end}, nil
		}, func(ctx context.Context, t txn) error {
			return fn(ctx, t.(sqlTxn).Tx, d)
		})
	})
}

// errReadOnly is the panic of the constructor name given read-only
// TxOptions: every message's done mark would fail, and every message be
// dead-lettered.
func errReadOnly(name string) string {
	return "pgstore: " + name + ": TxOptions.AccessMode is read only, and the transaction must write the done mark"
}

// A txn is a transaction of either driver.
type txn interface {
	// broken reports whether the transaction's connection is gone.
	broken() bool
	// markAndCommit writes the done mark of key by token, with the
	// retention, as the transaction's last statement, and commits if it
	// marked the key. marked is the mark's answer (markSQL's: 1 marked, 0
	// the key's row belongs to no claim of token, -1 no row) when markErr
	// is nil. markErr is the mark's error: nothing was committed.
	// commitErr is the commit's: a server's error means it did not
	// commit, any other that its outcome is unknown.
	markAndCommit(ctx context.Context, key, token []byte, retention time.Duration) (marked int, markErr, commitErr error)
	rollback(ctx context.Context) error
	// release ends the transaction's hold on its connection after the
	// commit was sent.
	release()
}

// A pgxTxn is Handler's transaction: tx, on conn, a connection of s's
// pool that it holds until the commit or the rollback. tx may not have
// begun yet (see inboxTx).
type pgxTxn struct {
	s    *Store
	conn *pgxpool.Conn
	tx   *inboxTx
}

// broken reports whether the transaction's connection is gone: closed,
// or not replaced (see renew).
func (t *pgxTxn) broken() bool { return t.conn == nil || t.conn.Conn().IsClosed() }

// renew replaces conn, which pgx closed before tx began on it, by another
// connection of the pool (see inboxTx.pipeline). The closed one goes back
// first: it may be the pool's last. If the pool gives none, conn is nil.
func (t *pgxTxn) renew(ctx context.Context) (*pgx.Conn, error) {
	t.conn.Release()
	t.conn = nil
	conn, err := t.s.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	t.conn = conn
	return conn.Conn(), nil
}

// errNoConn: the pool gave no connection to replace the one pgx closed.
var errNoConn = errors.New("pgstore: the transaction's connection was closed, and the pool gave no other")

// errRowsOpen: the function returned while the rows of one of its
// queries were unread and unclosed, so nothing more can be sent on the
// connection, not even a rollback: pgx closes it, and the server rolls
// the transaction back. The function failed, and not the database.
var errRowsOpen = errors.New("pgstore: the function returned with the rows of a query unclosed; its transaction was rolled back")

// markAndCommit sends the mark and the COMMIT together, in one round trip
// (a pipeline of the prepared mark and COMMIT, with one Sync): the mark
// statement of markCommitSQL fails with a division by zero when it marks
// nothing, and the server skips the COMMIT after an error, so the
// transaction commits only if the key was marked. Then markAndCommit
// reads which of 0 and -1 a failed mark meant, after the rollback.
func (t *pgxTxn) markAndCommit(ctx context.Context, key, token []byte, retention time.Duration) (int, error, error) {
	if t.conn == nil {
		return 0, errNoConn, nil
	}
	pc := t.conn.Conn().PgConn()
	if t.tx.settled || t.tx.began && pc.TxStatus() == 'I' {
		// fn committed or rolled back tx itself.
		return 0, pgx.ErrTxClosed, nil
	}
	if pc.IsBusy() {
		return 0, errRowsOpen, nil
	}
	args := [][]byte{key, token, binary.BigEndian.AppendUint64(nil, uint64(retention.Microseconds()))}
	binary3 := []int16{1, 1, 1}
	var b pgconn.Batch
	first := 0 // the mark's result
	if !t.tx.began {
		// fn sent nothing: the BEGIN goes with the mark.
		t.tx.began = true
		b.ExecParams(beginSQL(t.tx.opts), nil, nil, nil, nil)
		first = 1
	}
	if t.s.prepareMark {
		// Prepared once per connection; then only Bind and Execute are
		// sent.
		sd, err := t.conn.Conn().Prepare(ctx, t.s.markCommitName, t.s.markCommitSQL)
		if err != nil {
			return 0, err, nil
		}
		b.ExecStatement(sd, args, binary3, nil)
	} else {
		// The pool sends no named statements (a pooler in transaction
		// mode, say): an unnamed one, parsed each time.
		b.ExecParams(t.s.markCommitSQL, args, []uint32{pgtype.ByteaOID, pgtype.ByteaOID, pgtype.Int8OID}, binary3, nil)
	}
	b.ExecParams("COMMIT", nil, nil, nil, nil)
	results, err := pc.ExecBatch(ctx, &b).ReadAll()
	var pe *pgconn.PgError
	switch {
	case err == nil:
		return 1, nil, nil
	case len(results) > first && results[first].Err == nil && errors.As(err, &pe):
		// The mark marked: the COMMIT failed, and the server ended the
		// transaction.
		return 1, nil, err
	case errors.As(err, &pe) && pe.Code == divisionByZero:
		// Nothing marked, nothing committed: 0 or -1?
		if err := t.tx.Rollback(ctx); err != nil {
			return 0, err, nil
		}
		var exists bool
		if err := t.conn.QueryRow(ctx, t.s.rowExistsSQL, key).Scan(&exists); err != nil {
			return 0, err, nil
		}
		if exists {
			return 0, nil, nil
		}
		return -1, nil, nil
	case errors.As(err, &pe):
		return 0, err, nil
	}
	// The connection: whether the COMMIT ran is unknown.
	return 1, nil, err
}

// rollback rolls tx back, unless it is over, and gives conn back to the
// pool (which closes it if it is still in a transaction).
func (t *pgxTxn) rollback(ctx context.Context) error {
	if t.conn == nil {
		return nil
	}
	defer t.conn.Release()
	if t.conn.Conn().PgConn().TxStatus() == 'I' {
		return nil
	}
	return t.tx.Rollback(ctx)
}

// divisionByZero is the SQLSTATE of a mark of markCommitSQL that marked
// nothing.
const divisionByZero = "22012"

// release gives conn back to the pool after the commit.
func (t *pgxTxn) release() {
	if t.conn != nil {
		t.conn.Release()
	}
}

// An sqlTxn is a transaction of database/sql, whose Commit and Rollback
// take no context: pgx's driver runs them under the context the
// transaction began with, so ending that context (end) bounds them.
// Commit marks the transaction done before it sends the COMMIT, so an end
// during the COMMIT does not roll it back: it abandons the connection, and
// the outcome is unknown. The transaction runs on conn, which goes back
// to the pool once the transaction ends.
type sqlTxn struct {
	*sql.Tx
	conn *sql.Conn
	s    *Store
	end  context.CancelFunc
}

func (sqlTxn) broken() bool { return false } // database/sql does not say; lost reports driver.ErrBadConn

// markAndCommit runs the mark, then, if it marked the key, the commit:
// two round trips (database/sql has no pipeline).
func (t sqlTxn) markAndCommit(ctx context.Context, key, token []byte, retention time.Duration) (marked int, markErr, commitErr error) {
	if t.busy() {
		return 0, errRowsOpen, nil
	}
	if markErr = t.QueryRowContext(ctx, t.s.markSQL, key, token, retention).Scan(&marked); markErr != nil || marked != 1 {
		return marked, markErr, nil
	}
	return 1, nil, t.settle(ctx, t.Commit)
}

func (t sqlTxn) rollback(ctx context.Context) error {
	defer t.conn.Close()
	return t.settle(ctx, t.Rollback)
}

func (t sqlTxn) release() { t.conn.Close() }

// busy reports whether pgx's connection under t is busy: fn left the
// rows of a query unclosed, and nothing more can be sent on it.
func (t sqlTxn) busy() bool {
	var busy bool
	t.conn.Raw(func(dc any) error {
		if c, ok := dc.(interface{ Conn() *pgx.Conn }); ok {
			busy = c.Conn().PgConn().IsBusy()
		}
		return nil
	})
	return busy
}

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

// rollback rolls t back within commitTimeout, even if ctx is done: the
// transaction ends whatever ended the delivery.
func (h *inbox) rollback(ctx context.Context, t txn) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.commitTimeout)
	defer cancel()
	t.rollback(rctx)
}

// rollbackIfOpen rolls t back if *open, which the caller clears when it
// commits: deferred, it ends t on every other path, a panic in the
// delivery's function included.
func (h *inbox) rollbackIfOpen(ctx context.Context, t txn, open *bool) {
	if *open {
		h.rollback(ctx, t)
	}
}

// failed returns the result of a delivery whose function returned err in
// t: err, unless the database could not be reached, which is not the
// message's failure (the database is the store). A deadline or a
// cancellation in err, while ctx is live, is the function's own (a
// context.WithTimeout around a query): pgx closed the connection to stop
// the statement, and the attempt failed.
func (h *inbox) failed(ctx context.Context, t txn, key string, err error) error {
	own := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
	if ctx.Err() == nil && !own && lost(t, err) {
		return h.unavailable(fmt.Errorf("pgstore: the transaction of %q: %w", key, err))
	}
	return err
}

// cut is the result of a delivery of key that waited for what, to claim
// key in a transaction, until its context ended with err: before its
// function ran. Nothing ran: the attempt leaves nothing, and Dedup
// reports no answer (see middleware.ClaimingHandler). The wait was the
// consumer's congestion, not the message's failure: not counted.
func (h *inbox) cut(key, what string, err error) error {
	return rabbitmw.NotCounted(rabbitmw.RetryAfter(fmt.Errorf("pgstore: %q waited for %s until its context ended: %w", key, what, err), h.retry))
}

// errTxSettled is the result of a delivery of key whose function
// committed or rolled back the transaction itself.
func errTxSettled(key string) error {
	return rabbitmw.Permanent(fmt.Errorf("%w: key %q", ErrTxSettled, key))
}

// noClaim returns the result of a delivery that runs without a claim of
// Dedup's: ErrNoClaim, the chain is built wrong; unless a Dedup with
// FailOpen runs it so, its store being out of reach
// (middleware.FailOpenCause): then the message is tried again, as when the
// database cannot be reached, whether or not it answers again by now.
func (h *inbox) noClaim(ctx context.Context) error {
	if err := middleware.FailOpenCause(ctx); err != nil {
		return rabbitmw.RetryAfter(fmt.Errorf("pgstore: a delivery without a claim, run by a Dedup that fails open: %w", err), h.retry)
	}
	return rabbitmw.Permanent(ErrNoClaim)
}

// handle runs one delivery's transaction: begin, call, mark, commit.
func (h *inbox) handle(ctx context.Context, begin func(context.Context) (txn, error), call func(context.Context, txn) error) error {
	c, ok := middleware.ClaimFrom(ctx)
	if !ok {
		return h.noClaim(ctx)
	}
	key := c.Key()
	t, err := begin(ctx)
	if err != nil {
		return h.unavailable(fmt.Errorf("pgstore: begin the transaction of %q: %w", key, err))
	}
	open := true
	defer h.rollbackIfOpen(ctx, t, &open)
	if err := call(ctx, t); err != nil {
		return h.failed(ctx, t, key, err)
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
	marked, err, cerr := t.markAndCommit(sctx, []byte(key), []byte(c.Token()), c.Retention())
	switch {
	case err != nil && ctx.Err() != nil && !lost(t, err) && !isPgError(err):
		// Cancelled before the mark, while fn ran: database/sql
		// reports a transaction it closed on cancellation as ErrTxDone,
		// which is not fn's doing.
		return fmt.Errorf("pgstore: mark %q done: %w (%w)", key, err, context.Cause(ctx))
	case settled(err):
		return errTxSettled(key)
	case errors.Is(err, errRowsOpen):
		return fmt.Errorf("pgstore: mark %q done: %w", key, err)
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
	// The commit was sent: whatever its answer, the transaction is over.
	open = false
	defer t.release()
	switch {
	case cerr == nil:
		c.MarkedDone()
		return nil
	case isPgError(cerr) && !lost(t, cerr):
		// The server answered: the transaction did not commit.
		return fmt.Errorf("pgstore: commit the transaction of %q: %w", key, cerr)
	}
	err = cerr
	return h.unavailable(fmt.Errorf("pgstore: commit the transaction of %q: its answer was lost, so whether it took effect is unknown (if it did, the redelivery finds the message done): %w", key, err))
}
