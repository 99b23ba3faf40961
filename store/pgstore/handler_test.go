package pgstore_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// inboxFixture is a store, an effects table beside it, and the stack.
type inboxFixture struct {
	pool    *pgxpool.Pool
	st      *pgstore.Store
	effects string // table name
}

func newInbox(t *testing.T, pool *pgxpool.Pool) *inboxFixture {
	t.Helper()
	table := uniqueTable(t, pool)
	f := &inboxFixture{pool: pool, st: newStore(t, pool, pgstore.Options{Table: table}), effects: table + "_effects"}
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+f.effects+` (seq serial PRIMARY KEY, id text NOT NULL)`)
	require.NoError(t, err)
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+f.effects) })
	return f
}

// insert is the business effect: a row in the effects table, in tx.
func (f *inboxFixture) insert(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
	return err
}

// leavesRowsOpen is a function that does its effect, then returns with
// the rows of a query unread and unclosed.
func (f *inboxFixture) leavesRowsOpen(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
	if err := f.insert(ctx, tx, d); err != nil {
		return err
	}
	rows, err := tx.Query(ctx, `SELECT generate_series(1, 3)`)
	if err != nil {
		return err
	}
	rows.Next() // the first row only: rows stays open
	return nil
}

// count returns the number of effects of id.
func (f *inboxFixture) count(t *testing.T, id string) int {
	t.Helper()
	var n int
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT count(*) FROM `+f.effects+` WHERE id = $1`, id).Scan(&n))
	return n
}

// status claims id for a stranger, with a short lease, and reports what it
// found.
func (f *inboxFixture) status(t *testing.T, id string) store.Status {
	t.Helper()
	st, err := f.st.Claim(context.Background(), id, "stranger", time.Millisecond)
	require.NoError(t, err)
	return st
}

// stack is the recommended stack over the store, around h.
func (f *inboxFixture) stack(h rabbitmw.Handler, dedup middleware.DedupOptions) rabbitmw.Handler {
	return middleware.Stack(f.st, middleware.StackOptions{Dedup: dedup})(h)
}

// stackUnderClaim is stack, with h hidden from Dedup by a layer in
// between: Dedup claims the key in the store, and h runs under its claim,
// as for a redelivered message (see pgstore.Handler).
func (f *inboxFixture) stackUnderClaim(h rabbitmw.Handler, dedup middleware.DedupOptions) rabbitmw.Handler {
	return f.stack(rabbitmw.HandlerFunc(h.Handle), dedup)
}

// A path is a way for Handler to run under Dedup: claiming the key in its
// transaction, or under Dedup's claim.
type path struct {
	name  string
	stack func(rabbitmw.Handler, middleware.DedupOptions) rabbitmw.Handler
}

func (f *inboxFixture) paths() []path {
	return []path{{"claim in the transaction", f.stack}, {"claim of Dedup", f.stackUnderClaim}}
}

func delivery(id string) *amqp.Delivery {
	return rabbitmwtest.NewRecorder().Deliver(amqp.Publishing{MessageId: id, Body: []byte(id)})
}

func TestHandlerEffectAndMarkCommitTogether(t *testing.T) {
	inEveryMode(t, testHandlerEffectAndMarkCommitTogether)
}

func testHandlerEffectAndMarkCommitTogether(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	counting := &countingStore{Store: f.st}
	h := rabbitmw.Chain(
		middleware.Retry(f.st, middleware.RetryOptions{}),
		middleware.Recover(),
		middleware.Dedup(counting, middleware.DedupOptions{}),
	)(pgstore.Handler(f.st, f.insert, opts))
	require.NoError(t, h.Handle(ctx, delivery("m1")), "first delivery")
	if n := counting.completes.Load(); n != 0 {
		t.Errorf("Dedup called Complete %d times after the handler's commit; want 0", n)
	}
	require.ErrorIs(t, h.Handle(ctx, delivery("m1")), rabbitmw.ErrDuplicate, "second delivery")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
	assert.Equal(t, store.Done, f.status(t, "m1"), "the key, claimed by a stranger afterwards")
}

func TestHandlerFailureRollsBack(t *testing.T) { inEveryMode(t, testHandlerFailureRollsBack) }

func testHandlerFailureRollsBack(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	boom := errors.New("boom")
	h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		return boom
	}, opts), middleware.DedupOptions{})
	err := h.Handle(ctx, delivery("m1"))
	require.ErrorIs(t, err, boom)
	require.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	assert.Equal(t, 0, f.count(t, "m1"), "effects rolled back")
	assert.Equal(t, store.Claimed, f.status(t, "m1"), "the key, claimed by a stranger afterwards")
}

// Another consumer took the message over while the function ran: its
// transaction must not commit the effect.
func TestHandlerLostClaimRollsBack(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	h := f.stackUnderClaim(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		c, _ := middleware.ClaimFrom(ctx)
		// The lease ends and another consumer claims the key.
		assert.NoError(t, f.st.Release(ctx, c.Key(), c.Token()), "Release")
		if st, err := f.st.Claim(ctx, c.Key(), "thief", time.Minute); err != nil || st != store.Claimed {
			t.Errorf("Claim by the thief = %v, %v", st, err)
		}
		return f.insert(ctx, tx, d)
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	err := h.Handle(ctx, delivery("m1"))
	require.ErrorIs(t, err, middleware.ErrLeaseLost)
	require.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	assert.Equal(t, 0, f.count(t, "m1"), "effects rolled back")
	assert.NoError(t, f.st.Complete(ctx, "m1", "thief", time.Minute), "the thief's claim was touched: Complete")
}

// A Dedup over another store (Redis, kept from before the inbox, or a
// Memory in a test) is as wrong as no Dedup, though it gives the handler a
// claim: the done mark finds no row for the key, and the message is
// dead-lettered with ErrNoClaim, not rolled back as a lost lease (which
// Retry does not count) and delayed forever.
func TestHandlerUnderDedupOfAnotherStore(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	other := store.NewMemory()
	h := rabbitmw.Chain(
		middleware.Retry(other, middleware.RetryOptions{MaxAttempts: 3}),
		middleware.Recover(),
		middleware.Dedup(other, middleware.DedupOptions{}),
	)(pgstore.Handler(f.st, f.insert, pgstore.HandlerOptions{}))
	var last rabbitmw.Decision
	for attempt := 1; attempt <= 10; attempt++ {
		d := delivery("m1")
		d.Redelivered = attempt > 1
		last = rabbitmw.Decide(h.Handle(ctx, d))
		if last.Outcome == rabbitmw.Ack || last.Outcome == rabbitmw.DeadLetter {
			break
		}
	}
	if last.Outcome != rabbitmw.DeadLetter {
		t.Errorf("after 10 deliveries under a Dedup of another store: %v after %v, attempts %d (%v); want dead-lettered, the chain being built wrong",
			last.Outcome, last.Delay, last.Attempts, last.Err)
	} else if !errors.Is(last.Err, pgstore.ErrNoClaim) {
		t.Errorf("dead-lettered with %v; want ErrNoClaim", last.Err)
	}
	assert.Equal(t, 0, f.count(t, "m1"), "effects committed")
}

// sendsCommit reports whether a write to PostgreSQL sends a COMMIT: a
// simple query (database/sql's Commit, pgx's), or Handler's pipeline of the
// done mark and the COMMIT (extended protocol, the COMMIT parsed each
// time).
func sendsCommit(b []byte) bool {
	return len(b) > 0 && (b[0] == 'Q' || b[0] == 'B') && bytes.Contains(bytes.ToLower(b), []byte("commit"))
}

// A connection that drops itself when the answer to a COMMIT comes: the
// server has committed, the client never hears. (Closing right after the
// COMMIT was written would race the server: it may see the connection
// gone before it commits.)
type commitCutter struct {
	net.Conn
	armed *atomic.Bool
	sent  *atomic.Bool // the COMMIT was written; its answer is awaited
}

func (c commitCutter) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if err == nil && sendsCommit(b) && c.armed.CompareAndSwap(true, false) {
		c.sent.Store(true)
	}
	return n, err
}

func (c commitCutter) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if c.sent.CompareAndSwap(true, false) {
		c.Conn.Close()
		return 0, net.ErrClosed
	}
	return n, err
}

func TestHandlerCommitAnswerLost(t *testing.T) { inEveryMode(t, testHandlerCommitAnswerLost) }

func testHandlerCommitAnswerLost(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	base := newPool(t)
	cfg := base.Config()
	var armed atomic.Bool
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return commitCutter{c, &armed, new(atomic.Bool)}, nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close) // after the tables are dropped (cleanups run last first)
	f := newInbox(t, pool)
	for _, p := range f.paths() {
		t.Run(p.name, func(t *testing.T) {
			h := p.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				armed.Store(true)
				return f.insert(ctx, tx, d)
			}, opts), middleware.DedupOptions{})
			id := "m-" + p.name
			err = h.Handle(ctx, delivery(id))
			require.ErrorIs(t, err, middleware.ErrStoreUnavailable)
			require.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
			require.False(t, armed.Load(), "the commit was never cut")
			require.Equal(t, 1, f.count(t, id), "effects: the commit took effect")
			// The retry finds the message done: no second effect, no second mark.
			require.ErrorIs(t, h.Handle(ctx, delivery(id)), rabbitmw.ErrDuplicate, "redelivery")
			assert.Equal(t, 1, f.count(t, id), "effects after the redelivery")
			// Nor is the lost answer counted as a failure of the message.
			if n, err := f.st.Fail(ctx, id, time.Minute); err != nil || n != 1 {
				t.Errorf("failure count = %d, %v; want 0 before this Fail", n-1, err)
			}
		})
	}
}

// A connection that swallows the COMMIT it is asked to send, once armed:
// the server never answers, as when the network drops it.
type commitSwallower struct {
	net.Conn
	armed *atomic.Bool
}

func (c commitSwallower) Write(b []byte) (int, error) {
	if sendsCommit(b) && c.armed.CompareAndSwap(true, false) {
		return len(b), nil
	}
	return c.Conn.Write(b)
}

// HandlerOptions.CommitTimeout bounds the commit, of Handler and of
// SQLHandler alike (database/sql's Commit takes no context): a commit whose
// answer never comes does not hold the delivery, its worker and its row
// lock forever; its outcome is unknown, so the store is unavailable.
func TestHandlerCommitTimeoutBoundsTheCommit(t *testing.T) {
	inEveryMode(t, testHandlerCommitTimeoutBoundsTheCommit)
}

func testHandlerCommitTimeoutBoundsTheCommit(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	base := newPool(t)
	cfg := base.Config()
	var armed atomic.Bool
	var mu sync.Mutex
	var conns []net.Conn
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
		return commitSwallower{c, &armed}, nil
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	f := newInbox(t, pool)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	t.Cleanup(func() { // unblocks a commit still waiting
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	opts.CommitTimeout = 200 * time.Millisecond
	for _, tt := range []struct {
		name string
		h    rabbitmw.Handler
	}{
		{"Handler", pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
			armed.Store(true)
			return f.insert(ctx, tx, d)
		}, opts)},
		{"Handler under Dedup's claim", rabbitmw.HandlerFunc(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
			armed.Store(true)
			return f.insert(ctx, tx, d)
		}, opts).Handle)},
		{"SQLHandler", pgstore.SQLHandler(f.st, db, func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
			armed.Store(true)
			_, err := tx.ExecContext(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
			return err
		}, opts)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := rabbitmw.Chain(middleware.Dedup(f.st, middleware.DedupOptions{}))(tt.h)
			done := make(chan error, 1)
			go func() { done <- h.Handle(ctx, delivery("m-"+tt.name)) }()
			select {
			case err := <-done:
				assert.ErrorIs(t, err, middleware.ErrStoreUnavailable, "Handle")
			case <-time.After(15 * time.Second): // waits for the real server's (non-)answer
				t.Errorf("Handle still waiting on its commit 15 s after it was sent, with CommitTimeout %v", opts.CommitTimeout)
			}
		})
	}
}

func TestHandlerPanic(t *testing.T) { inEveryMode(t, testHandlerPanic) }

func testHandlerPanic(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		panic("oops")
	}, opts), middleware.DedupOptions{})
	err := h.Handle(ctx, delivery("m1"))
	var pe *rabbitmw.PanicError
	if !errors.As(err, &pe) || rabbitmw.Decide(err).Outcome != rabbitmw.Delay {
		t.Fatalf("Handle = %v; want a PanicError, retried after a backoff", err)
	}
	assert.Equal(t, 0, f.count(t, "m1"), "effects rolled back")
	assert.Equal(t, store.Claimed, f.status(t, "m1"), "the key, claimed by a stranger afterwards")
	// Counted as a failed attempt.
	if n, err := f.st.Fail(ctx, "m1", time.Minute); err != nil || n != 2 {
		t.Errorf("Fail = %d, %v; want 2 (the panic counted once)", n, err)
	}
}

func TestHandlerSelfSettledTx(t *testing.T) { inEveryMode(t, testHandlerSelfSettledTx) }

func testHandlerSelfSettledTx(t *testing.T, opts pgstore.HandlerOptions) {
	for _, tc := range []struct{ how, path string }{
		{"commit", "claim of Dedup"}, {"rollback", "claim of Dedup"},
		{"commit", "claim in the transaction"}, {"rollback", "claim in the transaction"},
		// Then its connection closes: what the function did decides.
		{"commit, close", "claim of Dedup"}, {"commit, close", "claim in the transaction"},
	} {
		how := tc.how
		t.Run(how+"/"+tc.path, func(t *testing.T) {
			ctx := context.Background()
			f := newInbox(t, newPool(t))
			stack := f.stackUnderClaim
			if tc.path == "claim in the transaction" {
				stack = f.stack
			}
			h := stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				if err := f.insert(ctx, tx, d); err != nil {
					return err
				}
				switch how {
				case "commit":
					return tx.Commit(ctx)
				case "commit, close":
					if err := tx.Commit(ctx); err != nil {
						return err
					}
					return tx.Conn().Close(ctx)
				}
				return tx.Rollback(ctx)
			}, opts), middleware.DedupOptions{})
			err := h.Handle(ctx, delivery("m1"))
			require.ErrorIs(t, err, pgstore.ErrTxSettled)
			require.Equal(t, rabbitmw.DeadLetter, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
			if how != "rollback" && tc.path == "claim in the transaction" && opts.GroupCommit < 2 {
				// The claim committed with the effect. (A member of a
				// group commits nothing itself: it is rolled back to its
				// savepoint.)
				assert.Equal(t, store.Done, f.status(t, "m1"), "key")
				return
			}
			assert.NotEqual(t, store.Done, f.status(t, "m1"), "key is done; want not marked")
		})
	}
}

// A function that returns with the rows of a query unread and unclosed (a
// common slip: a loop that breaks early without rows.Close) leaves the
// connection busy, so that nothing more can be sent on it, the COMMIT
// included. That is the function's failure, counted, with its effect
// rolled back; not an unreachable database, whose errors are not counted
// and tried again for ever.
func TestHandlerRowsLeftOpen(t *testing.T) { inEveryMode(t, testHandlerRowsLeftOpen) }

func testHandlerRowsLeftOpen(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	for _, p := range f.paths() {
		t.Run(p.name, func(t *testing.T) {
			id := strings.ReplaceAll(p.name, " ", "-")
			h := p.stack(pgstore.Handler(f.st, f.leavesRowsOpen, opts), middleware.DedupOptions{})
			err := h.Handle(ctx, delivery(id))
			require.Error(t, err)
			assert.NotErrorIs(t, err, middleware.ErrStoreUnavailable)
			assert.False(t, rabbitmw.IsNotCounted(err), "%v is not counted", err)
			assert.Equal(t, 0, f.count(t, id), "effects")
			assert.NotEqual(t, store.Done, f.status(t, id), "the key is done")
		})
	}
}

func TestHandlerSerializationFailureIsOrdinary(t *testing.T) {
	inEveryMode(t, testHandlerSerializationFailureIsOrdinary)
}

func testHandlerSerializationFailureIsOrdinary(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	for _, code := range []string{"40001", "40P01"} {
		h := f.stack(pgstore.Handler(f.st, func(context.Context, pgx.Tx, *amqp.Delivery) error {
			return &pgconn.PgError{Code: code, Message: "could not serialize access"}
		}, opts), middleware.DedupOptions{})
		err := h.Handle(ctx, delivery("m-"+code))
		if rabbitmw.Decide(err).Outcome != rabbitmw.Delay {
			t.Errorf("SQLSTATE %s: Handle = %v (%v); want tried again after a backoff", code, err, rabbitmw.Decide(err).Outcome)
		}
	}
}

// A read-only transaction cannot hold the done mark: with
// TxOptions.AccessMode ReadOnly, every message's function would succeed,
// its mark fail, and the message be dead-lettered after its attempts. That
// is a programmer's error, found at construction.
func TestHandlerReadOnlyRefused(t *testing.T) {
	f := newInbox(t, newPool(t))
	db := stdlib.OpenDBFromPool(f.pool)
	t.Cleanup(func() { db.Close() })
	sqlFn := func(context.Context, *sql.Tx, *amqp.Delivery) error { return nil }
	for _, m := range handlerModes {
		opts := m.opts
		opts.TxOptions.AccessMode = pgx.ReadOnly
		assert.Panics(t, func() { pgstore.Handler(f.st, f.insert, opts) }, "Handler, %s", m.name)
		assert.Panics(t, func() { pgstore.SQLHandler(f.st, db, sqlFn, opts) }, "SQLHandler, %s", m.name)
		opts.TxOptions.AccessMode = pgx.ReadWrite
		assert.NotPanics(t, func() { pgstore.Handler(f.st, f.insert, opts) }, "Handler, %s, read write", m.name)
		assert.NotPanics(t, func() { pgstore.SQLHandler(f.st, db, sqlFn, opts) }, "SQLHandler, %s, read write", m.name)
	}
}

func TestHandlerWithoutDedup(t *testing.T) {
	f := newInbox(t, newPool(t))
	err := pgstore.Handler(f.st, f.insert, pgstore.HandlerOptions{}).Handle(context.Background(), delivery("m1"))
	require.ErrorIs(t, err, pgstore.ErrNoClaim)
	require.Equal(t, rabbitmw.DeadLetter, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	assert.Equal(t, 0, f.count(t, "m1"), "effects")
}

// Dedup with FailOpen runs the handler without a claim when the store
// cannot be reached: with the PostgreSQL store, the database is down, and
// the handler too reports it unreachable, to be tried again, rather than
// dead-letter every message of the outage as a chain built wrong.
func TestHandlerFailOpenWhileTheDatabaseIsDown(t *testing.T) {
	ctx := context.Background()
	cfg := newPool(t).Config()
	var down atomic.Bool
	dial := cfg.ConnConfig.DialFunc
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if down.Load() {
			return nil, errors.New("the database is down")
		}
		return dial(ctx, network, addr)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	f := newInbox(t, pool)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { db.Close() })
	for _, tt := range []struct {
		name string
		h    rabbitmw.Handler
	}{
		{"Handler", pgstore.Handler(f.st, f.insert, pgstore.HandlerOptions{})},
		{"SQLHandler", pgstore.SQLHandler(f.st, db, func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
			return err
		}, pgstore.HandlerOptions{})},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := f.stack(tt.h, middleware.DedupOptions{FailOpen: true})
			id := "m-" + tt.name
			pool.Reset()
			down.Store(true)
			err := h.Handle(ctx, delivery(id))
			down.Store(false)
			require.ErrorIs(t, err, middleware.ErrStoreUnavailable)
			assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
			require.NoError(t, h.Handle(ctx, delivery(id)), "once the database is back")
			assert.Equal(t, 1, f.count(t, id), "effects")
		})
	}
}

// claimFailsStore is the store, but its claims fail as with a database
// out of reach: the database is up for everything else, as when it comes
// back between a claim of Dedup's that failed and its handler.
type claimFailsStore struct{ store.Store }

func (claimFailsStore) Claim(context.Context, string, string, time.Duration) (store.Status, error) {
	return 0, errors.New("the database is down")
}

// Dedup with FailOpen runs the handler without a claim when its claim
// failed: the handler reports the store unreachable, to be tried again,
// even if the database answers by the time it runs; only a handler
// beneath no Dedup is dead-lettered as a chain built wrong.
func TestHandlerFailOpenDatabaseBackBeforeTheHandler(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	db := stdlib.OpenDBFromPool(f.pool)
	t.Cleanup(func() { db.Close() })
	for _, tt := range []struct {
		name string
		h    rabbitmw.Handler
	}{
		{"Handler", pgstore.Handler(f.st, f.insert, pgstore.HandlerOptions{RetryDelay: 3 * time.Second})},
		{"SQLHandler", pgstore.SQLHandler(f.st, db, func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
			_, err := tx.ExecContext(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
			return err
		}, pgstore.HandlerOptions{RetryDelay: 3 * time.Second})},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h := middleware.Stack(claimFailsStore{f.st}, middleware.StackOptions{Dedup: middleware.DedupOptions{FailOpen: true}})(tt.h)
			id := "m-" + tt.name
			err := h.Handle(ctx, delivery(id))
			require.ErrorIs(t, err, middleware.ErrStoreUnavailable)
			assert.NotErrorIs(t, err, pgstore.ErrNoClaim)
			dec := rabbitmw.Decide(err)
			assert.Equal(t, rabbitmw.Delay, dec.Outcome, "Decide(%v)", err)
			assert.Equal(t, 3*time.Second, dec.Delay, "the handler's RetryDelay")
			assert.True(t, rabbitmw.IsNotCounted(err), "counted: %v", err)
			assert.Equal(t, 0, f.count(t, id), "effects")
		})
	}
}

// countingStore counts Extend and Complete calls.
type countingStore struct {
	store.Store
	extends, completes atomic.Int64
}

func (c *countingStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	c.completes.Add(1)
	return c.Store.Complete(ctx, key, token, retention)
}

func (c *countingStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	err := c.Store.Extend(ctx, key, token, lease)
	if err == nil {
		c.extends.Add(1)
	}
	return err
}

// A transaction much longer than the lease, holding a row lock, on a pool
// of one connection: the lease is renewed on the store's own connections,
// the done mark does not wait for a renewal, and the message is marked
// done once.
func TestHandlerLongTransactionShortLease(t *testing.T) {
	ctx := context.Background()
	base := newPool(t)
	cfg := base.Config()
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close) // after the tables are dropped (cleanups run last first)
	f := newInbox(t, pool)
	counting := &countingStore{Store: f.st}
	// Each renewal has a third of the lease to answer, its first one on a
	// connection it dials: 800 ms, where 300 ms were once too few in a
	// CI run of every package at once under the race detector.
	const lease, hold = 2400 * time.Millisecond, 4 * time.Second
	h := rabbitmw.Chain(
		middleware.Retry(f.st, middleware.RetryOptions{}),
		middleware.Recover(),
		middleware.Dedup(counting, middleware.DedupOptions{Lease: lease}),
	)(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		select { // a long transaction: waits for nothing but time
		case <-time.After(hold):
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	}, pgstore.HandlerOptions{}))
	require.NoError(t, h.Handle(ctx, delivery("m1")), "Handle")
	if n := counting.extends.Load(); n < 2 {
		t.Errorf("%d renewals during a %v transaction with a %v lease; want at least 2", n, hold, lease)
	}
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
	assert.Equal(t, store.Done, f.status(t, "m1"), "the key, claimed by a stranger afterwards")
}

func TestSQLHandler(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	f := newInbox(t, pool)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	insert := func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
		return err
	}
	h := f.stack(pgstore.SQLHandler(f.st, db, insert, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	require.NoError(t, h.Handle(ctx, delivery("m1")), "first delivery")
	require.ErrorIs(t, h.Handle(ctx, delivery("m1")), rabbitmw.ErrDuplicate, "second delivery")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
	selfCommit := pgstore.SQLHandler(f.st, db, func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
		return tx.Commit()
	}, pgstore.HandlerOptions{})
	assert.ErrorIs(t, f.stack(selfCommit, middleware.DedupOptions{}).Handle(ctx, delivery("m2")), pgstore.ErrTxSettled, "self-committed")
	assert.NotEqual(t, store.Done, f.status(t, "m2"), "self-committed key is done; want not marked")
}

// SQLHandler's function that returns with a query's rows unclosed fails,
// counted, its effect rolled back, as Handler's does (see
// TestHandlerRowsLeftOpen).
func TestSQLHandlerRowsLeftOpen(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	db := stdlib.OpenDBFromPool(f.pool)
	t.Cleanup(func() { db.Close() })
	h := f.stack(pgstore.SQLHandler(f.st, db, func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId); err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, `SELECT generate_series(1, 3)`)
		if err != nil {
			return err
		}
		rows.Next() // the first row only: rows stays open
		return nil
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	err := h.Handle(ctx, delivery("m1"))
	require.Error(t, err)
	assert.NotErrorIs(t, err, middleware.ErrStoreUnavailable)
	assert.False(t, rabbitmw.IsNotCounted(err), "%v is not counted", err)
	assert.Equal(t, 0, f.count(t, "m1"), "effects")
	assert.NotEqual(t, store.Done, f.status(t, "m1"), "the key is done")
}

// SQLHandler waits for a connection of its database/sql pool no longer
// than its context lets it: a handler whose pool is exhausted (here its
// one connection held elsewhere) returns with its context's end, a
// shutdown's or the Timeout's, rather than wait for a connection for as
// long as the other holds it.
func TestSQLHandlerWaitsForAConnectionUnderItsContext(t *testing.T) {
	f := newInbox(t, newPool(t))
	db := stdlib.OpenDBFromPool(f.pool)
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	held, err := db.Conn(context.Background())
	require.NoError(t, err)
	released := false
	release := func() {
		if !released {
			released = true
			held.Close()
		}
	}
	defer release()
	h := f.stack(pgstore.SQLHandler(f.st, db, func(ctx context.Context, tx *sql.Tx, d *amqp.Delivery) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO `+f.effects+` (id) VALUES ($1)`, d.MessageId)
		return err
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	result := make(chan error, 1)
	go func() { result <- h.Handle(ctx, delivery("m1")) }()
	select {
	case err := <-result:
		require.Error(t, err)
		assert.ErrorIs(t, err, context.DeadlineExceeded)
	case <-time.After(10 * time.Second):
		release() // lets the handler go on, for the test to end
		t.Errorf("the handler still waits for a connection 10s after its context ended (result once released: %v)", <-result)
	}
	assert.Equal(t, 0, f.count(t, "m1"), "effects")
}

// The recommended stack, with the transactional handler, over many
// concurrent deliveries with duplicates and first attempts that fail:
// every effect once.
func TestStackConcurrentDuplicates(t *testing.T) { inEveryMode(t, testStackConcurrentDuplicates) }

func testStackConcurrentDuplicates(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	var attempts sync.Map
	h := rabbitmw.Chain(
		middleware.Log(nil),
		middleware.Retry(f.st, middleware.RetryOptions{Backoff: func(int) time.Duration { return time.Millisecond }}),
		middleware.Recover(),
		middleware.Dedup(f.st, middleware.DedupOptions{BusyDelay: time.Millisecond}),
		middleware.Timeout(30*time.Second),
	)(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		v, _ := attempts.LoadOrStore(d.MessageId, new(atomic.Int64))
		if v.(*atomic.Int64).Add(1) == 1 && strings.HasSuffix(d.MessageId, "7") {
			return errors.New("first attempt fails")
		}
		return nil
	}, opts))
	const n = 200
	var ids []string
	for i := range n {
		id := fmt.Sprintf("m%03d", i)
		ids = append(ids, id, id) // every message delivered twice, at once
		if i%5 == 0 {
			ids = append(ids, id)
		}
	}
	work := make(chan string, len(ids))
	for _, id := range ids {
		work <- id
	}
	var pending sync.WaitGroup
	pending.Add(len(ids))
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range work {
				switch rabbitmw.Decide(h.Handle(ctx, delivery(id))).Outcome {
				case rabbitmw.Ack, rabbitmw.Duplicate:
					pending.Done()
				case rabbitmw.DeadLetter:
					t.Errorf("%s dead-lettered", id)
					pending.Done()
				default:
					work <- id // tried again
				}
			}
		}()
	}
	pending.Wait()
	close(work)
	wg.Wait()
	var rows, distinct int
	require.NoError(t, f.pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT id) FROM `+f.effects).Scan(&rows, &distinct))
	if rows != distinct || distinct != len(uniq(ids)) {
		t.Errorf("%d effect rows for %d distinct ids; want %d, once each", rows, distinct, len(uniq(ids)))
	}
}

func uniq(ids []string) map[string]bool {
	m := map[string]bool{}
	for _, id := range ids {
		m[id] = true
	}
	return m
}

// An attempt that died over the inbox (its claim abandoned, its
// transaction never committed) is a failed attempt: Retry counts it and
// runs the message again in the same delivery, and the handler commits
// its effect and done mark under the new claim; at MaxAttempts the
// message is dead-lettered without running again.
func TestStackAbandonedAttempt(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	f := newInbox(t, pool)
	table := strings.TrimSuffix(f.effects, "_effects")
	var calls atomic.Int32
	h := rabbitmw.Chain(
		middleware.Retry(f.st, middleware.RetryOptions{MaxAttempts: 2}),
		middleware.Recover(),
		middleware.Dedup(f.st, middleware.DedupOptions{}),
	)(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		calls.Add(1)
		return f.insert(ctx, tx, d)
	}, pgstore.HandlerOptions{}))
	die := func(id string) { // a consumer that claimed id and died
		t.Helper()
		if st, err := f.st.Claim(ctx, id, "dead", time.Minute); err != nil || st != store.Claimed {
			t.Fatalf("Claim(%q) = %v, %v; want claimed", id, st, err)
		}
		age(t, pool, table, id, time.Minute+time.Second)
	}

	die("m1")
	if dec := rabbitmw.Decide(h.Handle(ctx, delivery("m1"))); dec.Outcome != rabbitmw.Ack {
		t.Fatalf("after one death: %v (%v); want acked, run again in the same delivery", dec.Outcome, dec.Err)
	}
	if n, c := f.count(t, "m1"), calls.Load(); n != 1 || c != 1 {
		t.Errorf("after one death: %d effects, %d handler calls; want 1, 1", n, c)
	}
	assert.Equal(t, store.Done, f.status(t, "m1"), "the key, claimed by a stranger afterwards")

	// m2's first death is counted; its second reaches MaxAttempts.
	calls.Store(0)
	_, err := f.st.Fail(ctx, "m2", time.Hour)
	require.NoError(t, err)
	die("m2")
	dec := rabbitmw.Decide(h.Handle(ctx, delivery("m2")))
	if dec.Outcome != rabbitmw.DeadLetter || !errors.Is(dec.Err, middleware.ErrAbandoned) || dec.Attempts != 2 {
		t.Fatalf("after a second death: %v after %d attempts (%v); want dead-lettered after 2, abandoned", dec.Outcome, dec.Attempts, dec.Err)
	}
	if n, c := f.count(t, "m2"), calls.Load(); n != 0 || c != 0 {
		t.Errorf("m2 dead-lettered: %d effects, %d handler calls; want 0, 0", n, c)
	}
}

// Handler sends the done mark and the COMMIT in one round trip, as a
// prepared statement when the pool prepares its statements, else parsed
// each time (a pool behind a pooler in transaction mode sends no named
// statements): in every mode the effect and the mark commit together, and
// a mark that finds the claim lost commits nothing.
func TestHandlerInEveryExecMode(t *testing.T) { inEveryMode(t, testHandlerInEveryExecMode) }

func testHandlerInEveryExecMode(t *testing.T, opts pgstore.HandlerOptions) {
	for _, mode := range execModes {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := context.Background()
			pool := newPoolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode })
			f := newInbox(t, pool)
			fn := func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				if d.MessageId == "lost" {
					c, _ := middleware.ClaimFrom(ctx)
					require.NoError(t, f.st.Release(ctx, c.Key(), c.Token()))
					_, err := f.st.Claim(ctx, c.Key(), "thief", time.Minute)
					require.NoError(t, err)
				}
				return f.insert(ctx, tx, d)
			}
			inTx := f.stack(pgstore.Handler(f.st, fn, opts), middleware.DedupOptions{})
			h := f.stackUnderClaim(pgstore.Handler(f.st, fn, opts), middleware.DedupOptions{})
			// A connection's first claim or mark prepares it; the next ones
			// do not.
			for i := range 6 {
				h := h
				if i%2 == 0 {
					h = inTx
				}
				require.NoError(t, h.Handle(ctx, delivery("m1")), "first delivery")
				require.ErrorIs(t, h.Handle(ctx, delivery("m1")), rabbitmw.ErrDuplicate, "second delivery")
				assert.Equal(t, 1, f.count(t, "m1"))
				assert.Equal(t, store.Done, f.status(t, "m1"))
				_, err := pool.Exec(ctx, `DELETE FROM `+f.effects)
				require.NoError(t, err)
				_, err = pool.Exec(ctx, `TRUNCATE `+strings.TrimSuffix(f.effects, "_effects"))
				require.NoError(t, err)
			}
			err := h.Handle(ctx, delivery("lost"))
			assert.ErrorIs(t, err, middleware.ErrLeaseLost)
			assert.Equal(t, 0, f.count(t, "lost"), "effects of a lost claim")
		})
	}
}

// A tripwire runs a function once, after the next write to any connection
// it wraps: the statement is then on the wire.
type tripwire struct {
	net.Conn
	armed *atomic.Pointer[func()]
}

func (c tripwire) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if f := c.armed.Swap(nil); f != nil {
		(*f)()
	}
	return n, err
}

// A consumer that stops cancels its handlers' context at its shutdown
// deadline, possibly just as fn returns: the done mark and the commit are
// still written, and fn does not run again.
func TestHandlerCancelledAsFnReturns(t *testing.T) { inEveryMode(t, testHandlerCancelledAsFnReturns) }

func testHandlerCancelledAsFnReturns(t *testing.T, opts pgstore.HandlerOptions) {
	for _, tc := range []struct {
		name string
		cut  func(cancel func(), armed *atomic.Pointer[func()])
	}{
		{"before the mark", func(cancel func(), _ *atomic.Pointer[func()]) { cancel() }},
		{"with the mark on the wire", func(cancel func(), armed *atomic.Pointer[func()]) { armed.Store(&cancel) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := newPool(t)
			cfg := base.Config()
			armed := new(atomic.Pointer[func()])
			dial := cfg.ConnConfig.DialFunc
			cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := dial(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				return tripwire{c, armed}, nil
			}
			pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
			require.NoError(t, err)
			t.Cleanup(pool.Close)
			f := newInbox(t, pool)
			var calls atomic.Int32
			var cancel context.CancelFunc
			h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				n := calls.Add(1)
				if err := f.insert(ctx, tx, d); err != nil {
					return err
				}
				if n == 1 {
					tc.cut(cancel, armed)
				}
				return nil
			}, opts), middleware.DedupOptions{})
			for i := range 3 {
				var ctx context.Context
				ctx, cancel = context.WithCancel(context.Background())
				err := h.Handle(ctx, delivery("m1"))
				cancel()
				if o := rabbitmw.Decide(err).Outcome; o != rabbitmw.Delay && o != rabbitmw.Requeue {
					break
				}
				require.Less(t, i, 2, "still in the queue after 3 deliveries: %v", err)
			}
			assert.EqualValues(t, 1, calls.Load(), "fn calls")
			assert.Equal(t, 1, f.count(t, "m1"), "effects")
			assert.Equal(t, store.Done, f.status(t, "m1"))
		})
	}
}

// The done mark that Handler commits lasts for Dedup's Retention, and not
// for as long as the claim's row is remembered (its lease and
// AbandonedRetention): once the retention ends, the key is absent.
func TestHandlerMarkRetention(t *testing.T) { inEveryMode(t, testHandlerMarkRetention) }

func testHandlerMarkRetention(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	const retention = 200 * time.Millisecond
	h := f.stack(pgstore.Handler(f.st, f.insert, opts), middleware.DedupOptions{Retention: retention})
	require.NoError(t, h.Handle(ctx, delivery("m1")))
	got, err := f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Equal(t, store.Done, got.Status)
	assert.LessOrEqual(t, got.TTL, retention, "the done mark's TTL")
	time.Sleep(2 * retention) // waits for the database's clock
	got, err = f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Equal(t, store.KeyState{}.Status, got.Status, "Inspect after the retention: want absent")
	assert.Equal(t, store.Claimed, f.status(t, "m1"), "a claim after the retention")
}

// handlerModes are the ways Handler may commit: each delivery in a
// transaction of its own, or in groups.
var handlerModes = []struct {
	name string
	opts pgstore.HandlerOptions
}{
	{"own transaction", pgstore.HandlerOptions{}},
	{"group commit", pgstore.HandlerOptions{GroupCommit: 8}},
}

// inEveryMode runs test in each of handlerModes.
func inEveryMode(t *testing.T, test func(*testing.T, pgstore.HandlerOptions)) {
	for _, m := range handlerModes {
		t.Run(m.name, func(t *testing.T) { test(t, m.opts) })
	}
}

// A key too long for the claims table's index (made by a Keying that
// names messages by something long) is the message's fault, not the
// database's: the message is dead-lettered with that reason, on either
// path, rather than retried as "store unavailable" forever. Nothing is
// written for it, and the handler does not run.
func TestStackKeyTooLongForTheIndex(t *testing.T) { inEveryMode(t, testStackKeyTooLongForTheIndex) }

func testStackKeyTooLongForTheIndex(t *testing.T, opts pgstore.HandlerOptions) {
	f := newInbox(t, newPool(t))
	// Random bytes, in hex: the server cannot compress them to fit.
	raw := make([]byte, 1500)
	_, err := rand.Read(raw)
	require.NoError(t, err)
	long := hex.EncodeToString(raw)
	keying := middleware.Keying{Key: func(d *amqp.Delivery) (string, error) { return long + d.MessageId, nil }}
	for _, redelivered := range []bool{false, true} {
		t.Run(fmt.Sprintf("redelivered=%v", redelivered), func(t *testing.T) {
			var ran atomic.Int32
			h := middleware.Stack(f.st, middleware.StackOptions{Keying: keying})(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				ran.Add(1)
				return f.insert(ctx, tx, d)
			}, opts))
			d := delivery(fmt.Sprint("long-", redelivered))
			d.Redelivered = redelivered
			err := h.Handle(context.Background(), d)
			require.Error(t, err)
			dec := rabbitmw.Decide(err)
			assert.Equal(t, rabbitmw.DeadLetter, dec.Outcome, "settlement of %v", err)
			assert.NotErrorIs(t, err, middleware.ErrStoreUnavailable)
			assert.ErrorIs(t, err, store.ErrKeyRejected)
			assert.Equal(t, "key_rejected", rabbitmw.ErrorType(err))
			assert.Contains(t, err.Error(), fmt.Sprintf("(%d bytes)", len(long+d.MessageId)))
			assert.Less(t, len(err.Error()), 600, "the reason quotes the key, not all of it: %v", err)
			assert.Zero(t, ran.Load(), "the handler ran")
			assert.Zero(t, f.count(t, d.MessageId))
		})
	}
}
