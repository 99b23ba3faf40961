package middleware

import (
	"context"
	"errors"
	"fmt"
	"slices"
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
	err   error // nil while live
	cause error // with err
	done  chan struct{}
	// What the watch holds, released at the end.
	stopParent func() bool
	timer      *time.Timer
	funcs      *ctxFunc        // the callbacks of AfterFunc, a list
	ended      context.Context // the standard library's context for the ended state, once asked for

	detached bool // the parent gives its values only
	watched  bool // the parent's end and the deadline are being watched
}

// A sharedWatch is what a cancelContext needs to be watched with its
// siblings, by a [parentWatcher] and a [deadlineQueue] that they share.
// Only the contexts that Dedup gives its handlers have one, in the same
// allocation ([claimContext]); the others (a Timeout layer's own, the
// contexts of the store calls that record an attempt) watch for
// themselves, and are the smaller for it.
type sharedWatch struct {
	// watcher, if set, watches the parent for it, and for its siblings.
	watcher *parentWatcher
	// deadlines, if set, ends it at its deadline, and its siblings at
	// theirs; else a timer of its own does.
	deadlines *deadlineQueue

	// Guarded by watcher.mu: c's place among the contexts it watches for.
	watchedBy    *watchedParent
	wprev, wnext *cancelContext
	// Guarded by deadlines.mu: its place among the deadlines.
	deadlineLinks timerLinks[cancelContext]
}

// links implements timerItem, for a c with a shared watch.
func (c *cancelContext) links() *timerLinks[cancelContext] { return &c.shared.deadlineLinks }

// watcher returns the parentWatcher that watches c's parent for c, or nil.
func (c *cancelContext) watcher() *parentWatcher {
	if c.shared == nil {
		return nil
	}
	return c.shared.watcher
}

// deadlines returns the deadlineQueue that ends c at its deadline, or nil.
func (c *cancelContext) deadlines() *deadlineQueue {
	if c.shared == nil {
		return nil
	}
	return c.shared.deadlines
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
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return err
	}
	err, cause := c.check()
	if err == nil {
		c.mu.Unlock()
		return nil
	}
	c.finish(c.endLocked(err, cause))
	return err
}

// causeNow returns what context.Cause(c) returns now: the cause of c's
// end, or nil if c is live. It takes c.mu once, where context.Cause
// reads c's Value (which asks c's parents) and then its Err.
func (c *cancelContext) causeNow() error {
	c.mu.Lock()
	if c.err == nil {
		err, cause := c.check()
		if err == nil {
			c.mu.Unlock()
			return nil
		}
		c.finish(c.endLocked(err, cause))
		c.mu.Lock()
	}
	cause := c.cause
	c.mu.Unlock()
	return cause
}

// check returns the error and cause with which c must end now, or nil if
// it is live, for a live c. An unwatched c reads the parent's error and
// the clock; a watched one only the parent's error, which the standard
// library's contexts set at once while they tell their watchers later.
// c.mu must be held.
func (c *cancelContext) check() (err, cause error) {
	if err, cause := c.parentEnded(); err != nil {
		return err, cause
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
		if c.err != nil {
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
	if c.err != nil {
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
	if c.err != nil || c.watched {
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
		c.finish(c.endLocked(err, cause))
		return
	}
	c.watched = true
	if !c.detached && c.parent.Done() != nil && !c.watcher().add(c) {
		parent := c.parent
		onEnd := func() { c.stop(parent.Err(), context.Cause(parent)) }
		if p, ok := parent.(interface{ AfterFunc(func()) func() bool }); ok {
			c.stopParent = p.AfterFunc(onEnd) // the parent ends c as it ends
		} else {
			c.stopParent = context.AfterFunc(parent, onEnd)
		}
	}
	switch {
	case c.deadline.IsZero():
	case c.deadlines() != nil:
		c.deadlines().add(c, now)
	default:
		c.timer = time.AfterFunc(left, c.expire)
	}
	c.mu.Unlock()
}

// expire ends c at its deadline.
func (c *cancelContext) expire() { c.stop(context.DeadlineExceeded, context.DeadlineExceeded) }

// Value implements context.Context.
func (c *cancelContext) Value(key any) any {
	c.mu.Lock()
	if c.err == nil {
		err, cause := c.check()
		if err == nil {
			c.mu.Unlock()
			return c.parent.Value(key)
		}
		c.finish(c.endLocked(err, cause))
		c.mu.Lock()
	}
	if c.ended == nil {
		c.ended = endedContext(c.parent, c.err, c.cause)
	}
	ended := c.ended
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
	c.stop(context.Canceled, cause)
}

// end is the CancelFunc of c: cancel with context.Canceled. A context
// that was watched must be ended, to release its timer and its place
// among its parent's watchers.
func (c *cancelContext) end() { c.cancel(nil) }

// stop ends c with err and cause unless it has ended already (seen or
// not).
func (c *cancelContext) stop(err, cause error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	if e, ca := c.check(); e != nil {
		err, cause = e, ca // it had ended, unseen
	}
	c.finish(c.endLocked(err, cause))
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

// endLocked ends c, live, with err and cause: it closes the done channel,
// and hands over what is left to do without the lock. c.mu must be held.
func (c *cancelContext) endLocked(err, cause error) ending {
	c.err, c.cause = err, cause
	if c.done != nil {
		close(c.done)
	}
	e := ending{stopParent: c.stopParent, timer: c.timer, funcs: c.funcs}
	if c.watched {
		e.watcher, e.deadlines = c.watcher(), c.deadlines()
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

// A parentWatcher watches, for the contexts that one layer makes, the end
// of the contexts they are made under, which are few (a consumer's, one
// per consumer that runs the layer) and live long: one registration with
// each (context.AfterFunc) serves all the contexts made under it, where
// each would otherwise make one of its own (and three allocations with
// it). The contexts it watches for are a list per parent, entered by
// [cancelContext.Done] and left at their end.
//
// A registration that costs no goroutine (under a parent of the standard
// library, or one with an AfterFunc method: see [watchesWithoutGoroutine])
// stays while its parent lives, for the next context, up to
// maxWatchedParents of them. One that costs a goroutine (under a parent
// whose Done the context package does not know, which context.AfterFunc
// watches with a goroutine of its own) ends when its last context leaves
// the list, and the goroutine with it: the next context under that parent
// registers again. So the watcher runs a goroutine only while a context
// made under such a parent is live, and never after the deliveries that
// needed it have returned.
//
// A context made under yet another parent, while each of those watches
// for some context, watches for itself. Its zero value is ready to use; a
// nil *parentWatcher watches nothing.
type parentWatcher struct {
	mu      sync.Mutex
	parents []*watchedParent
}

// maxWatchedParents bounds the registrations of a parentWatcher.
const maxWatchedParents = 8

// A watchedParent is a parent that a parentWatcher watches.
type watchedParent struct {
	parent context.Context
	done   <-chan struct{} // parent.Done(); nil once the registration has ended
	stop   func() bool     // ends the registration
	head   *cancelContext  // the contexts watched for
	// transient: the registration costs a goroutine, and ends as soon as
	// head is nil.
	transient bool
}

// add watches c's parent for c, and reports whether it does. c.mu must
// be held, and c's parent must have a Done channel.
func (w *parentWatcher) add(c *cancelContext) bool {
	if w == nil {
		return false
	}
	done := c.parent.Done()
	w.mu.Lock()
	defer w.mu.Unlock()
	p := w.find(done)
	if p == nil {
		if p = w.idle(); p == nil {
			return false // busy watching others
		}
		p.parent, p.done = c.parent, done
		p.transient = !watchesWithoutGoroutine(c.parent)
		p.stop = context.AfterFunc(c.parent, func() { w.fire(p, done) })
	}
	s := c.shared
	s.watchedBy, s.wprev, s.wnext = p, nil, p.head
	if p.head != nil {
		p.head.shared.wprev = c
	}
	p.head = c
	return true
}

// find returns the parent watched whose Done channel is done, or nil.
// w.mu must be held.
func (w *parentWatcher) find(done <-chan struct{}) *watchedParent {
	for _, p := range w.parents {
		if p.done == done {
			return p
		}
	}
	return nil
}

// idle returns a watchedParent to watch a new parent with: a new one, if
// there is room, else one that watches for no context, its registration
// ended; nil if there is none. w.mu must be held.
func (w *parentWatcher) idle() *watchedParent {
	if len(w.parents) < maxWatchedParents {
		p := new(watchedParent)
		w.parents = append(w.parents, p)
		return p
	}
	for _, p := range w.parents {
		if p.head == nil {
			p.stop()
			return p
		}
	}
	return nil
}

// remove stops watching for c, if w does.
func (w *parentWatcher) remove(c *cancelContext) {
	if w == nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := c.shared
	p := s.watchedBy
	if p == nil {
		return
	}
	if s.wprev != nil {
		s.wprev.shared.wnext = s.wnext
	} else {
		p.head = s.wnext
	}
	if s.wnext != nil {
		s.wnext.shared.wprev = s.wprev
	}
	s.watchedBy, s.wprev, s.wnext = nil, nil, nil
	if p.head == nil && p.transient {
		// Its goroutine has nothing left to watch for: end it. A callback
		// that has started all the same (the parent ended meanwhile)
		// finds p.done changed, and does nothing.
		p.stop()
		p.parent, p.done, p.stop = nil, nil, nil
		w.parents = slices.DeleteFunc(w.parents, func(q *watchedParent) bool { return q == p })
	}
}

// watchesWithoutGoroutine reports whether context.AfterFunc(parent, f)
// registers f without a goroutine: parent has an AfterFunc method, which
// context.AfterFunc calls, or the context package knows parent's Done
// channel as that of one of its own contexts (parent is one, or passes on
// the Done and Value of one), and registers f among its children. It
// tells them apart as the context package does: parent's Value, asked
// for the key of [contextPackageKey], answers the package's context whose
// Done channel is parent's (TestWatchesWithoutGoroutine holds it to what
// context.AfterFunc does). parent must have a Done channel.
func watchesWithoutGoroutine(parent context.Context) bool {
	if _, ok := parent.(interface{ AfterFunc(func()) func() bool }); ok {
		return true
	}
	key := contextPackageKey()
	if key == nil {
		return false // unknown: the registration is ended when idle, which is always safe
	}
	own, ok := parent.Value(key).(context.Context)
	return ok && own.Done() == parent.Done()
}

// contextPackageKey returns the key under which a context of the context
// package answers, to Value, the package's context it is or derives from,
// and which the package asks a parent for to tell whether it can attach a
// child without a goroutine. The key is unexported; context.Cause asks
// for it too, which is how it is found, once: it asks an ended context
// that records the first key it is asked for. Nil if it asks for none.
var contextPackageKey = sync.OnceValue(func() any {
	var k keyRecorder
	_ = context.Cause(&k)
	return k.key
})

// A keyRecorder is an ended context that records the first key its Value
// is asked for.
type keyRecorder struct {
	key   any
	asked bool
}

func (k *keyRecorder) Deadline() (time.Time, bool) { return time.Time{}, false }
func (k *keyRecorder) Err() error                  { return context.Canceled }

func (k *keyRecorder) Done() <-chan struct{} {
	done := make(chan struct{})
	close(done)
	return done
}

func (k *keyRecorder) Value(key any) any {
	if !k.asked {
		k.key, k.asked = key, true
	}
	return nil
}

// fire ends the contexts watched for under p, whose parent (with Done
// channel done) has ended, unless p has been given another parent since.
func (w *parentWatcher) fire(p *watchedParent, done <-chan struct{}) {
	w.mu.Lock()
	if p.done != done {
		w.mu.Unlock()
		return // a registration replaced, stopped too late
	}
	parent := p.parent
	var ended []*cancelContext
	for c := p.head; c != nil; {
		s := c.shared
		next := s.wnext
		s.watchedBy, s.wprev, s.wnext = nil, nil, nil
		ended = append(ended, c)
		c = next
	}
	w.parents = slices.DeleteFunc(w.parents, func(q *watchedParent) bool { return q == p })
	w.mu.Unlock()
	err, cause := parent.Err(), context.Cause(parent)
	for _, c := range ended {
		c.stop(err, cause)
	}
}

// A deadlineQueue ends the watched contexts of one layer at their
// deadlines, which the layer sets a fixed time after each delivery's
// start: one timer serves them all (see [timerList]), where each would
// otherwise arm one of its own (two allocations, and two updates of the
// runtime's timers). A nil *deadlineQueue queues nothing.
type deadlineQueue struct {
	mu   sync.Mutex
	list timerList[cancelContext, *cancelContext]
}

func newDeadlineQueue() *deadlineQueue {
	q := new(deadlineQueue)
	q.list.fire = q.fire
	return q
}

// add queues c, watched, until its deadline; now is the current time.
func (q *deadlineQueue) add(c *cancelContext, now time.Time) {
	q.mu.Lock()
	q.list.push(c, c.deadline, now)
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
