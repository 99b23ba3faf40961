package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
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

// A groupFixture is an inbox whose Handler commits in groups, and whose
// function does, for each message, what the test set for its id (by
// default, the effect). Its pool has 4 connections, so that one group at
// a time is open: deliveries that arrive while a member runs queue in its
// group.
type groupFixture struct {
	*inboxFixture
	inner rabbitmw.Handler // the Handler
	h     rabbitmw.Handler // the recommended stack around it

	mu    sync.Mutex
	do    map[string]func(context.Context, pgx.Tx, *amqp.Delivery) error
	txids map[string]int64 // the transaction in which each id's function ran
	calls map[string]int
}

func newGroupFixture(t *testing.T, maxConns int32, opts pgstore.HandlerOptions, stack middleware.StackOptions) *groupFixture {
	t.Helper()
	pool := newPoolWith(t, func(cfg *pgxpool.Config) { cfg.MaxConns = maxConns })
	f := &groupFixture{
		inboxFixture: newInbox(t, pool),
		do:           map[string]func(context.Context, pgx.Tx, *amqp.Delivery) error{},
		txids:        map[string]int64{},
		calls:        map[string]int{},
	}
	if opts.GroupCommit == 0 {
		opts.GroupCommit = 32
	}
	f.inner = pgstore.Handler(f.st, f.fn, opts)
	f.h = middleware.Stack(f.st, stack)(f.inner)
	return f
}

func (f *groupFixture) set(id string, do func(context.Context, pgx.Tx, *amqp.Delivery) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.do[id] = do
}

func (f *groupFixture) fn(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
	var txid int64
	if err := tx.QueryRow(ctx, `SELECT txid_current()`).Scan(&txid); err != nil {
		return err
	}
	f.mu.Lock()
	do := f.do[d.MessageId]
	f.txids[d.MessageId] = txid
	f.calls[d.MessageId]++
	f.mu.Unlock()
	if do == nil {
		return f.insert(ctx, tx, d)
	}
	return do(ctx, tx, d)
}

// table is the store's table of claims.
func (f *groupFixture) table() string { return strings.TrimSuffix(f.effects, "_effects") }

// ran returns the transaction in which id's function ran last, and how
// many times it ran.
func (f *groupFixture) ran(id string) (txid int64, calls int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.txids[id], f.calls[id]
}

func (f *groupFixture) txid(id string) int64 {
	txid, _ := f.ran(id)
	return txid
}

// A gate holds the first member of a group until the others are queued.
type gate struct{ held, release chan struct{} }

func newGate() *gate { return &gate{held: make(chan struct{}), release: make(chan struct{})} }

// hold, in a member's function, tells the test that the member holds its
// group's connection, and waits for the release.
func (g *gate) hold(ctx context.Context) error {
	close(g.held)
	select {
	case <-g.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// group handles ds through f.h, each under its context ctxs[i] (or a
// background one), so that they form one group in their order: ds[0],
// whose function must hold gate g, runs first; each of the others is
// started once the one before it is queued; then g is released. It
// returns each delivery's result.
func (f *groupFixture) group(t *testing.T, g *gate, ctxs []context.Context, ds ...*amqp.Delivery) []error {
	t.Helper()
	results := make([]chan error, len(ds))
	for i, d := range ds {
		ctx := context.Background()
		if i < len(ctxs) && ctxs[i] != nil {
			ctx = ctxs[i]
		}
		results[i] = make(chan error, 1)
		go func() { results[i] <- f.h.Handle(ctx, d) }()
		if i == 0 {
			<-g.held
			continue
		}
		require.Eventually(t, func() bool { return pgstore.GroupQueued(f.inner) == i }, 10*time.Second, time.Millisecond, "%s queued", d.MessageId)
	}
	close(g.release)
	errs := make([]error, len(ds))
	for i := range ds {
		select {
		case errs[i] = <-results[i]:
		case <-time.After(30 * time.Second):
			t.Fatalf("%s still running after 30 s", ds[i].MessageId)
		}
	}
	return errs
}

// The deliveries that arrive while a member of a group runs join it: they
// commit in one transaction, each effect once, each key done, and each
// handler returns only after that commit. A Close of the Store while the
// group runs does not concern it.
func TestGroupCommitMembersShareOneTransaction(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	g := newGate()
	f.set("m0", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		f.st.Close()
		if err := g.hold(ctx); err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	})
	ids := []string{"m0", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "m9"}
	var ds []*amqp.Delivery
	for _, id := range ids {
		ds = append(ds, delivery(id))
	}
	for i, err := range f.group(t, g, nil, ds...) {
		require.NoError(t, err, ids[i])
	}
	for _, id := range ids {
		assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
		assert.Equal(t, f.txid("m0"), f.txid(id), "the transaction of %s", id)
		require.ErrorIs(t, f.h.Handle(ctx, delivery(id)), rabbitmw.ErrDuplicate, "a copy of %s", id)
		assert.Equal(t, store.Done, f.status(t, id), "%s", id)
	}
}

// Each member of a group keeps its own result, as in a transaction of its
// own: its function's failure, or panic, rolls back its claim and effect
// only; a key that has a row goes to Dedup's claim; a key that another
// transaction holds is busy; a function that settles the transaction, or
// drops a statement's error, fails alone; one that blocks until its
// context ends times out. The other members commit.
func TestGroupCommitMembersFailAlone(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{Timeout: 3 * time.Second})
	g := newGate()
	boom := errors.New("boom")
	f.set("first", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := g.hold(ctx); err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	})
	insertThen := func(then func(context.Context, pgx.Tx) error) func(context.Context, pgx.Tx, *amqp.Delivery) error {
		return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
			if err := f.insert(ctx, tx, d); err != nil {
				return err
			}
			return then(ctx, tx)
		}
	}
	f.set("fails", insertThen(func(context.Context, pgx.Tx) error { return boom }))
	f.set("panics", insertThen(func(context.Context, pgx.Tx) error { panic("oops") }))
	f.set("settles", insertThen(func(ctx context.Context, tx pgx.Tx) error { return tx.Commit(ctx) }))
	f.set("drops", insertThen(func(ctx context.Context, tx pgx.Tx) error {
		tx.Exec(ctx, `SELECT 1/0`) // its error dropped
		return nil
	}))
	f.set("blocks", insertThen(func(ctx context.Context, _ pgx.Tx) error {
		<-ctx.Done()
		return ctx.Err()
	}))
	// "done" is done; another transaction holds "busy".
	_, err := f.st.Claim(ctx, "done", "earlier", time.Minute)
	require.NoError(t, err)
	require.NoError(t, f.st.Complete(ctx, "done", "earlier", time.Hour))
	holder, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer holder.Rollback(ctx)
	_, err = holder.Exec(ctx, `INSERT INTO `+f.table()+` (key, token, lease_until, forget_at) VALUES ('busy', 'holder', 'infinity', 'infinity')`)
	require.NoError(t, err)

	ids := []string{"first", "fails", "panics", "done", "busy", "settles", "drops", "ok", "blocks"}
	var ds []*amqp.Delivery
	for _, id := range ids {
		ds = append(ds, delivery(id))
	}
	errs := f.group(t, g, nil, ds...)
	result := map[string]error{}
	for i, id := range ids {
		result[id] = errs[i]
	}
	assert.NoError(t, result["first"], "first")
	assert.NoError(t, result["ok"], "ok")
	assert.ErrorIs(t, result["fails"], boom, "fails")
	var pe *rabbitmw.PanicError
	assert.ErrorAs(t, result["panics"], &pe, "panics")
	assert.ErrorIs(t, result["done"], rabbitmw.ErrDuplicate, "done")
	assert.ErrorIs(t, result["busy"], middleware.ErrBusy, "busy")
	assert.ErrorIs(t, result["settles"], pgstore.ErrTxSettled, "settles")
	assert.ErrorIs(t, result["drops"], pgx.ErrTxCommitRollback, "drops")
	assert.ErrorIs(t, result["blocks"], middleware.ErrTimeout, "blocks")

	assert.Equal(t, f.txid("first"), f.txid("ok"), "first and ok ran in one transaction")
	for _, id := range []string{"fails", "panics", "settles", "drops", "blocks"} {
		assert.Equal(t, f.txid("first"), f.txid(id), "first and %s ran in one transaction", id)
	}
	for _, id := range ids {
		want, status := 0, store.Claimed // no row: a stranger claims it
		switch id {
		case "first", "ok":
			want, status = 1, store.Done
		case "done":
			status = store.Done
		case "busy":
			status = store.Processing
		}
		assert.Equal(t, want, f.count(t, id), "effects of %s", id)
		assert.Equal(t, status, f.status(t, id), "the key %s, claimed by a stranger afterwards", id)
		if id == "done" || id == "busy" {
			_, calls := f.ran(id)
			assert.Zero(t, calls, "calls of %s's function", id)
		}
	}
}

// The group's connection dies before its commit: no member reports
// success, nothing is committed, the store is unavailable (not the
// messages' fault), and the redeliveries apply each effect once.
func TestGroupCommitConnectionTerminated(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	g := newGate()
	f.set("a", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if d.Redelivered {
			return f.insert(ctx, tx, d)
		}
		if err := g.hold(ctx); err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	})
	f.set("c", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if d.Redelivered {
			return f.insert(ctx, tx, d)
		}
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		var pid int
		if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
			return err
		}
		_, err := f.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
		return err
	})
	ids := []string{"a", "b", "c"}
	errs := f.group(t, g, nil, delivery("a"), delivery("b"), delivery("c"))
	for i, id := range ids {
		require.ErrorIs(t, errs[i], middleware.ErrStoreUnavailable, "%s", id)
		assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(errs[i]).Outcome, "Decide(%v)", errs[i])
		assert.Equal(t, 0, f.count(t, id), "effects of %s", id)
	}
	for _, id := range ids {
		d := delivery(id)
		d.Redelivered = true
		require.NoError(t, f.h.Handle(ctx, d), "the redelivery of %s", id)
		assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
		assert.Equal(t, store.Done, f.status(t, id), "%s", id)
	}
}

// A delivery whose context ends while it waits, queued in a group or for
// a group to open, returns the context's error, without having run, and
// not counted as the message's failure (its wait was the consumer's); the
// group goes on.
func TestGroupCommitContextEndsWhileWaiting(t *testing.T) {
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{GroupCommit: 2}, middleware.StackOptions{})
	g := newGate()
	f.set("a", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := g.hold(ctx); err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	})
	queued, cancelQueued := context.WithCancel(context.Background())
	defer cancelQueued()
	results := make(chan error, 2)
	go func() { results <- f.h.Handle(context.Background(), delivery("a")) }()
	<-g.held
	go func() { results <- f.h.Handle(queued, delivery("b")) }()
	require.Eventually(t, func() bool { return pgstore.GroupQueued(f.inner) == 1 }, 10*time.Second, time.Millisecond)
	// The group is full, and the only one: c waits for a group.
	waiting, cancelWaiting := context.WithCancel(context.Background())
	cancelWaiting()
	errC := f.h.Handle(waiting, delivery("c"))
	// d waits for a group until the deadline of its stack's Timeout: not
	// the message's failure, not counted.
	timed := middleware.Stack(f.st, middleware.StackOptions{Timeout: 300 * time.Millisecond})(f.inner)
	errD := timed.Handle(context.Background(), delivery("d"))
	assert.ErrorIs(t, errD, middleware.ErrTimeout, "d")
	assert.True(t, rabbitmw.IsNotCounted(errD), "d's timeout counted: %v", errD)
	assert.Equal(t, rabbitmw.Delay, rabbitmw.Decide(errD).Outcome, "Decide(%v)", errD)
	got, err := f.st.Inspect(context.Background(), "d")
	require.NoError(t, err)
	assert.Zero(t, got.Failures, "d's failures")
	cancelQueued()
	errB := <-results
	close(g.release)
	require.NoError(t, <-results, "a")
	assert.ErrorIs(t, errB, context.Canceled, "b")
	assert.ErrorIs(t, errC, context.Canceled, "c")
	for _, id := range []string{"b", "c", "d"} {
		_, calls := f.ran(id)
		assert.Zero(t, calls, "calls of %s's function", id)
		assert.Equal(t, 0, f.count(t, id), "effects of %s", id)
		assert.Equal(t, store.Claimed, f.status(t, id), "the key %s, claimed by a stranger afterwards", id)
	}
	assert.Equal(t, 1, f.count(t, "a"), "effects of a")
}

// With a pool of one connection, which the group holds, the deliveries
// that leave the group for Dedup's claim wait for it to end, and every
// delivery completes.
func TestGroupCommitPoolOfOne(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 1, pgstore.HandlerOptions{}, middleware.StackOptions{})
	_, err := f.st.Claim(ctx, "m3", "earlier", time.Minute)
	require.NoError(t, err)
	require.NoError(t, f.st.Complete(ctx, "m3", "earlier", time.Hour))
	var wg sync.WaitGroup
	errs := make([]error, 8)
	for i := range errs {
		wg.Go(func() { errs[i] = f.h.Handle(ctx, delivery(fmt.Sprint("m", i))) })
	}
	wg.Wait()
	for i, err := range errs {
		id := fmt.Sprint("m", i)
		if id == "m3" {
			assert.ErrorIs(t, err, rabbitmw.ErrDuplicate, "%s", id)
			continue
		}
		require.NoError(t, err, "%s", id)
		assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
	}
}

// GroupCommit is at most 32: each member costs a subtransaction.
func TestGroupCommitOutOfRange(t *testing.T) {
	f := newInbox(t, newPool(t))
	for _, n := range []int{-1, 33} {
		assert.Panics(t, func() { pgstore.Handler(f.st, f.insert, pgstore.HandlerOptions{GroupCommit: n}) }, "GroupCommit %d", n)
	}
	assert.NotPanics(t, func() { pgstore.Handler(f.st, f.insert, pgstore.HandlerOptions{GroupCommit: 32}) })
}
