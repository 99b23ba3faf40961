package pgstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/recording"
)

// maxGroupCommit bounds [HandlerOptions].GroupCommit. Each member of a
// group runs in a subtransaction of its own, and a backend caches the ids
// of 64 subtransactions of its transaction: past them, every snapshot
// taken by every backend looks them up in pg_subtrans. 32 leaves room for
// a savepoint of each member's function.
const maxGroupCommit = 32

// savepointName returns the name of the savepoint of a group's n-th
// member, which it begins with, sent with its claim, and to which its
// failure rolls the group's transaction back. Each member's is its own: a
// ROLLBACK TO a name that the member's function used for a savepoint of
// its own, or that the member before it used while the member's own was
// never made (its claim was not sent), would roll back to that savepoint,
// leaving part of the member in the transaction, or taking the member
// before it out; a name of its own, if it was never made, fails the
// ROLLBACK TO, and the group does not commit.
func savepointName(n int) string { return "rabbitmw_member_" + strconv.Itoa(n) }

// errClosed: the connection of a group's transaction closed while a
// member's function ran.
var errClosed = errors.New("pgstore: the transaction's connection closed")

// A grouper runs the deliveries that a [Handler] with GroupCommit claims
// in its transaction in groups: a group is one transaction, on one
// connection, which its members use one after the other, each in the
// goroutine that called HandleClaiming, and one commit.
//
// A delivery opens a group of its own, unless as many groups as may be
// are open already: then it joins the open group that takes members (not
// sealed, not full) with the fewest; if none does, it waits for a group
// to open or end. So the groups run side by side, on as many
// connections, and deliveries queue in them only when they outnumber the
// groups. A group's first member holds its connection from the start;
// when a member is done, it passes the connection to the next member
// queued, or, if none is, seals the group and ends its transaction
// itself. So a group commits as soon as no member of it runs or waits,
// and only its queued members wait for the connection.
type grouper struct {
	h      *txHandler
	size   int // the most members of a group
	groups int // the most groups open at once

	mu      sync.Mutex
	open    []*group      // groups with a connection
	opening int           // groups waiting for their connection
	changed chan struct{} // closed, and replaced, when a group opens or ends
}

// newGrouper returns the grouper of h, whose groups have up to size
// members. An eighth of the pool's connections, one at least, serve
// groups: the fewer groups, the fuller, and the fewer commits and busy
// server processes, as long as they keep the server's cores busy (a pool
// sized for a consumer's workers, 16 or so, gives two); the rest of the
// pool serves Dedup's claims of the deliveries that are not grouped
// (redelivered, or whose key has a row), and the function's own use of
// the pool, if any.
func newGrouper(h *txHandler, size int) *grouper {
	return &grouper{
		h:       h,
		size:    size,
		groups:  max(1, int(h.in.s.pool.Config().MaxConns)/8),
		changed: make(chan struct{}),
	}
}

// A group is one transaction of several deliveries.
type group struct {
	t *pgxTxn

	// Under grouper.mu:
	members int       // admitted: running, queued, or awaiting the commit
	queue   []*member // awaiting the connection, in order of arrival
	sealed  bool      // takes no more members

	// Of the member that holds the connection, then of the one that
	// commits, which holds it last:
	broken  error     // why the transaction cannot commit, if it cannot
	pending []*member // the members whose function succeeded
	claims  int       // the members that sent their claim, or tried to

	done chan struct{} // closed once the pending members' results are set
}

// A member is one delivery of a group.
type member struct {
	txClaim
	turn      chan struct{} // closed when the member holds the connection
	savepoint string        // its savepoint's name, once it holds the connection
	result    error         // a pending member's, once its group is done
	// alone: the server refused its group's commit, which held other
	// members' effects too: the member runs again, in a transaction of its
	// own, for a result of its own, unless its context ended (then its
	// result is unknown: see grouper.unknown).
	alone bool
}

// A memberTx is the pgx.Tx that a member's function gets: the group's
// transaction, in which it runs within its member's savepoint. Commit and
// Rollback send nothing: they record that the function settled the
// transaction, and the member is then rolled back to its savepoint, and
// fails with [ErrTxSettled].
type memberTx struct {
	pgx.Tx
	settled bool
}

func (t *memberTx) Commit(context.Context) error   { t.settled = true; return nil }
func (t *memberTx) Rollback(context.Context) error { t.settled = true; return nil }

// handle is HandleClaiming for a delivery d of key that may be claimed in
// a transaction: it joins a group, claims key, runs the function, and
// waits for the group's commit if the function succeeded.
func (gr *grouper) handle(ctx context.Context, d *amqp.Delivery, key string, lease, retention time.Duration) (bool, error) {
	m := &member{txClaim: txClaim{key: key, retention: retention}}
	g, err := gr.join(ctx, m)
	switch {
	case err != nil:
		return false, gr.h.in.cut(key, "a group's transaction", err)
	case g == nil:
		return false, nil // no connection: Dedup's claim reports it
	}
	ran, err := gr.run(ctx, g, m, d, lease)
	if ran {
		gr.h.in.s.counted(ctx)
	}
	return ran, err
}

// unknown is the result of a member of key whose group's commit the
// server refused, with err, and whose context ended before it could run
// again alone: nothing of it committed, and whether it caused the refusal
// or another member did is unknown. So it is not counted, and tried again
// after RetryDelay: were it at fault, its next attempt fails alone, and
// is counted then. Counting it would count a failure of another message
// against it.
func (gr *grouper) unknown(key string, err error) error {
	return rabbitmw.NotCounted(rabbitmw.RetryAfter(fmt.Errorf("pgstore: the server refused the commit of %q with the other messages of its group, and its context ended before it could run alone to tell whether it was the cause: %w", key, err), gr.h.in.retry))
}

// join admits m to a group, and returns it once m holds its connection;
// or nil if the pool gave no connection for a group of m's own. It
// returns the cause of ctx if ctx ends first, or as the connection comes
// to m: m would send nothing on it (pgx sends no statement under a
// context that ended), and passes it on.
func (gr *grouper) join(ctx context.Context, m *member) (*group, error) {
	g, err := gr.admit(ctx, m)
	if g != nil && err == nil && ctx.Err() != nil {
		gr.pass(ctx, g)
		return nil, context.Cause(ctx)
	}
	return g, err
}

// admit is join, but for a ctx that ends as the connection comes to m.
func (gr *grouper) admit(ctx context.Context, m *member) (*group, error) {
	for {
		gr.mu.Lock()
		if len(gr.open)+gr.opening < gr.groups {
			gr.opening++
			gr.mu.Unlock()
			return gr.start(ctx)
		}
		var g *group
		for _, o := range gr.open {
			if !o.sealed && o.members < gr.size && (g == nil || o.members < g.members) {
				g = o
			}
		}
		if g != nil {
			g.members++
			m.turn = make(chan struct{})
			g.queue = append(g.queue, m)
			gr.mu.Unlock()
			return g, gr.wait(ctx, g, m)
		}
		changed := gr.changed
		gr.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		}
	}
}

// start opens a group, whose first member holds its connection.
func (gr *grouper) start(ctx context.Context) (*group, error) {
	t, err := gr.h.begin(ctx)
	gr.mu.Lock()
	defer gr.mu.Unlock()
	gr.opening--
	defer gr.broadcast()
	if err != nil {
		if ctx.Err() != nil {
			return nil, context.Cause(ctx)
		}
		return nil, nil
	}
	g := &group{t: t.(*pgxTxn), members: 1, done: make(chan struct{})}
	gr.open = append(gr.open, g)
	return g, nil
}

// broadcast wakes the deliveries waiting for a group to open or end. The
// caller holds mu.
func (gr *grouper) broadcast() {
	close(gr.changed)
	gr.changed = make(chan struct{})
}

// wait waits for m's turn to hold g's connection. If ctx ends first, m
// leaves the queue; if the connection came to it meanwhile, it passes it
// on.
func (gr *grouper) wait(ctx context.Context, g *group, m *member) error {
	select {
	case <-m.turn:
		return nil
	case <-ctx.Done():
	}
	gr.mu.Lock()
	if i := slices.Index(g.queue, m); i >= 0 {
		g.queue = slices.Delete(g.queue, i, i+1)
		g.members--
		gr.mu.Unlock()
		return context.Cause(ctx)
	}
	gr.mu.Unlock()
	gr.pass(ctx, g)
	return context.Cause(ctx)
}

// run runs m, which holds g's connection: its claim, sent with its
// savepoint, and, if it claimed, the function. Then it passes the
// connection on, and, if the function succeeded, waits for the group's
// commit. A failure, or a panic, of the function rolls the transaction
// back to m's savepoint: the other members go on. ran and err are
// HandleClaiming's.
func (gr *grouper) run(ctx context.Context, g *group, m *member, d *amqp.Delivery, lease time.Duration) (ran bool, err error) {
	in := gr.h.in
	if g.broken != nil {
		gr.pass(ctx, g)
		return false, nil
	}
	m.start, m.lease = time.Now(), lease
	g.claims++
	m.savepoint = savepointName(g.claims)
	// The claim waits lockWait at most for a row that another
	// transaction holds. The end of ctx does not cut it short: pgx would
	// close the group's connection under the group-mates.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), in.commitTimeout)
	claimed, err := g.t.claim(cctx, &m.txClaim, lease, m.savepoint)
	cancel()
	if err == nil && claimed && ctx.Err() != nil {
		// ctx ended while m claimed: m runs nothing, as if it had ended
		// while m waited for the connection.
		gr.undo(ctx, g, m)
		gr.pass(ctx, g)
		return false, gr.h.in.cut(m.key, "a group's transaction", context.Cause(ctx))
	}
	if err != nil || !claimed {
		if idleTimedOut(err) {
			// The server ended the session, left idle for the lease
			// before this claim: the claims of the members before it
			// ended with it.
			g.broken = err
		}
		gr.undo(ctx, g, m)
		gr.pass(ctx, g)
		return false, claimBusy(m.key, err)
	}
	tx := &memberTx{Tx: g.t.tx.tx}
	returned := false
	defer func() {
		if !returned { // the function panicked: the panic goes on
			gr.undo(ctx, g, m)
			gr.pass(ctx, g)
		}
	}()
	err = gr.h.fn(ctx, tx, d)
	returned = true
	switch status := g.t.conn.Conn().PgConn().TxStatus(); {
	case idleTimedOut(err):
		// The server ended the session: the group's claims too.
		g.broken = err
		err = in.claimEnded(ctx, &m.txClaim, err)
	case g.t.broken() && !tx.settled:
		// The connection closed while the function ran, which dropped
		// the error that said why: the group's claims ended with it.
		// (One that settled tx itself is judged on that, below.)
		g.broken = errClosed
		err = in.closed(ctx, g.t, &m.txClaim, err)
	case err != nil:
		gr.undo(ctx, g, m)
		err = in.failed(ctx, g.t, m.key, err)
	case g.t.conn.Conn().PgConn().IsBusy():
		// Nothing more can be sent on the connection: not even the
		// rollback to m's savepoint.
		g.broken = errRowsOpen
		err = fmt.Errorf("pgstore: the transaction of %q: %w", m.key, errRowsOpen)
	case tx.settled:
		gr.undo(ctx, g, m)
		err = errTxSettled(m.key)
	case status == 'E':
		// A statement of the function failed, and it dropped the error:
		// its part of the transaction is aborted.
		gr.undo(ctx, g, m)
		err = fmt.Errorf("pgstore: the transaction of %q: a statement in it failed: %w", m.key, pgx.ErrTxCommitRollback)
	case status == 'I':
		// The function ended the group's transaction itself, through its
		// connection: what it committed, if anything, is unknown.
		g.broken = ErrTxSettled
		err = errTxSettled(m.key)
	default:
		g.pending = append(g.pending, m)
		rec := recording.Begin(ctx, time.Now().Add(in.commitTimeout))
		gr.pass(ctx, g)
		gr.await(ctx, g)
		rec.End()
		switch {
		case m.alone && ctx.Err() == nil:
			return gr.h.handleAlone(ctx, d, m.key, lease, m.retention)
		case m.alone:
			return true, gr.unknown(m.key, m.result)
		}
		return true, m.result
	}
	gr.pass(ctx, g)
	return true, err
}

// undo rolls g's transaction back to the savepoint of m, which holds its
// connection, within commitTimeout even if ctx is done; if it cannot, the
// transaction is broken.
func (gr *grouper) undo(ctx context.Context, g *group, m *member) {
	if g.broken != nil {
		return
	}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), gr.h.in.commitTimeout)
	defer cancel()
	if _, err := g.t.conn.Exec(rctx, "ROLLBACK TO SAVEPOINT "+m.savepoint); err != nil {
		g.broken = err
	}
}

// pass passes g's connection to the next member queued; if none is, it
// seals g, ends its transaction, and closes g.
func (gr *grouper) pass(ctx context.Context, g *group) {
	gr.mu.Lock()
	if len(g.queue) > 0 {
		next := g.queue[0]
		g.queue = g.queue[1:]
		gr.mu.Unlock()
		close(next.turn)
		return
	}
	g.sealed = true
	gr.mu.Unlock()
	gr.commit(ctx, g)
	gr.mu.Lock()
	gr.open = slices.DeleteFunc(gr.open, func(o *group) bool { return o == g })
	gr.broadcast()
	gr.mu.Unlock()
}

// commit ends g's transaction: it commits, if a member's function
// succeeded and the transaction is not broken, or rolls back; and it sets
// each pending member's result. If the server refused the commit of
// several members (a deferred constraint, a serialisation failure),
// nothing committed, and the cause may be any one of them: each is to run
// again alone.
func (gr *grouper) commit(ctx context.Context, g *group) {
	in := gr.h.in
	defer close(g.done)
	var sent bool
	var err error
	if g.broken == nil && len(g.pending) > 0 {
		cs := make([]*txClaim, len(g.pending))
		for i, m := range g.pending {
			cs[i] = &m.txClaim
		}
		sent, err = in.commitClaims(ctx, g.t, cs...)
	}
	refused := sent && len(g.pending) > 1 && err != nil && (errors.Is(err, pgx.ErrTxCommitRollback) || isPgError(err) && !lost(g.t, err) && !idleTimedOut(err))
	for _, m := range g.pending {
		m.alone = refused
		switch {
		case g.broken == nil:
			m.result = in.claimResult(ctx, g.t, &m.txClaim, sent, err)
		case idleTimedOut(g.broken):
			m.result = in.claimEnded(ctx, &m.txClaim, g.broken)
		default:
			// Another member's failure broke the transaction: it is
			// not this message's.
			m.result = in.unavailable(fmt.Errorf("pgstore: the transaction of %q, shared with other messages, broke (if a function ended it, whether it took effect is unknown): %w", m.key, g.broken))
		}
	}
	if sent {
		g.t.release()
	} else {
		in.rollback(ctx, g.t)
	}
}

// await waits until g is done. If ctx ends first, g takes no more
// members, so that the wait lasts only as long as those admitted run.
func (gr *grouper) await(ctx context.Context, g *group) {
	select {
	case <-g.done:
		return
	case <-ctx.Done():
	}
	gr.mu.Lock()
	g.sealed = true
	gr.mu.Unlock()
	<-g.done
}
