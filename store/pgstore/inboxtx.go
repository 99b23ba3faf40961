package pgstore

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// An inboxTx is the pgx.Tx that [Handler] gives its function: a
// transaction on conn whose BEGIN costs no round trip of its own. The
// BEGIN travels in one pipeline with the function's first Exec or
// QueryRow ([pgx.Batch.BeginTx]), or, if the function sent nothing, with
// the done mark and the COMMIT. Every other way to the connection (Query,
// SendBatch, CopyFrom, Prepare, Begin, LargeObjects, Conn) begins the
// transaction first, in a round trip of its own, so that no statement of
// the function ever runs outside it; so does an Exec or QueryRow that a
// batch cannot run as pgx runs it alone: one with query options other
// than a QueryRewriter, or an Exec without arguments (pgx sends it in the
// simple protocol, which takes several commands in one string). Once the
// function committed or rolled back, every statement fails with
// pgx.ErrTxClosed.
//
// An inboxTx is used by one goroutine at a time, as any pgx.Tx.
type inboxTx struct {
	conn    *pgx.Conn
	opts    pgx.TxOptions
	began   bool   // BEGIN was sent
	settled bool   // the function called Commit or Rollback
	tx      pgx.Tx // pgx's transaction, once BEGIN was sent by pgx
	// renew replaces conn, which pgx closed before anything ran on it, by
	// another connection.
	renew func(context.Context) (*pgx.Conn, error)
}

// beginSQL is the BEGIN of opts, as pgx writes it.
func beginSQL(opts pgx.TxOptions) string {
	if opts.BeginQuery != "" {
		return opts.BeginQuery
	}
	var b strings.Builder
	b.WriteString("begin")
	if opts.IsoLevel != "" {
		b.WriteString(" isolation level " + string(opts.IsoLevel))
	}
	if opts.AccessMode != "" {
		b.WriteString(" " + string(opts.AccessMode))
	}
	if opts.DeferrableMode != "" {
		b.WriteString(" " + string(opts.DeferrableMode))
	}
	return b.String()
}

// begin begins the transaction in a round trip of its own, unless it
// began already.
func (t *inboxTx) begin(ctx context.Context) error {
	if t.began {
		return nil
	}
	if t.settled {
		return pgx.ErrTxClosed
	}
	tx, err := t.conn.BeginTx(ctx, t.opts)
	if err != nil {
		return err
	}
	t.began, t.tx = true, tx
	return nil
}

// batched returns sql and args as a batch must queue them to run them as
// pgx would run them alone, or ok false if a batch cannot: a batch takes
// no query option but a QueryRewriter (which batched applies), and pgx
// sends an Exec without arguments in the simple protocol, which takes
// several commands in one string.
func (t *inboxTx) batched(ctx context.Context, exec bool, sql string, args []any) (_ string, _ []any, ok bool, err error) {
	var rewriter pgx.QueryRewriter
options:
	for len(args) > 0 {
		switch a := args[0].(type) {
		case pgx.QueryExecMode, pgx.QueryResultFormats, pgx.QueryResultFormatsByOID:
			return "", nil, false, nil
		case pgx.QueryRewriter:
			rewriter, args = a, args[1:]
		default:
			break options
		}
	}
	if rewriter != nil {
		if sql, args, err = rewriter.RewriteQuery(ctx, t.conn, sql, args); err != nil {
			return "", nil, false, fmt.Errorf("rewrite query failed: %w", err)
		}
	}
	return sql, args, !exec || len(args) > 0, nil
}

// pipeline sends sql with the BEGIN, in one batch, and returns the batch
// after reading the BEGIN's result; or it returns ok false, having sent
// nothing, if the statement cannot travel in a batch (see batched). The
// caller reads the statement's result, and closes the batch.
func (t *inboxTx) pipeline(ctx context.Context, exec bool, sql string, args []any) (_ pgx.BatchResults, ok bool, _ error) {
	if t.settled {
		return nil, true, pgx.ErrTxClosed
	}
	sql, args, ok, err := t.batched(ctx, exec, sql, args)
	if !ok || err != nil {
		return nil, ok, err
	}
	t.began = true
	var b pgx.Batch
	b.BeginTx(t.opts)
	b.Queue(sql, args...)
	br := t.conn.SendBatch(ctx, &b)
	t.tx = br.Tx()
	if _, err := br.Exec(); err != nil {
		br.Close()
		// No transaction, unless the connection cannot tell.
		t.began = t.conn.PgConn().TxStatus() != 'I'
		if unencodable(err) && t.conn.IsClosed() {
			// pgx closed the connection over an argument it could not
			// encode, before the batch ran. fn may go on, as on a
			// transaction of pgx, which such an error leaves as it was:
			// on another connection. If there is none, the closed one
			// reports the database unreachable.
			if c, rerr := t.renew(ctx); rerr == nil {
				t.conn, t.began = c, false
			}
		}
		return nil, true, err
	}
	return br, true, nil
}

// unencodable reports whether err is pgx's refusal of a batch whose
// arguments it could not encode (an ErrPreprocessingBatch of its build
// step), after which pgx closes the connection.
func unencodable(err error) bool {
	var pe pgx.ErrPreprocessingBatch
	return errors.As(err, &pe) && strings.HasPrefix(pe.Error(), "error preprocessing batch (build)")
}

func (t *inboxTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	if !t.began {
		br, ok, err := t.pipeline(ctx, true, sql, args)
		switch {
		case err != nil:
			return pgconn.CommandTag{}, err
		case ok:
			tag, err := br.Exec()
			if cerr := br.Close(); err == nil {
				err = cerr
			}
			return tag, err
		}
		if err := t.begin(ctx); err != nil {
			return pgconn.CommandTag{}, err
		}
	}
	return t.tx.Exec(ctx, sql, args...)
}

func (t *inboxTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	if t.began {
		return t.tx.QueryRow(ctx, sql, args...)
	}
	return &beginRow{t: t, ctx: ctx, sql: sql, args: args}
}

// A beginRow is the row of a QueryRow that may be the transaction's first
// statement: Scan sends it with the BEGIN, unless the transaction began
// since.
type beginRow struct {
	t    *inboxTx
	ctx  context.Context
	sql  string
	args []any
}

func (r *beginRow) Scan(dest ...any) error {
	if !r.t.began {
		br, ok, err := r.t.pipeline(r.ctx, false, r.sql, r.args)
		switch {
		case err != nil:
			return err
		case ok:
			err = br.QueryRow().Scan(dest...)
			if cerr := br.Close(); err == nil {
				err = cerr
			}
			return err
		}
		if err := r.t.begin(r.ctx); err != nil {
			return err
		}
	}
	return r.t.tx.QueryRow(r.ctx, r.sql, r.args...).Scan(dest...)
}

func (t *inboxTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	return t.tx.Query(ctx, sql, args...)
}

func (t *inboxTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	if err := t.begin(ctx); err != nil {
		return pgx.FailedBatchResults(b, err)
	}
	return t.tx.SendBatch(ctx, b)
}

func (t *inboxTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, rows pgx.CopyFromSource) (int64, error) {
	if err := t.begin(ctx); err != nil {
		return 0, err
	}
	return t.tx.CopyFrom(ctx, table, columns, rows)
}

func (t *inboxTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	return t.tx.Prepare(ctx, name, sql)
}

// Begin starts a pseudo nested transaction (a savepoint), as pgx's does.
func (t *inboxTx) Begin(ctx context.Context) (pgx.Tx, error) {
	if err := t.begin(ctx); err != nil {
		return nil, err
	}
	return t.tx.Begin(ctx)
}

// LargeObjects takes no context: the BEGIN it may send runs without one.
// If it fails, so do the large objects' methods.
func (t *inboxTx) LargeObjects() pgx.LargeObjects {
	if err := t.begin(context.Background()); err != nil {
		var b pgx.Batch
		b.BeginTx(t.opts)
		return pgx.FailedBatchResults(&b, err).Tx().LargeObjects()
	}
	return t.tx.LargeObjects()
}

// Conn takes no context: the BEGIN it may send runs without one. If it
// fails, Conn closes the connection, so that no statement runs on it
// outside the transaction.
func (t *inboxTx) Conn() *pgx.Conn {
	if err := t.begin(context.Background()); err != nil {
		t.conn.Close(context.Background())
	}
	return t.conn
}

func (t *inboxTx) Commit(ctx context.Context) error { return t.settle(ctx, "COMMIT", pgx.Tx.Commit) }

func (t *inboxTx) Rollback(ctx context.Context) error {
	return t.settle(ctx, "ROLLBACK", pgx.Tx.Rollback)
}

// settle commits or rolls back (end, or the statement sql), once. A
// transaction that never began has nothing to send; one whose BEGIN went
// with the done mark (see pgxTxn.markAndCommit) has no transaction of pgx
// to end: sql ends it.
func (t *inboxTx) settle(ctx context.Context, sql string, end func(pgx.Tx, context.Context) error) error {
	if t.settled {
		return pgx.ErrTxClosed
	}
	t.settled = true
	switch {
	case !t.began:
		return nil
	case t.tx == nil:
		_, err := t.conn.Exec(ctx, sql)
		return err
	}
	return end(t.tx, ctx)
}

var _ pgx.Tx = (*inboxTx)(nil)
