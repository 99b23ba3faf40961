package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// The transaction that Handler gives fn begins with fn's first statement,
// whichever way fn sends it: every way runs inside the transaction, so an
// effect commits with the done mark, and rolls back with fn's error.
func TestHandlerTxEveryWayRunsInTheTransaction(t *testing.T) {
	inEveryMode(t, testHandlerTxEveryWayRunsInTheTransaction)
}

func testHandlerTxEveryWayRunsInTheTransaction(t *testing.T, opts pgstore.HandlerOptions) {
	ways := []struct {
		name   string
		effect func(ctx context.Context, tx pgx.Tx, insert, id string) error
	}{
		{"Exec", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			_, err := tx.Exec(ctx, insert, id)
			return err
		}},
		{"QueryRow", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			var seq int
			return tx.QueryRow(ctx, insert+` RETURNING seq`, id).Scan(&seq)
		}},
		{"Query", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			rows, err := tx.Query(ctx, insert+` RETURNING seq`, id)
			if err != nil {
				return err
			}
			rows.Close()
			return rows.Err()
		}},
		{"SendBatch", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			var b pgx.Batch
			b.Queue(insert, id)
			return tx.SendBatch(ctx, &b).Close()
		}},
		{"CopyFrom", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			table := insert[len("INSERT INTO ") : len(insert)-len(" (id) VALUES ($1)")]
			_, err := tx.CopyFrom(ctx, pgx.Identifier{table}, []string{"id"}, pgx.CopyFromRows([][]any{{id}}))
			return err
		}},
		{"Prepare", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			if _, err := tx.Prepare(ctx, "effect", insert); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "effect", id)
			return err
		}},
		{"Conn", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			_, err := tx.Conn().Exec(ctx, insert, id)
			return err
		}},
		{"Begin", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			sp, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if _, err := sp.Exec(ctx, insert, id); err != nil {
				return err
			}
			return sp.Commit(ctx)
		}},
		{"Exec of two statements", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			// No arguments: pgx sends it in the simple protocol, which
			// takes several statements.
			_, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '10s'; `+strings.Replace(insert, "$1", "'"+id+"'", 1))
			return err
		}},
		{"Exec in a mode of its own", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			_, err := tx.Exec(ctx, insert, pgx.QueryExecModeSimpleProtocol, id)
			return err
		}},
		{"QueryRow in formats of its own", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			var seq string
			return tx.QueryRow(ctx, insert+` RETURNING seq`, pgx.QueryResultFormats{pgx.TextFormatCode}, id).Scan(&seq)
		}},
		{"QueryRow after Exec", func(ctx context.Context, tx pgx.Tx, insert, id string) error {
			if _, err := tx.Exec(ctx, `SELECT 1`); err != nil {
				return err
			}
			var seq int
			return tx.QueryRow(ctx, insert+` RETURNING seq`, id).Scan(&seq)
		}},
	}
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	insert := `INSERT INTO ` + f.effects + ` (id) VALUES ($1)`
	boom := errors.New("boom")
	for _, w := range ways {
		for _, p := range f.paths() {
			t.Run(w.name+"/"+p.name, func(t *testing.T) {
				fail := true
				h := p.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
					if err := w.effect(ctx, tx, insert, d.MessageId); err != nil {
						return err
					}
					if fail {
						return boom
					}
					return nil
				}, opts), middleware.DedupOptions{})
				id := "m-" + w.name + "-" + p.name
				require.ErrorIs(t, h.Handle(ctx, delivery(id)), boom)
				assert.Equal(t, 0, f.count(t, id), "effects after fn failed: the statement ran outside the transaction")
				fail = false
				require.NoError(t, h.Handle(ctx, delivery(id)))
				assert.Equal(t, 1, f.count(t, id), "effects after fn succeeded")
				assert.Equal(t, store.Done, f.status(t, id))
			})
		}
	}
}

// A function that sends nothing still gets its key marked done: the BEGIN
// travels with the mark.
func TestHandlerTxUnused(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(context.Context, pgx.Tx, *amqp.Delivery) error { return nil }, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	require.NoError(t, h.Handle(ctx, delivery("m1")))
	assert.Equal(t, store.Done, f.status(t, "m1"))
}

// The BEGIN sent with the first statement carries HandlerOptions.TxOptions,
// and a QueryRow that finds no row reports pgx.ErrNoRows, as pgx's does.
func TestHandlerTxFirstStatement(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	var iso string
	var noRows error
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := tx.QueryRow(ctx, `SHOW transaction_isolation`).Scan(&iso); err != nil {
			return err
		}
		var seq int
		noRows = tx.QueryRow(ctx, `SELECT seq FROM `+f.effects+` WHERE false`).Scan(&seq)
		return nil
	}, pgstore.HandlerOptions{TxOptions: pgx.TxOptions{IsoLevel: pgx.Serializable}}), middleware.DedupOptions{})
	require.NoError(t, h.Handle(ctx, delivery("m1")))
	assert.Equal(t, "serializable", iso)
	assert.ErrorIs(t, noRows, pgx.ErrNoRows)

	// The same, when the first statement is the one that finds no row.
	h = f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		var seq int
		noRows = tx.QueryRow(ctx, `SELECT seq FROM `+f.effects+` WHERE false`).Scan(&seq)
		return nil
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	require.NoError(t, h.Handle(ctx, delivery("m2")))
	assert.ErrorIs(t, noRows, pgx.ErrNoRows)
	assert.Equal(t, store.Done, f.status(t, "m2"))
}

// An argument of fn's first statement that cannot be encoded is fn's
// failure, as with a transaction of pgx: counted towards the poison
// limit, not taken for an unreachable database (which is retried without
// end and never counted).
func TestHandlerTxArgumentRefused(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, err := tx.Exec(ctx, `INSERT INTO `+f.effects+` (seq, id) VALUES ($1, $2)`, int64(1)<<40, d.MessageId)
		return err
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	err := h.Handle(ctx, delivery("m1"))
	require.Error(t, err)
	assert.NotErrorIs(t, err, middleware.ErrStoreUnavailable)
	assert.ErrorContains(t, err, "greater than maximum value for int4")
	assert.Equal(t, 1, rabbitmw.Decide(err).Attempts, "attempts counted")
	assert.Equal(t, 0, f.count(t, "m1"))

	// The error leaves the transaction as it was: fn may go on.
	var refused error
	h = f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, refused = tx.Exec(ctx, `INSERT INTO `+f.effects+` (seq, id) VALUES ($1, $2)`, int64(1)<<40, d.MessageId)
		return f.insert(ctx, tx, d)
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	require.NoError(t, h.Handle(ctx, delivery("m2")))
	assert.Error(t, refused)
	assert.Equal(t, 1, f.count(t, "m2"))
	assert.Equal(t, store.Done, f.status(t, "m2"))
}

// Once fn committed or rolled back the transaction, its statements fail
// with pgx.ErrTxClosed, as on a transaction of pgx, and run nowhere: not
// in a transaction of their own either.
func TestHandlerTxClosedOnceSettled(t *testing.T) {
	for _, how := range []string{"commit", "rollback"} {
		t.Run(how, func(t *testing.T) {
			ctx := context.Background()
			f := newInbox(t, newPool(t))
			var execErr, rowErr error
			h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				settle := tx.Commit
				if how == "rollback" {
					settle = tx.Rollback
				}
				if err := settle(ctx); err != nil {
					return err
				}
				_, execErr = tx.Exec(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
				var seq int
				rowErr = tx.QueryRow(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1) RETURNING seq`, d.MessageId).Scan(&seq)
				return nil
			}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
			require.ErrorIs(t, h.Handle(ctx, delivery("m1")), pgstore.ErrTxSettled)
			assert.ErrorIs(t, execErr, pgx.ErrTxClosed, "Exec after %s", how)
			assert.ErrorIs(t, rowErr, pgx.ErrTxClosed, "QueryRow after %s", how)
			assert.Equal(t, 0, f.count(t, "m1"), "effects")
		})
	}
}

// A function that sends nothing, whose claim is lost before the mark:
// the mark, which carries the BEGIN, marks nothing, and the transaction
// is rolled back, as when fn sent something.
func TestHandlerTxUnusedClaimLost(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		c, _ := middleware.ClaimFrom(ctx)
		require.NoError(t, f.st.Release(ctx, c.Key(), c.Token()))
		_, err := f.st.Claim(ctx, c.Key(), "thief", time.Minute)
		require.NoError(t, err)
		return nil
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	assert.ErrorIs(t, h.Handle(ctx, delivery("m1")), middleware.ErrLeaseLost)
	got, err := f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Equal(t, store.Processing, got.Status, "m1, claimed by the thief")
	assert.Equal(t, "thief", got.Token)
}

// The connection that replaces the one pgx closed over an argument it
// could not encode comes from the pool even when the closed one was its
// last: a pool of one connection serves Handler, whose function then goes
// on at once.
func TestHandlerTxArgumentRefusedPoolOfOne(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPoolWith(t, func(cfg *pgxpool.Config) { cfg.MaxConns = 1 }))
	var refused error
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, refused = tx.Exec(ctx, `INSERT INTO `+f.effects+` (seq, id) VALUES ($1, $2)`, int64(1)<<40, d.MessageId)
		return f.insert(ctx, tx, d)
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	hctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	start := time.Now()
	require.NoError(t, h.Handle(hctx, delivery("m1")))
	assert.Less(t, time.Since(start), 3*time.Second, "Handle's time")
	assert.Error(t, refused)
	assert.Equal(t, 1, f.count(t, "m1"))
}

// If the pool gives no connection to replace the one pgx closed over an
// argument it could not encode, the delivery fails as when the database
// cannot be reached, and nothing is committed.
func TestHandlerTxArgumentRefusedNoConnection(t *testing.T) {
	ctx := context.Background()
	var refuse atomic.Bool
	f := newInbox(t, newPoolWith(t, func(cfg *pgxpool.Config) {
		cfg.PrepareConn = func(context.Context, *pgx.Conn) (bool, error) {
			if refuse.Load() {
				return false, errors.New("no connection for you")
			}
			return true, nil
		}
	}))
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		refuse.Store(true)
		defer refuse.Store(false)
		_, err := tx.Exec(ctx, `INSERT INTO `+f.effects+` (seq, id) VALUES ($1, $2)`, int64(1)<<40, d.MessageId)
		assert.Error(t, err)
		return f.insert(ctx, tx, d) // goes on regardless
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	assert.ErrorIs(t, h.Handle(ctx, delivery("m1")), middleware.ErrStoreUnavailable)
	assert.Equal(t, 0, f.count(t, "m1"))
}

// Savepoints nest in Handler's transaction as in pgx's: a statement that
// fails in an inner one, rolled back to, leaves the transaction going, and
// what the outer ones hold commits with the done mark.
func TestHandlerTxNestedSavepoints(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	insert := `INSERT INTO ` + f.effects + ` (id) VALUES ($1)`
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		outer, err := tx.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := outer.Exec(ctx, insert, d.MessageId+"-outer"); err != nil {
			return err
		}
		inner, err := outer.Begin(ctx)
		if err != nil {
			return err
		}
		if _, err := inner.Exec(ctx, insert, d.MessageId+"-inner"); err != nil {
			return err
		}
		if _, err := inner.Exec(ctx, `SELECT 1/0`); err == nil {
			return errors.New("division by zero succeeded")
		}
		if err := inner.Rollback(ctx); err != nil {
			return err
		}
		if err := outer.Commit(ctx); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, insert, d.MessageId)
		return err
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	require.NoError(t, h.Handle(ctx, delivery("m1")))
	assert.Equal(t, 1, f.count(t, "m1-outer"))
	assert.Equal(t, 0, f.count(t, "m1-inner"), "effects rolled back to the inner savepoint")
	assert.Equal(t, 1, f.count(t, "m1"))
	assert.Equal(t, store.Done, f.status(t, "m1"))
}
