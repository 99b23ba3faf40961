package pgstore_test

import (
	"context"
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
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// A delivery never delivered before is claimed in the transaction of its
// effect: one transaction writes the key's row, once, as a done mark, and
// the effect. Under Dedup's claim, the row would be written by the claim's
// transaction, then rewritten by the done mark (a second version).
// The transaction keeps the session's lock_timeout for fn's statements.
func TestHandlerClaimsInItsTransaction(t *testing.T) {
	inEveryMode(t, testHandlerClaimsInItsTransaction)
}

func testHandlerClaimsInItsTransaction(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	pool := newPoolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.RuntimeParams["lock_timeout"] = "7s" })
	f := newInbox(t, pool)
	var lockTimeout string
	var claimed bool
	h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, claimed = middleware.ClaimFrom(ctx)
		if err := tx.QueryRow(ctx, `SELECT current_setting('lock_timeout')`).Scan(&lockTimeout); err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	}, opts), middleware.DedupOptions{})
	require.NoError(t, h.Handle(ctx, delivery("m1")))
	assert.False(t, claimed, "fn ran under a claim of Dedup's")
	assert.Equal(t, "7s", lockTimeout, "lock_timeout in fn's transaction")

	var sameTx, firstVersion, done bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT c.xmin::text = e.xmin::text, c.ctid = '(0,1)'::tid, c.token IS NULL
FROM `+strings.TrimSuffix(f.effects, "_effects")+` c, `+f.effects+` e WHERE c.key = 'm1' AND e.id = 'm1'`).Scan(&sameTx, &firstVersion, &done))
	assert.True(t, sameTx, "the key's row and the effect were written by different transactions")
	assert.True(t, firstVersion, "the key's row was written more than once")
	assert.True(t, done, "the key's row is no done mark")

	require.ErrorIs(t, h.Handle(ctx, delivery("m1")), rabbitmw.ErrDuplicate, "second delivery")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// A consumer that dies before the commit leaves nothing: no effect, no
// row. The redelivery is claimed by Dedup, its row committed before fn
// runs, and the attempt that left nothing is counted as a failed one, so
// that a message that kills its consumers is dead-lettered after as many
// deaths as it has attempts.
func TestHandlerClaimInTxCrashLeavesNothing(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxCrashLeavesNothing)
}

func testHandlerClaimInTxCrashLeavesNothing(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	pool := newPool(t)
	f := newInbox(t, pool)
	fn := func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		if !d.Redelivered {
			// The consumer dies: its connection goes, and the server
			// rolls the transaction back.
			var pid int
			require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
			_, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
			require.NoError(t, err)
			return errors.New("dead")
		}
		c, ok := middleware.ClaimFrom(ctx)
		require.True(t, ok, "the redelivery runs without a claim of Dedup's")
		got, err := f.st.Inspect(ctx, c.Key())
		require.NoError(t, err)
		assert.Equal(t, int64(1), got.Failures, "failures counted before the redelivery ran")
		return nil
	}
	h := pgstore.Handler(f.st, fn, opts)
	// Dedup, without the Retry that would count fn's error: the consumer
	// is dead, and nothing records its attempt.
	ran, _ := h.(middleware.ClaimingHandler).HandleClaiming(ctx, delivery("m1"), f.st, "m1", time.Minute, time.Hour)
	require.True(t, ran, "the handler did not claim in its transaction")
	got, err := f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Equal(t, store.Status(0), got.Status, "the key's state after the crash: %s", got.State())
	assert.Zero(t, got.Failures, "failures after the crash")
	assert.Equal(t, 0, f.count(t, "m1"), "effects after the crash")

	d := delivery("m1")
	d.Redelivered = true
	require.NoError(t, f.stack(h, middleware.DedupOptions{}).Handle(ctx, d), "the redelivery")
	got, err = f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Equal(t, store.Done, got.Status, "the key after the redelivery")
	assert.Zero(t, got.Failures, "failures after the redelivery succeeded")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// A redelivery that finds the key's row counts nothing more: the claim
// that was abandoned is counted by Retry, once, and Retry's retry of it,
// in the same delivery, finds the row that Dedup's store left.
func TestHandlerRedeliveryOfAnAbandonedClaimCountsOnce(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	st, err := f.st.Claim(ctx, "m1", "dead consumer", time.Millisecond)
	require.NoError(t, err)
	require.Equal(t, store.Claimed, st)
	time.Sleep(20 * time.Millisecond) // the lease ends on the server's clock
	var failures int64 = -1
	h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		got, err := f.st.Inspect(ctx, "m1")
		if err != nil {
			return err
		}
		failures = got.Failures
		return f.insert(ctx, tx, d)
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	d := delivery("m1")
	d.Redelivered = true
	require.NoError(t, h.Handle(ctx, d))
	assert.Equal(t, int64(1), failures, "failures counted when fn ran: the abandoned attempt")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// Two copies of a message at once (a publisher's duplicate): the second's
// claim waits for the first's uncommitted row, a second at most, and is
// answered busy; so is the store's claim of the key, and the claims sent
// with it in one statement are not held up. Once the first commits, the
// second is a duplicate.
func TestHandlerClaimInTxHeldByAnother(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	f := newInbox(t, pool)
	release, running := make(chan struct{}), make(chan struct{})
	var once sync.Once
	h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		once.Do(func() {
			close(running)
			select {
			case <-release:
			case <-time.After(20 * time.Second):
			}
		})
		return nil
	}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
	first := make(chan error, 1)
	go func() { first <- h.Handle(ctx, delivery("m1")) }()
	<-running

	start := time.Now()
	err := h.Handle(ctx, delivery("m1"))
	require.ErrorIs(t, err, middleware.ErrBusy, "the second copy")
	assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	assert.Less(t, time.Since(start), 5*time.Second, "the second copy's wait")

	// Claims of the store, the held key among others, sent at once: they
	// go in statements of several keys.
	start = time.Now()
	var wg sync.WaitGroup
	statuses := make([]store.Status, 12)
	errs := make([]error, len(statuses))
	for i := range statuses {
		key := fmt.Sprintf("other-%d", i)
		if i == 5 {
			key = "m1"
		}
		wg.Go(func() { statuses[i], errs[i] = f.st.Claim(ctx, key, "another", time.Minute) })
	}
	wg.Wait()
	assert.Less(t, time.Since(start), 8*time.Second, "the claims' time, with the key held for 20 s")
	for i, st := range statuses {
		require.NoError(t, errs[i], "claim %d", i)
		want := store.Claimed
		if i == 5 {
			want = store.Processing
		}
		assert.Equal(t, want, st, "claim %d", i)
	}

	close(release)
	require.NoError(t, <-first, "the first copy")
	require.ErrorIs(t, h.Handle(ctx, delivery("m1")), rabbitmw.ErrDuplicate, "the second copy again")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// A redelivered copy of a message (its consumer's channel closed) that
// arrives while the first copy's transaction holds the key's row,
// uncommitted, answers busy and counts no failure: the first attempt
// runs, it has not failed. Counted, it would be counted again by Retry if
// it failed, and the message dead-lettered an attempt early.
func TestHandlerRedeliveryWhileHeldCountsNothing(t *testing.T) {
	inEveryMode(t, testHandlerRedeliveryWhileHeldCountsNothing)
}

func testHandlerRedeliveryWhileHeldCountsNothing(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	release, running := make(chan struct{}), make(chan struct{})
	h := middleware.Dedup(f.st, middleware.DedupOptions{})(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		if !d.Redelivered {
			close(running)
			<-release
		}
		return nil
	}, opts))
	first := make(chan error, 1)
	go func() { first <- h.Handle(ctx, delivery("m1")) }()
	<-running

	d := delivery("m1")
	d.Redelivered = true
	err := h.Handle(ctx, d)
	got, ierr := f.st.Inspect(ctx, "m1")
	close(release)
	require.ErrorIs(t, err, middleware.ErrBusy, "the redelivered copy")
	require.NoError(t, ierr)
	assert.Zero(t, got.Failures, "failures counted for the attempt that runs")
	require.NoError(t, <-first, "the first copy")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// The row that sends a key's next delivery to Dedup's claim, written
// after a claim in the transaction ended, waits a second at most for a
// row of the key that another transaction holds (the claim's own, whose
// statement the server may still run after the consumer's side of its
// connection closed), not for as long as that transaction lasts.
func TestForgottenRowWaitsALockWaitAtMost(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	st := newStore(t, pool, pgstore.Options{Table: table})
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { holder.Rollback(context.Background()) })
	_, err = holder.Exec(ctx, `INSERT INTO `+table+` (key, token, lease_until, forget_at) VALUES ($1, NULL, now(), now())`, []byte("m1"))
	require.NoError(t, err)

	fctx, cancel := context.WithTimeout(ctx, 5*time.Second) // else, before the bound, it waits for the holder
	defer cancel()
	start := time.Now()
	err = pgstore.Forget(fctx, st, "m1", time.Hour)
	took := time.Since(start)
	var pe *pgconn.PgError
	require.ErrorAs(t, err, &pe, "the row is held: the statement gives up")
	assert.Equal(t, "55P03", pe.Code, "lock_not_available")
	assert.Less(t, took, 3*time.Second, "the wait for the held row")
}

// The deadline of the stack's Timeout ends the transaction claimed in it:
// the timeout is a failed attempt, and leaves nothing.
func TestHandlerClaimInTxTimeout(t *testing.T) { inEveryMode(t, testHandlerClaimInTxTimeout) }

func testHandlerClaimInTxTimeout(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	h := middleware.Stack(f.st, middleware.StackOptions{Timeout: 200 * time.Millisecond})(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `SELECT pg_sleep(10)`)
		return err
	}, opts))
	err := h.Handle(ctx, delivery("m1"))
	require.ErrorIs(t, err, middleware.ErrTimeout)
	assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
	got, err := f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Equal(t, store.Status(0), got.Status, "the key's state: %s", got.State())
	assert.Equal(t, int64(1), got.Failures, "failures")
	assert.Equal(t, 0, f.count(t, "m1"), "effects")
}

// acquireFailed is a tracer of a pool that calls its func once, the first
// time an Acquire of that pool fails, once armed.
type acquireFailed struct {
	pool  atomic.Pointer[pgxpool.Pool]
	once  sync.Once
	after func()
}

func (*acquireFailed) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	return ctx
}
func (*acquireFailed) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (*acquireFailed) TraceAcquireStart(ctx context.Context, _ *pgxpool.Pool, _ pgxpool.TraceAcquireStartData) context.Context {
	return ctx
}

func (a *acquireFailed) TraceAcquireEnd(_ context.Context, pool *pgxpool.Pool, data pgxpool.TraceAcquireEndData) {
	if data.Err != nil && pool == a.pool.Load() {
		a.once.Do(a.after)
	}
}

// A delivery whose Timeout deadline passes while its claim in the
// transaction waits for a connection of an exhausted pool ends there,
// not counted (the wait was the consumer's congestion): it does not go
// on to Dedup's claim, whose handler would start with a new deadline,
// running for longer than the Timeout allows. Here the pool's one
// connection is held elsewhere until the wait gives up.
func TestHandlerClaimInTxDeadlineWhileWaitingForAConnection(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxDeadlineWhileWaitingForAConnection)
}

func testHandlerClaimInTxDeadlineWhileWaitingForAConnection(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	tracer := new(acquireFailed)
	f := newInbox(t, newPoolWith(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 1
		cfg.ConnConfig.Tracer = tracer
	}))
	held, err := f.pool.Acquire(ctx)
	require.NoError(t, err)
	var release sync.Once
	tracer.after = func() { release.Do(held.Release) }
	defer tracer.after()
	tracer.pool.Store(f.pool)
	const timeout = 300 * time.Millisecond
	opts.RetryDelay = 3 * time.Second
	var ran atomic.Int32
	h := middleware.Stack(f.st, middleware.StackOptions{Timeout: timeout})(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		ran.Add(1)
		return f.insert(ctx, tx, d)
	}, opts))
	result := make(chan error, 1)
	go func() { result <- h.Handle(ctx, delivery("m1")) }()
	select {
	case err = <-result:
	case <-time.After(10 * time.Second):
		tracer.after()
		t.Fatalf("the handler still runs 10 s after its deadline (result once the connection is free: %v)", <-result)
	}
	require.Error(t, err, "a delivery whose deadline passed before its function could run")
	assert.ErrorIs(t, err, middleware.ErrTimeout)
	assert.True(t, rabbitmw.IsNotCounted(err), "counted: %v", err)
	dec := rabbitmw.Decide(err)
	assert.Equal(t, rabbitmw.Delay, dec.Outcome, "Decide(%v)", err)
	assert.Equal(t, 3*time.Second, dec.Delay, "the handler's RetryDelay")
	assert.Zero(t, ran.Load(), "function calls")
	assert.Equal(t, 0, f.count(t, "m1"), "effects")
	got, err := f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Equal(t, store.Status(0), got.Status, "the key's state: %s", got.State())
	assert.Zero(t, got.Failures, "failures")
}

// Claims made in the transaction count towards Options.PruneEvery, as the
// store's do: forgotten rows are deleted.
func TestHandlerClaimInTxPrunes(t *testing.T) { inEveryMode(t, testHandlerClaimInTxPrunes) }

func testHandlerClaimInTxPrunes(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	st := newStore(t, pool, pgstore.Options{Table: table, PruneEvery: 2})
	_, err := pool.Exec(ctx, `INSERT INTO `+table+` (key, token, lease_until, forget_at) VALUES ('old', NULL, '-infinity', '-infinity')`)
	require.NoError(t, err)
	h := middleware.Stack(st, middleware.StackOptions{})(pgstore.Handler(st, func(context.Context, pgx.Tx, *amqp.Delivery) error { return nil }, opts))
	for i := range 2 {
		require.NoError(t, h.Handle(ctx, delivery(fmt.Sprint("m", i))))
	}
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE key = 'old'`).Scan(&n))
	assert.Zero(t, n, "forgotten rows left after PruneEvery claims in the transaction")
}

// A claim made in the transaction lasts while its consumer makes
// progress: a transaction left idle for longer than the lease (a stalled
// consumer, or a function that waits that long between two statements)
// is ended by the server, its claim lost and nothing committed, so that
// another consumer can take the message. The next delivery is claimed by
// Dedup, whose lease is renewed while the function waits. So it is if
// the function drops the error of its statement that found the
// transaction ended, returning nil or an error of its own that does not
// wrap the driver's: else the next delivery would be claimed in its
// transaction again, idle past the lease again, every time, never
// counted.
func TestHandlerClaimInTxEndsWithTheLease(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxEndsWithTheLease)
}

func testHandlerClaimInTxEndsWithTheLease(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	const lease, wait = 300 * time.Millisecond, time.Second
	for _, c := range []struct {
		name string
		// result is what the function returns after the statement that
		// failed with err.
		result func(err error) error
		// leaseLost: the first delivery's error says the claim was lost;
		// else it is the function's own.
		leaseLost bool
	}{
		{"returns the error", func(err error) error { return err }, true},
		{"drops the error", func(error) error { return nil }, true},
		{"returns its own error", func(err error) error {
			if err != nil {
				return errors.New("the insert failed")
			}
			return nil
		}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			id := strings.ReplaceAll(c.name, " ", "-")
			var underClaim []bool
			h := rabbitmw.Chain(
				middleware.Retry(f.st, middleware.RetryOptions{}),
				middleware.Recover(),
				middleware.Dedup(f.st, middleware.DedupOptions{Lease: lease}),
			)(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				_, ok := middleware.ClaimFrom(ctx)
				underClaim = append(underClaim, ok)
				if ok {
					// Under Dedup's claim it returns at once: a renewal
					// late on a busy machine would end that lease.
					return f.insert(ctx, tx, d)
				}
				// Claimed in its transaction: idle in it past the lease,
				// ignoring ctx.
				time.Sleep(wait)
				return c.result(f.insert(context.WithoutCancel(ctx), tx, d))
			}, opts))
			err := h.Handle(ctx, delivery(id))
			require.Error(t, err, "the first delivery")
			if c.leaseLost {
				assert.ErrorIs(t, err, middleware.ErrLeaseLost, "the first delivery")
			}
			assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(err).Outcome, "Decide(%v)", err)
			assert.Equal(t, 0, f.count(t, id), "effects after the claim ended")
			got, ierr := f.st.Inspect(ctx, id)
			require.NoError(t, ierr)
			assert.Zero(t, got.Failures, "failures counted for an ended claim")
			require.NoError(t, h.Handle(ctx, delivery(id)), "the next delivery")
			assert.Equal(t, []bool{false, true}, underClaim, "the deliveries ran under a claim of Dedup's")
			assert.Equal(t, 1, f.count(t, id), "effects")
			assert.Equal(t, store.Done, f.status(t, id))
		})
	}
}

// The row that sends the next delivery to Dedup's claim, after a claim in
// the transaction ended with its lease, outlasts the prunes that other
// claims run meanwhile: else the next delivery, a copy of the message
// that is not marked redelivered (a delay queue's), is claimed in its
// transaction again, idles past the lease again, and the message never
// succeeds (nor is it counted: a lost lease is not its failure).
func TestHandlerClaimInTxEndedSurvivesPrune(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxEndedSurvivesPrune)
}

func testHandlerClaimInTxEndedSurvivesPrune(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	const lease, wait = 300 * time.Millisecond, time.Second
	var underClaim []bool
	h := middleware.Dedup(f.st, middleware.DedupOptions{Lease: lease})(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, ok := middleware.ClaimFrom(ctx)
		underClaim = append(underClaim, ok)
		if !ok {
			// Claimed in its transaction: idle in it past the lease,
			// ignoring ctx. (Under Dedup's claim it returns at once:
			// a renewal late on a busy machine would end that lease.)
			time.Sleep(wait)
		}
		return f.insert(context.WithoutCancel(ctx), tx, d)
	}, opts))
	require.ErrorIs(t, h.Handle(ctx, delivery("m1")), middleware.ErrLeaseLost, "the first delivery")
	// The claims of other messages prune forgotten rows, every
	// PruneEvery-th of them.
	_, err := f.st.Prune(ctx, 1000)
	require.NoError(t, err)
	require.NoError(t, h.Handle(ctx, delivery("m1")), "the next delivery")
	assert.Equal(t, []bool{false, true}, underClaim, "the deliveries ran under a claim of Dedup's")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// The done mark of a delivery claimed in its transaction lasts for Dedup's
// Retention after the success, as on the path of Dedup's claim, however
// long the function ran: a copy that arrives within the retention after
// the commit is a duplicate, not run again.
func TestHandlerClaimInTxRetentionFromSuccess(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxRetentionFromSuccess)
}

func testHandlerClaimInTxRetentionFromSuccess(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	const retention = time.Second
	for _, p := range f.paths() {
		t.Run(p.name, func(t *testing.T) {
			id := strings.ReplaceAll(p.name, " ", "-")
			h := p.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				if err := f.insert(ctx, tx, d); err != nil {
					return err
				}
				// Longer than the retention, and busy: the transaction is
				// not idle.
				_, err := tx.Exec(ctx, `SELECT pg_sleep(1.3)`)
				return err
			}, opts), middleware.DedupOptions{Retention: retention})
			require.NoError(t, h.Handle(ctx, delivery(id)), "first delivery")
			start := time.Now()
			err := h.Handle(ctx, delivery(id))
			took := time.Since(start)
			require.ErrorIs(t, err, rabbitmw.ErrDuplicate, "a copy delivered just after the success")
			assert.Equal(t, 1, f.count(t, id), "effects")
			assert.Less(t, took, retention/2, "the copy was not handled soon after the success")
		})
	}
}

// A connection that breaks while the function runs, because the database
// went away (its address now black-holed, as in a network partition or
// a server that hangs as it stops), is not the message's failure: the
// delivery answers at once that the store is unavailable, not counted.
// It does not first spend CommitTimeout on writing a forgotten row to the
// database that is gone (the row is for a session that the server ended,
// idle for the lease, which this one was not), and so it does not pass
// its deadline meanwhile and get counted as a handler that timed out.
func TestHandlerClaimInTxConnectionLostInAnOutage(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxConnectionLostInAnOutage)
}

func testHandlerClaimInTxConnectionLostInAnOutage(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	var down atomic.Bool
	pool := newPoolWith(t, func(cfg *pgxpool.Config) {
		dial := cfg.ConnConfig.DialFunc
		cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
			if down.Load() {
				<-ctx.Done() // black-holed: no answer, not even a refusal
				return nil, ctx.Err()
			}
			return dial(ctx, network, addr)
		}
	})
	admin := newPool(t)
	f := newInbox(t, pool)
	var broke atomic.Bool
	fn := func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil || broke.Swap(true) {
			return err
		}
		down.Store(true)
		return endSession(t, ctx, admin, tx)
	}
	opts.CommitTimeout = 3 * time.Second
	h := middleware.Stack(f.st, middleware.StackOptions{Timeout: time.Second})(pgstore.Handler(f.st, fn, opts))
	start := time.Now()
	err := h.Handle(ctx, delivery("m1"))
	took := time.Since(start)
	down.Store(false)
	require.ErrorIs(t, err, middleware.ErrStoreUnavailable)
	assert.NotErrorIs(t, err, middleware.ErrTimeout)
	assert.True(t, rabbitmw.IsNotCounted(err), "%v is counted", err)
	assert.Less(t, took, opts.CommitTimeout, "the delivery waited on the database that had gone")
	got, err := f.st.Inspect(ctx, "m1")
	require.NoError(t, err)
	assert.Zero(t, got.Failures, "failures counted for the outage")
	assert.Equal(t, 0, f.count(t, "m1"), "effects of the broken transaction")
	require.NoError(t, h.Handle(ctx, delivery("m1")), "once the database is back")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// endSession ends the session of tx through admin, as an administrator's
// pg_terminate_backend does, once it has gone, and returns the error of
// tx's next statement, which finds it ended.
func endSession(t *testing.T, ctx context.Context, admin *pgxpool.Pool, tx pgx.Tx) error {
	t.Helper()
	var pid int
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	_, err := admin.Exec(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT 1`)
	require.Error(t, err, "a statement on the ended session")
	return err
}

// A lease longer than idle_in_transaction_session_timeout can hold (2^31-1
// ms, about 24.8 days) still lets a delivery claim in its transaction,
// whose session the server then ends after that long idle at most: the
// claim ends no later than its lease, and nothing of its transaction can
// commit once it has. Before, the claim's set_config failed on every
// delivery, which went to Dedup's claim after a wasted round trip, and
// nothing said why.
func TestHandlerClaimInTxLeaseBeyondTheIdleTimeout(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxLeaseBeyondTheIdleTimeout)
}

func testHandlerClaimInTxLeaseBeyondTheIdleTimeout(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	var idle string
	claimed := true
	lease := 30 * 24 * time.Hour
	h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, claimed = middleware.ClaimFrom(ctx)
		if err := tx.QueryRow(ctx, `SELECT current_setting('idle_in_transaction_session_timeout')`).Scan(&idle); err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	}, opts), middleware.DedupOptions{Lease: lease, Retention: 2 * lease})
	require.NoError(t, h.Handle(ctx, delivery("m1")))
	assert.False(t, claimed, "fn ran under a claim of Dedup's: the claim in its transaction failed")
	assert.Equal(t, "2147483647ms", idle, "idle_in_transaction_session_timeout in fn's transaction")
	assert.Equal(t, store.Done, f.status(t, "m1"), "key")
	assert.Equal(t, 1, f.count(t, "m1"), "effects")
}

// A connection that an administrator's pg_terminate_backend (or a crash,
// or a broken network) ends less than a lease after the claim is the
// store's failure, whatever the function then returns: the delivery
// answers that the store is unavailable, not counted, and no lost lease
// is reported, since no lease passed; the next delivery is claimed in
// its transaction again. Before, a function that dropped the error of
// the statement that found the session ended (returning nil) was told
// that its claim ended with the lease, the server having ended the
// transaction left idle that long: a lease_lost in the outage, and an
// error that sent the reader to look for an idle function.
func TestHandlerClaimInTxSessionEndedWithinTheLease(t *testing.T) {
	inEveryMode(t, testHandlerClaimInTxSessionEndedWithinTheLease)
}

func testHandlerClaimInTxSessionEndedWithinTheLease(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	admin := newPool(t)
	f := newInbox(t, newPool(t))
	for _, c := range []struct {
		name string
		// result is what the function returns after the statement that
		// failed with err, on the session that was ended.
		result func(err error) error
	}{
		{"returns the error", func(err error) error { return err }},
		{"drops the error", func(error) error { return nil }},
	} {
		t.Run(c.name, func(t *testing.T) {
			id := strings.ReplaceAll(c.name, " ", "-")
			var mu sync.Mutex
			var events []middleware.DedupEventKind
			dedup := middleware.DedupOptions{Observe: func(_ context.Context, e middleware.DedupEvent) {
				mu.Lock()
				defer mu.Unlock()
				events = append(events, e.Kind)
			}}
			var underClaim []bool
			h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				_, ok := middleware.ClaimFrom(ctx)
				underClaim = append(underClaim, ok)
				if err := f.insert(ctx, tx, d); err != nil || len(underClaim) > 1 {
					return err
				}
				return c.result(endSession(t, ctx, admin, tx))
			}, opts), dedup)
			err := h.Handle(ctx, delivery(id))
			require.ErrorIs(t, err, middleware.ErrStoreUnavailable, "the first delivery")
			assert.NotErrorIs(t, err, middleware.ErrLeaseLost, "the first delivery")
			assert.True(t, rabbitmw.IsNotCounted(err), "%v is counted", err)
			mu.Lock()
			assert.NotContains(t, events, middleware.DedupLeaseLost, "events of the first delivery")
			mu.Unlock()
			assert.Equal(t, 0, f.count(t, id), "effects of the ended transaction")
			require.NoError(t, h.Handle(ctx, delivery(id)), "the next delivery")
			assert.Equal(t, []bool{false, false}, underClaim, "the deliveries ran under a claim of Dedup's")
			assert.Equal(t, 1, f.count(t, id), "effects")
		})
	}
}

// A function that bounds a statement with a deadline of its own (a
// context.WithTimeout around one query) fails its attempt when that
// deadline passes: pgx closes the connection to cancel the statement, and
// that closed connection is the function's doing, not the database's.
// The attempt is counted, on either path, so that a message whose query
// always overruns is dead-lettered after its attempts rather than tried
// again for ever as if the store were unavailable.
func TestHandlerFunctionsOwnDeadlineIsCounted(t *testing.T) {
	inEveryMode(t, testHandlerFunctionsOwnDeadlineIsCounted)
}

func testHandlerFunctionsOwnDeadlineIsCounted(t *testing.T, opts pgstore.HandlerOptions) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	fn := func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		qctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		if _, err := tx.Exec(qctx, `SELECT pg_sleep(2)`); err != nil {
			return fmt.Errorf("the report query: %w", err)
		}
		return nil
	}
	for _, p := range f.paths() {
		t.Run(p.name, func(t *testing.T) {
			id := strings.ReplaceAll(p.name, " ", "-")
			h := p.stack(pgstore.Handler(f.st, fn, opts), middleware.DedupOptions{})
			err := h.Handle(ctx, delivery(id))
			require.ErrorIs(t, err, context.DeadlineExceeded)
			assert.NotErrorIs(t, err, middleware.ErrStoreUnavailable)
			assert.False(t, rabbitmw.IsNotCounted(err), "%v is not counted", err)
			got, err := f.st.Inspect(ctx, id)
			require.NoError(t, err)
			assert.Equal(t, int64(1), got.Failures, "failures")
			assert.Equal(t, 0, f.count(t, id), "effects")
		})
	}
}
