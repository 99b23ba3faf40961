package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// A cancelContext is the context that [Dedup] and [Timeout] give the
// layers and handler beneath them. It behaves as
// context.WithCancelCause(parent) would, or, with a deadline, as
// context.WithDeadline(parent, deadline) would (TestClaimContextAsStdlib
// and TestDeadlineContextAsStdlib hold it to that), at a lower cost: it is
// one allocation, which Dedup shares with its other state of a delivery,
// and, once someone waits for it, a done channel.
//
// Until then (an unwatched context), nothing tells it that its parent
// ended or its deadline passed: Err, and Value, read both when they are
// called, and the first error found is kept, with its cause, so it never
// changes. The first call of Done (or of AfterFunc, through which the
// context package attaches a context derived from it, and
// context.AfterFunc its callbacks) watches it: it makes the done channel,
// arms a timer for the deadline (or queues it in a [deadlineQueue] that
// it shares with its siblings), and asks the parent to tell it of its
// end (through a [parentWatcher] that it shares with its siblings,
// context.AfterFunc, or the parent's AfterFunc method). Err goes on
// reading the parent's error, so that it reports the parent's end at once
// even though that news, from a parent of the standard library, comes
// through a goroutine; the contexts derived from it learn of that end a
// moment later, as those derived from a context the standard library does
// not know do. Dedup watches the contexts it gives its handlers from the
// start ([cancelContext.watch]): a handler that does I/O watches its
// context anyway, and the time Dedup has just read then serves, where the
// first Done would read the clock again.
//
// A detached context takes only the parent's values, as
// context.WithoutCancel(parent) does: neither its cancellation nor its
// deadline.
//
// Once ended, its Value answers from a context of the standard library
// built for the ended state, so that context.Cause (which looks for the
// context package's own value) finds its cause, and not the parent's.
//
// Its zero value is not usable: set parent, and deadline, detached and
// shared as needed, before its first use.
type cancelContext struct {
	parent   context.Context
	deadline time.Time // its own deadline; zero if it has none
	// shared, if set, is how it is watched along with its siblings; else
	// it watches for itself.
	shared *sharedWatch

	mu    sync.Mutex
	cause error // why it ended, once it has (see ended)
	done  chan struct{}
	// What the watch holds, released at the end.
	stopParent func() bool
	timer      *time.Timer
	funcs      *ctxFunc // the callbacks of AfterFunc, a list
	// rare holds what few ends need, made only for them (see endState).
	rare *endState

	ended    endKind // its error: live until it ends
	detached bool    // the parent gives its values only
	watched  bool    // the parent's end and the deadline are being watched
	// byWatcher: the parent's end is watched by the parentWatcher, which
	// must let c go at its end.
	byWatcher bool
}

// An endKind is a cancelContext's error, in a byte rather than the two
// words of an error: its end is nearly always context.Canceled or
// context.DeadlineExceeded.
type endKind uint8

const (
	live endKind = iota
	endCanceled
	endDeadline
	endOther // a parent's error of another kind (see endState)
)

// An endState holds what a cancelContext needs of its end only rarely,
// in an allocation of its own made only then, so that every context is
// the smaller: an error that is neither context.Canceled nor
// context.DeadlineExceeded (a parent's, outside the context contract),
// and the standard library's context built for the ended state, once
// Value is asked for.
type endState struct {
	err error
	std context.Context
}

// endOf returns the endKind of err, the error of an end.
func endOf(err error) endKind {
	switch err {
	case context.Canceled:
		return endCanceled
	case context.DeadlineExceeded:
		return endDeadline
	}
	return endOther
}

// err returns c's error: nil while it is live. c.mu must be held.
func (c *cancelContext) err() error {
	switch c.ended {
	case endCanceled:
		return context.Canceled
	case endDeadline:
		return context.DeadlineExceeded
	case endOther:
		return c.rare.err
	}
	return nil
}

// A sharedWatch is what a cancelContext needs to be watched with its
// siblings, by a [parentWatcher] and a [deadlineQueue] that they share.
// Only the contexts that Dedup gives its handlers have one, in the same
// allocation ([claimContext]); the others (a Timeout layer's own, the
// contexts of the store calls that record an attempt) watch for
// themselves, and are the smaller for it.
type sharedWatch struct {
	// by, if set, is what watches it with its siblings.
	by *watchers

	// Guarded by by.parents.mu: c's place among the contexts it watches
	// for.
	watchedBy    *watchedParent
	wprev, wnext *cancelContext
	// Guarded by by.deadlines.mu: its place among the deadlines.
	deadlineLinks timerLinks[cancelContext]
	// byLease: its deadline is queued and taken out of the queue by
	// the renewer of its claim's lease (see [renewer.start]), which holds
	// the queue's lock then anyway, rather than by its watch and its end.
	byLease bool
}

// watchers are what the contexts that one layer makes share to be
// watched: one pointer to them, in each context, where two would take a
// word more.
type watchers struct {
	// parents, if set, watches their parents.
	parents *parentWatcher
	// deadlines, if set, ends them at their deadlines; else a timer of
	// each one's own does.
	deadlines *deadlineQueue
}

// links implements timerItem, for a c with a shared watch.
func (c *cancelContext) links() *timerLinks[cancelContext] { return &c.shared.deadlineLinks }

// due implements timerItem: c is due at its deadline.
func (c *cancelContext) due() time.Time { return c.deadline }

// watcher returns the parentWatcher that watches c's parent for c, or nil.
func (c *cancelContext) watcher() *parentWatcher {
	if c.shared == nil || c.shared.by == nil {
		return nil
	}
	return c.shared.by.parents
}

// byLease reports whether c's deadline is queued by its claim's lease
// (see [sharedWatch]).
func (c *cancelContext) byLease() bool { return c.shared != nil && c.shared.byLease }

// deadlines returns the deadlineQueue that ends c at its deadline, or nil.
func (c *cancelContext) deadlines() *deadlineQueue {
	if c.shared == nil || c.shared.by == nil {
		return nil
	}
	return c.shared.by.deadlines
}

// A ctxFunc is a callback registered by [cancelContext.AfterFunc].
type ctxFunc struct {
	f          func()
	prev, next *ctxFunc
	due        bool // c has ended: f runs, or has run
	stopped    bool
}

// Deadline implements context.Context.
func (c *cancelContext) Deadline() (time.Time, bool) {
	if c.detached {
		return c.deadline, !c.deadline.IsZero()
	}
	d, ok := c.parent.Deadline()
	if c.deadline.IsZero() || ok && d.Before(c.deadline) {
		return d, ok
	}
	return c.deadline, true
}

// Err implements context.Context.
func (c *cancelContext) Err() error {
	perr, pcause := c.parentEnded() // before c.mu: see check
	c.mu.Lock()
	if c.ended != live {
		err := c.err()
		c.mu.Unlock()
		return err
	}
	err, cause := c.check(perr, pcause)
	if err == nil {
		c.mu.Unlock()
		return nil
	}
	c.finish(c.endLocked(endOf(err), err, cause))
	return err
}

// endCause ends c as [cancelContext.end] does, and returns what
// context.Cause(c) returned just before: the cause of c's end, or nil if
// c was live. It takes c.mu once, where context.Cause and end would take
// it once each (and context.Cause would ask c's parents for a value
// besides).
func (c *cancelContext) endCause() error {
	perr, pcause := c.parentEnded() // before c.mu: see check
	c.mu.Lock()
	if c.ended != live {
		cause := c.cause
		c.mu.Unlock()
		return cause
	}
	err, cause := c.check(perr, pcause)
	if err == nil {
		c.finish(c.endLocked(endCanceled, context.Canceled, context.Canceled))
		return nil
	}
	c.finish(c.endLocked(endOf(err), err, cause))
	return cause
}

// check returns the error and cause with which c must end now, or nil if
// it is live, for a live c, given what parentEnded returned. An unwatched
// c goes by the parent's error and the clock; a watched one by the
// parent's error alone, which the standard library's contexts set at once
// while they tell their watchers later. c.mu must be held.
//
// The parent's error must be read before c.mu is taken: a parent that is
// a cancelContext may find its own end as it is asked (its parent's, not
// yet told), and then end, and call c's callback (c's watch of it), which
// takes c.mu, at once, on the same goroutine.
func (c *cancelContext) check(perr, pcause error) (err, cause error) {
	if perr != nil {
		return perr, pcause
	}
	// time.Until reads the monotonic clock alone, time.Now both clocks.
	if !c.watched && !c.deadline.IsZero() && time.Until(c.deadline) <= 0 {
		return context.DeadlineExceeded, context.DeadlineExceeded
	}
	return nil, nil
}

// parentEnded returns the error and cause of c's parent if it has ended
// and c is not detached, else nil.
func (c *cancelContext) parentEnded() (err, cause error) {
	if c.detached {
		return nil, nil
	}
	if err := c.parent.Err(); err != nil {
		return err, context.Cause(c.parent)
	}
	return nil, nil
}

// Done implements context.Context.
func (c *cancelContext) Done() <-chan struct{} {
	c.mu.Lock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.ended != live {
			close(c.done)
		}
	}
	done := c.done
	c.finishWatch(time.Time{})
	return done
}

// AfterFunc arranges for f to be called when c ends, and returns a
// function that cancels the call, reporting whether it did; if c has
// already ended, f runs at once on a goroutine of its own. The context
// package calls it, if a context has it, to attach a context derived from
// this one (f then cancels the derived context) and to run the callbacks
// of context.AfterFunc (f then starts them on a goroutine of their own).
// So f must be quick: it runs on the goroutine that ends c, as the
// standard library's contexts cancel their children.
func (c *cancelContext) AfterFunc(f func()) (stop func() bool) {
	c.mu.Lock()
	if c.ended != live {
		c.mu.Unlock()
		go f()
		return func() bool { return false }
	}
	n := &ctxFunc{f: f, next: c.funcs}
	if c.funcs != nil {
		c.funcs.prev = n
	}
	c.funcs = n
	c.finishWatch(time.Time{})
	return func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		if n.due || n.stopped {
			return false
		}
		n.stopped = true
		if n.prev != nil {
			n.prev.next = n.next
		} else {
			c.funcs = n.next
		}
		if n.next != nil {
			n.next.prev = n.prev
		}
		return true
	}
}

// watch watches c, as its first Done would, now: the time just read by
// time.Now, or zero to have watch read it if it needs it.
func (c *cancelContext) watch(now time.Time) {
	c.mu.Lock()
	c.finishWatch(now)
}

// finishWatch watches c, if it is live and not watched yet, and unlocks
// c.mu, which must be held. now is the time just read by time.Now, or
// zero to have finishWatch read it if it needs it.
func (c *cancelContext) finishWatch(now time.Time) {
	if c.ended != live || c.watched {
		c.mu.Unlock()
		return
	}
	err, cause := c.parentEnded()
	var left time.Duration // until the deadline
	if err == nil && !c.deadline.IsZero() {
		if now.IsZero() {
			now = time.Now() // read once, for the deadline's timer too
		}
		if left = c.deadline.Sub(now); left <= 0 {
			err, cause = context.DeadlineExceeded, context.DeadlineExceeded
		}
	}
	if err != nil {
		c.finish(c.endLocked(endOf(err), err, cause))
		return
	}
	c.watched = true
	if !c.detached && c.parent.Done() != nil {
		c.byWatcher = c.watcher().add(c)
		if !c.byWatcher {
			parent := c.parent
			onEnd := func() { c.stop(parent.Err(), context.Cause(parent)) }
			if p, ok := parent.(interface{ AfterFunc(func()) func() bool }); ok {
				c.stopParent = p.AfterFunc(onEnd) // the parent ends c as it ends
			} else {
				c.stopParent = context.AfterFunc(parent, onEnd)
			}
		}
	}
	switch {
	case c.deadline.IsZero(), c.byLease():
	case c.deadlines() != nil:
		c.deadlines().add(c, now)
	default:
		c.timer = time.AfterFunc(left, c.expire)
	}
	c.mu.Unlock()
}

// expire ends c at its deadline.
func (c *cancelContext) expire() {
	c.stopAs(endDeadline, context.DeadlineExceeded, context.DeadlineExceeded)
}

// Value implements context.Context.
func (c *cancelContext) Value(key any) any {
	perr, pcause := c.parentEnded() // before c.mu: see check
	c.mu.Lock()
	if c.ended == live {
		err, cause := c.check(perr, pcause)
		if err == nil {
			c.mu.Unlock()
			return c.parent.Value(key)
		}
		c.finish(c.endLocked(endOf(err), err, cause))
		c.mu.Lock()
	}
	if c.rare == nil {
		c.rare = new(endState)
	}
	if c.rare.std == nil {
		c.rare.std = endedContext(c.parent, c.err(), c.cause)
	}
	ended := c.rare.std
	c.mu.Unlock()
	return ended.Value(key)
}

// endedContext returns a context of the standard library that has parent's
// values and has ended with err and cause.
func endedContext(parent context.Context, err, cause error) context.Context {
	base := context.WithoutCancel(parent)
	if errors.Is(err, context.DeadlineExceeded) {
		ctx, cancel := context.WithDeadlineCause(base, time.Time{}, cause)
		cancel() // it has ended already: this changes nothing
		return ctx
	}
	ctx, cancel := context.WithCancelCause(base)
	cancel(cause)
	return ctx
}

// String names the context as the standard library's do.
func (c *cancelContext) String() string {
	switch {
	case c.detached:
		return fmt.Sprintf("%v.WithoutCancel.WithDeadline(%v)", c.parent, c.deadline)
	case c.deadline.IsZero():
		return fmt.Sprintf("%v.WithCancel", c.parent)
	}
	return fmt.Sprintf("%v.WithDeadline(%v)", c.parent, c.deadline)
}

// cancel ends c with context.Canceled and the given cause
// (context.Canceled if nil) unless it has ended already.
func (c *cancelContext) cancel(cause error) {
	if cause == nil {
		cause = context.Canceled
	}
	c.stopAs(endCanceled, context.Canceled, cause)
}

// end is the CancelFunc of c: cancel with context.Canceled. A context
// that was watched must be ended, to release its timer and its place
// among its parent's watchers.
func (c *cancelContext) end() { c.cancel(nil) }

// stop ends c with err and cause unless it has ended already (seen or
// not).
func (c *cancelContext) stop(err, cause error) { c.stopAs(endOf(err), err, cause) }

// stopAs is stop, given the endKind of err, which saves cancel and expire
// the comparisons of endOf.
func (c *cancelContext) stopAs(kind endKind, err, cause error) {
	perr, pcause := c.parentEnded() // before c.mu: see check
	c.mu.Lock()
	if c.ended != live {
		c.mu.Unlock()
		return
	}
	if e, ca := c.check(perr, pcause); e != nil {
		kind, err, cause = endOf(e), e, ca // it had ended, unseen
	}
	c.finish(c.endLocked(kind, err, cause))
}

// An ending is what [cancelContext.endLocked] leaves to do once c.mu is
// released.
type ending struct {
	watcher    *parentWatcher
	deadlines  *deadlineQueue
	stopParent func() bool
	timer      *time.Timer
	funcs      *ctxFunc
}

// endLocked ends c, live, with err, of the given kind, and cause: it
// closes the done channel, and hands over what is left to do without the
// lock. c.mu must be held.
func (c *cancelContext) endLocked(kind endKind, err, cause error) ending {
	c.ended, c.cause = kind, cause
	if kind == endOther {
		c.rare = &endState{err: err}
	}
	if c.done != nil {
		close(c.done)
	}
	e := ending{stopParent: c.stopParent, timer: c.timer, funcs: c.funcs}
	if c.watched && !c.byLease() {
		e.deadlines = c.deadlines()
	}
	if c.byWatcher {
		// Not otherwise: the watcher's lock is taken for nothing by a
		// context made under a parent that never ends, or that the
		// watcher had no room for.
		e.watcher = c.watcher()
	}
	c.stopParent, c.timer, c.funcs = nil, nil, nil
	for n := e.funcs; n != nil; n = n.next {
		n.due = true // its stop reports false from now on, and leaves the list be
	}
	return e
}

// finish unlocks c.mu, which must be held, and does what ending c left to
// do: it releases the watch and calls the callbacks of AfterFunc.
func (c *cancelContext) finish(e ending) {
	c.mu.Unlock()
	if e.timer != nil {
		e.timer.Stop()
	}
	if e.stopParent != nil {
		e.stopParent()
	}
	e.watcher.remove(c)
	e.deadlines.remove(c)
	for n := e.funcs; n != nil; n = n.next {
		n.f()
	}
}

// A deadlineQueue ends the watched contexts of one layer at their
// deadlines, which the layer sets a fixed time after each delivery's
// start: one timer serves them all (see [timerList]), where each would
// otherwise arm one of its own (two allocations, and two updates of the
// runtime's timers). A nil *deadlineQueue queues nothing.
type deadlineQueue struct {
	mu   *sync.Mutex // shared with Dedup's renewer
	list timerList[cancelContext, *cancelContext]
}

// newDeadlineQueue returns an empty deadlineQueue guarded by mu, which
// may guard other state too.
func newDeadlineQueue(mu *sync.Mutex) *deadlineQueue {
	q := &deadlineQueue{mu: mu}
	q.list.fire = q.fire
	return q
}

// add queues c, watched, until its deadline; now is the current time.
func (q *deadlineQueue) add(c *cancelContext, now time.Time) {
	q.mu.Lock()
	q.list.push(c, now)
	q.mu.Unlock()
}

// remove takes c out of the queue, if it is there.
func (q *deadlineQueue) remove(c *cancelContext) {
	if q == nil {
		return
	}
	q.mu.Lock()
	if c.shared.deadlineLinks.queued {
		q.list.unlink(c)
	}
	q.mu.Unlock()
}

// fire ends the contexts whose deadlines have passed, and arms the timer
// for the next.
func (q *deadlineQueue) fire() {
	q.mu.Lock()
	now, ok := q.list.fired()
	if !ok {
		q.mu.Unlock()
		return
	}
	var due []*cancelContext
	for c := q.list.due(now); c != nil; c = q.list.due(now) {
		q.list.unlink(c)
		due = append(due, c)
	}
	q.list.rearm(now)
	q.mu.Unlock()
	for _, c := range due {
		c.expire()
	}
}
