package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
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

// holds sets id's function to hold gate g, then apply the effect: the
// first member of a group, which runs while the others queue.
func (f *groupFixture) holds(id string, g *gate) {
	f.set(id, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := g.hold(ctx); err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	})
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
	f.holds("first", g)
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
// group goes on. Dedup reports no answer for it: it got none.
func TestGroupCommitContextEndsWhileWaiting(t *testing.T) {
	var mu sync.Mutex
	events := map[string][]middleware.DedupEventKind{}
	dedup := middleware.DedupOptions{Observe: func(_ context.Context, e middleware.DedupEvent) {
		mu.Lock()
		defer mu.Unlock()
		events[e.Key] = append(events[e.Key], e.Kind)
	}}
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{GroupCommit: 2}, middleware.StackOptions{Dedup: dedup})
	g := newGate()
	f.holds("a", g)
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
	timed := middleware.Stack(f.st, middleware.StackOptions{Dedup: dedup, Timeout: 300 * time.Millisecond})(f.inner)
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
	mu.Lock()
	assert.Equal(t, []middleware.DedupEventKind{middleware.DedupClaimed}, events["a"], "Dedup's events of a")
	for _, id := range []string{"b", "c", "d"} {
		assert.Empty(t, events[id], "Dedup's events of %s", id)
	}
	mu.Unlock()
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

// A member's function that makes a savepoint of its own, whatever its
// name, and then fails, fails alone: its claim and its effect are rolled
// back with it, and the key stays free, as in a transaction of its own.
func TestGroupCommitFunctionSavepointThenFailure(t *testing.T) {
	for _, name := range []string{"rabbitmw_member", "mine"} {
		t.Run(name, func(t *testing.T) {
			f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
			g := newGate()
			boom := errors.New("boom")
			f.holds("a", g)
			f.set("b", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				if err := f.insert(ctx, tx, d); err != nil {
					return err
				}
				if _, err := tx.Exec(ctx, `SAVEPOINT `+name); err != nil {
					return err
				}
				if err := f.insert(ctx, tx, d); err != nil {
					return err
				}
				return boom
			})
			errs := f.group(t, g, nil, delivery("a"), delivery("b"), delivery("c"))
			require.NoError(t, errs[0], "a")
			require.ErrorIs(t, errs[1], boom, "b")
			require.NoError(t, errs[2], "c")
			assert.Equal(t, f.txid("a"), f.txid("b"), "a and b ran in one transaction")
			assert.Equal(t, 0, f.count(t, "b"), "effects of b")
			assert.Equal(t, store.Claimed, f.status(t, "b"), "the key b, claimed by a stranger afterwards")
			for _, id := range []string{"a", "c"} {
				assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
				assert.Equal(t, store.Done, f.status(t, id), "%s", id)
			}
		})
	}
}

// A lateContext ends when end is called, without waking what waits on
// its Done channel until then (it has none): it stands for a context that
// ends in the instant after its member was handed the group's connection,
// before the member's claim is sent.
type lateContext struct {
	context.Context
	ended atomic.Bool
}

var closedDone = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

func (c *lateContext) end() { c.ended.Store(true) }

func (c *lateContext) Done() <-chan struct{} {
	if c.ended.Load() {
		return closedDone
	}
	return nil
}

func (c *lateContext) Err() error {
	if c.ended.Load() {
		return context.Canceled
	}
	return nil
}

// A member whose context ends as it is handed the connection, so that
// its claim is never sent, leaves the member before it as it was: that
// member's effect commits, and its success is true.
func TestGroupCommitContextEndsAsTheConnectionComes(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	g := newGate()
	late := &lateContext{Context: ctx}
	f.holds("a", g)
	f.set("b", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		late.end() // c is queued behind b
		return f.insert(ctx, tx, d)
	})
	results := make(chan error, 2)
	go func() { results <- f.h.Handle(ctx, delivery("a")) }()
	<-g.held
	go func() { results <- f.h.Handle(ctx, delivery("b")) }()
	require.Eventually(t, func() bool { return pgstore.GroupQueued(f.inner) == 1 }, 10*time.Second, time.Millisecond)
	type answer struct {
		ran bool
		err error
	}
	answers := make(chan answer, 1)
	go func() {
		ran, err := f.inner.(middleware.ClaimingHandler).HandleClaiming(late, delivery("c"), f.st, "c", time.Minute, time.Hour)
		answers <- answer{ran, err}
	}()
	require.Eventually(t, func() bool { return pgstore.GroupQueued(f.inner) == 2 }, 10*time.Second, time.Millisecond)
	close(g.release)
	require.NoError(t, <-results)
	require.NoError(t, <-results)
	c := <-answers
	assert.False(t, c.ran && c.err == nil, "c succeeded, without running")
	for _, id := range []string{"a", "b"} {
		assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
		assert.Equal(t, store.Done, f.status(t, id), "%s", id)
	}
	_, calls := f.ran("c")
	assert.Zero(t, calls, "calls of c's function")
	assert.Equal(t, store.Claimed, f.status(t, "c"), "the key c, claimed by a stranger afterwards")
}

// Two copies of a message in one group: the second finds the first's
// claim in the transaction, leaves the group for Dedup's claim, which
// waits for the group's commit, and is a duplicate (or busy, if the
// commit took longer than a claim waits). The effect is applied once.
func TestGroupCommitTwoCopiesInOneGroup(t *testing.T) {
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	g := newGate()
	f.holds("a", g)
	errs := f.group(t, g, nil, delivery("a"), delivery("k"), delivery("k"), delivery("b"))
	require.NoError(t, errs[0], "a")
	require.NoError(t, errs[1], "the first copy of k")
	if !errors.Is(errs[2], rabbitmw.ErrDuplicate) {
		require.ErrorIs(t, errs[2], middleware.ErrBusy, "the second copy of k")
	}
	require.NoError(t, errs[3], "b")
	_, calls := f.ran("k")
	assert.Equal(t, 1, calls, "calls of k's function")
	for _, id := range []string{"a", "k", "b"} {
		assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
		assert.Equal(t, store.Done, f.status(t, id), "%s", id)
	}
}

// A member whose effect breaks a deferred constraint makes the group's
// COMMIT fail: nothing of the group committed, and each member is run
// again in a transaction of its own, so that it gets the result it would
// have had alone: the others succeed, and only that member fails, and is
// counted.
func TestGroupCommitRefusedCommitRunsEachMemberAlone(t *testing.T) {
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	g := f.refusedCommit(t, func(string) {})
	errs := f.group(t, g, nil, delivery("a"), delivery("poison"), delivery("b"))
	require.NoError(t, errs[0], "a")
	require.Error(t, errs[1], "poison")
	assert.False(t, rabbitmw.IsNotCounted(errs[1]), "poison's failure not counted: %v", errs[1])
	require.NoError(t, errs[2], "b")
	for _, id := range []string{"a", "b"} {
		assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
		assert.Equal(t, store.Done, f.status(t, id), "%s", id)
	}
	assert.Equal(t, 0, f.count(t, "poison"), "effects of poison")
	assert.Equal(t, store.Claimed, f.status(t, "poison"), "the key poison, claimed by a stranger afterwards")
}

// refusedCommit sets the functions of a group whose COMMIT the server
// refuses: "a" waits at the returned gate on its first run only, then
// inserts its effect; "poison" inserts its effect and breaks a deferred
// constraint, then calls ran with its id.
func (f *groupFixture) refusedCommit(t *testing.T, ran func(id string)) *gate {
	t.Helper()
	deferred := uniqueTable(t, f.pool)
	_, err := f.pool.Exec(context.Background(), `CREATE TABLE `+deferred+` (id int, CONSTRAINT `+deferred+`_unique UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)`)
	require.NoError(t, err)
	g := newGate()
	var held sync.Once
	f.set("a", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		var err error
		held.Do(func() { err = g.hold(ctx) }) // the first run only
		if err != nil {
			return err
		}
		return f.insert(ctx, tx, d)
	})
	f.set("poison", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+deferred+` (id) VALUES (1), (1)`)
		ran(d.MessageId)
		return err
	})
	return g
}

// A member whose context ended while it waited for a commit that the
// server refused cannot run again alone, so whether it caused the
// refusal is unknown: it is tried again, not counted, whichever member
// was at fault. The members whose context lives run again alone, as
// above: only the one at fault is counted.
func TestGroupCommitRefusedCommitMemberWhoseContextEnded(t *testing.T) {
	tests := []struct {
		name string
		late string // the member whose context ends as its function returns
	}{
		{name: "a member not at fault", late: "b"},
		{name: "the member at fault", late: "poison"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx := context.Background()
			f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
			lateCtx, cancel := context.WithCancel(ctx)
			defer cancel()
			ends := func(id string) {
				if id == tt.late {
					cancel()
				}
			}
			g := f.refusedCommit(t, ends)
			f.set("b", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				err := f.insert(ctx, tx, d)
				ends(d.MessageId)
				return err
			})
			ids := []string{"a", "poison", "b"}
			ctxs := make([]context.Context, len(ids))
			ds := make([]*amqp.Delivery, len(ids))
			for i, id := range ids {
				ds[i] = delivery(id)
				if id == tt.late {
					ctxs[i] = lateCtx
				}
			}
			errs := f.group(t, g, ctxs, ds...)
			for i, id := range ids {
				switch {
				case id == tt.late:
					require.Error(t, errs[i], id)
					assert.True(t, rabbitmw.IsNotCounted(errs[i]), "%s's failure counted: %v", id, errs[i])
					assert.Equal(t, 0, f.count(t, id), "effects of %s", id)
					assert.Equal(t, store.Claimed, f.status(t, id), "the key %s, claimed by a stranger afterwards", id)
				case id == "poison":
					require.Error(t, errs[i], id)
					assert.False(t, rabbitmw.IsNotCounted(errs[i]), "%s's failure not counted: %v", id, errs[i])
					assert.Equal(t, 0, f.count(t, id), "effects of %s", id)
				default:
					require.NoError(t, errs[i], id)
					assert.Equal(t, 1, f.count(t, id), "effects of %s", id)
					assert.Equal(t, store.Done, f.status(t, id), "%s", id)
				}
			}
		})
	}
}

// A member's function may nest transactions (pgx's savepoints) in tx, as
// alone: what it rolls back of them is rolled back, and a failure after
// them rolls back the member whole; the group-mates commit.
func TestGroupCommitNestedTransactions(t *testing.T) {
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	g := newGate()
	boom := errors.New("boom")
	f.holds("a", g)
	nested := func(commit bool, then error) func(context.Context, pgx.Tx, *amqp.Delivery) error {
		return func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
			if err := f.insert(ctx, tx, d); err != nil {
				return err
			}
			inner, err := tx.Begin(ctx)
			if err != nil {
				return err
			}
			if err := f.insert(ctx, inner, d); err != nil {
				return err
			}
			if commit {
				err = inner.Commit(ctx)
			} else {
				err = inner.Rollback(ctx)
			}
			if err != nil {
				return err
			}
			return then
		}
	}
	f.set("inner-committed", nested(true, nil))
	f.set("inner-rolled-back", nested(false, nil))
	f.set("inner-committed-then-failed", nested(true, boom))
	ids := []string{"a", "inner-committed", "inner-rolled-back", "inner-committed-then-failed", "b"}
	var ds []*amqp.Delivery
	for _, id := range ids {
		ds = append(ds, delivery(id))
	}
	errs := f.group(t, g, nil, ds...)
	for i, id := range ids {
		want, status := 1, store.Done
		switch id {
		case "inner-committed":
			want = 2
		case "inner-committed-then-failed":
			require.ErrorIs(t, errs[i], boom, "%s", id)
			want, status = 0, store.Claimed
		}
		if status == store.Done {
			require.NoError(t, errs[i], "%s", id)
		}
		assert.Equal(t, f.txid("a"), f.txid(id), "a and %s ran in one transaction", id)
		assert.Equal(t, want, f.count(t, id), "effects of %s", id)
		assert.Equal(t, status, f.status(t, id), "the key %s, claimed by a stranger afterwards", id)
	}
}

// A member's function that returns with a query's rows unclosed leaves
// the group's connection busy: nothing more can be sent on it, not the
// rollback to the member's savepoint, nor the commit. The member fails,
// counted; the members before it fail, not counted (their effects are
// rolled back, and their messages tried again, once each); the members
// after it run under Dedup's claim.
func TestGroupCommitRowsLeftOpen(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	g := newGate()
	f.holds("a", g)
	f.set("leak", f.leavesRowsOpen)
	errs := f.group(t, g, nil, delivery("a"), delivery("leak"), delivery("b"))
	require.ErrorIs(t, errs[0], middleware.ErrStoreUnavailable, "a")
	require.Error(t, errs[1], "leak")
	assert.NotErrorIs(t, errs[1], middleware.ErrStoreUnavailable, "leak")
	assert.False(t, rabbitmw.IsNotCounted(errs[1]), "leak's failure not counted: %v", errs[1])
	require.NoError(t, errs[2], "b")
	assert.Equal(t, 0, f.count(t, "a"), "effects of a")
	assert.Equal(t, 0, f.count(t, "leak"), "effects of leak")
	assert.Equal(t, 1, f.count(t, "b"), "effects of b")
	f.set("a", nil)
	require.NoError(t, f.h.Handle(ctx, delivery("a")), "a again")
	assert.Equal(t, 1, f.count(t, "a"), "effects of a")
	assert.Equal(t, store.Done, f.status(t, "a"))
}

// A member whose function leaves the group's transaction idle for longer
// than the lease, and then succeeds without another statement, lost its
// claim with the session that the server ended: the member after it
// finds the session ended as it sends its claim. The first gets the
// result of a claim that ended with its lease (and its next delivery goes
// to Dedup's claim, whose renewals let the function take its time), not
// that of a transaction broken by another member, which would send its
// next delivery to claim in a transaction again, to lose its lease again.
func TestGroupCommitIdleMemberThenAnother(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	const lease, wait = 300 * time.Millisecond, time.Second
	f.h = middleware.Dedup(f.st, middleware.DedupOptions{Lease: lease})(f.inner)
	g := newGate()
	var underClaim []bool
	f.set("a", func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		_, ok := middleware.ClaimFrom(ctx)
		underClaim = append(underClaim, ok)
		if err := f.insert(ctx, tx, d); err != nil {
			return err
		}
		if !ok {
			if err := g.hold(ctx); err != nil {
				return err
			}
			time.Sleep(wait) // idle in the transaction, ignoring ctx
		}
		return nil
	})
	errs := f.group(t, g, nil, delivery("a"), delivery("b"))
	require.ErrorIs(t, errs[0], middleware.ErrLeaseLost, "a")
	require.NoError(t, errs[1], "b")
	assert.Equal(t, 0, f.count(t, "a"), "effects of a")
	assert.Equal(t, 1, f.count(t, "b"), "effects of b")
	require.NoError(t, f.h.Handle(ctx, delivery("a")), "a's next delivery")
	assert.Equal(t, []bool{false, true}, underClaim, "a ran under a claim of Dedup's")
	assert.Equal(t, 1, f.count(t, "a"), "effects of a")
}

// A member whose context ends while its claim waits for a row that
// another transaction holds (a copy of its message in another consumer's
// transaction) leaves the group as it would have alone, having run
// nothing: the group's connection, shared, is not closed under its
// group-mates, which commit.
func TestGroupCommitContextEndsDuringTheClaim(t *testing.T) {
	ctx := context.Background()
	f := newGroupFixture(t, 4, pgstore.HandlerOptions{}, middleware.StackOptions{})
	// Another consumer's transaction holds b's row.
	other, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	defer other.Rollback(ctx)
	_, err = other.Exec(ctx, `INSERT INTO `+f.table()+` (key, token, lease_until, forget_at) VALUES ('b', NULL, now() + interval '1 hour', now() + interval '1 hour')`)
	require.NoError(t, err)
	var otherPID int
	require.NoError(t, other.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&otherPID))

	g := newGate()
	f.holds("a", g)
	bctx, cancel := context.WithCancel(ctx)
	defer cancel()
	waiting := make(chan struct{})
	go func() { // b's context ends once its claim waits for the row
		defer close(waiting)
		for range 1000 {
			var n int
			if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, otherPID).Scan(&n); err == nil && n > 0 {
				cancel()
				return
			}
			time.Sleep(time.Millisecond) // polls the server
		}
	}()
	errs := f.group(t, g, []context.Context{nil, bctx}, delivery("a"), delivery("b"))
	<-waiting
	require.ErrorIs(t, bctx.Err(), context.Canceled, "b's claim never waited")
	require.NoError(t, errs[0], "a")
	assert.Equal(t, 1, f.count(t, "a"), "effects of a")
	assert.Equal(t, store.Done, f.status(t, "a"))
	require.Error(t, errs[1], "b")
	_, calls := f.ran("b")
	assert.Zero(t, calls, "calls of b's function")
}
