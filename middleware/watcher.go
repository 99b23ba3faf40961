package middleware

import (
	"context"
	"slices"
	"sync"
	"time"
)

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
