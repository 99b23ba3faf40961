package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// A lazyContext is a context that can be cancelled, and may have a
// deadline of its own, but allocates its done channel (and its timer) only
// when someone asks for them. A handler that never calls Done (nor derives
// a context, nor registers an AfterFunc, which call Done) costs no
// allocation beyond the lazyContext, instead of context.WithCancelCause's
// two or context.WithDeadline's four.
//
// It behaves as context.WithCancelCause(parent) would, or, with a deadline,
// as context.WithDeadline(parent, deadline):
//   - Deadline is the parent's, or the earlier of the parent's and its
//     own.
//   - Err is nil until the parent ends, the deadline passes or cancel is
//     called, and then the same error ever after: the parent's error,
//     context.DeadlineExceeded or context.Canceled. Without a channel to
//     close, "passes" and "ends" are read when Err is called; the first
//     non-nil answer is kept, with its cause, so it never changes.
//   - Done, on its first call, builds the standard library's context for
//     the same state (a live context.WithCancelCause or WithDeadline of the
//     parent, or one already ended with the kept error and cause) and
//     answers from it from then on, Err included. Its Value answers for
//     the context package's own key, so that a context derived from the
//     lazyContext (context.WithTimeout by the handler) joins the built
//     context's children, as it would join the standard library's,
//     instead of watching it from a goroutine.
//   - Value is the parent's; once the context has ended it is the built
//     context's, so that context.Cause sees this context's own cause and
//     not the parent's.
//
// Its zero value is not usable: set parent, and deadline if it has one.
type lazyContext struct {
	parent   context.Context
	deadline time.Time // its own deadline; zero if it has none

	mu    sync.Mutex
	err   error // the kept error, nil while live
	cause error // the kept cause, with err
	real  context.Context
	// real's cancel function: stop with a deadline, else stopCause.
	stop      context.CancelFunc
	stopCause context.CancelCauseFunc
}

// newLazyDeadline returns the lazyContext of [Timeout]: parent with a
// deadline.
func newLazyDeadline(parent context.Context, deadline time.Time) *lazyContext {
	return &lazyContext{parent: parent, deadline: deadline}
}

// Deadline implements context.Context.
func (c *lazyContext) Deadline() (time.Time, bool) {
	d, ok := c.parent.Deadline()
	if c.deadline.IsZero() || ok && d.Before(c.deadline) {
		return d, ok
	}
	return c.deadline, true
}

// Err implements context.Context.
func (c *lazyContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.real != nil {
		return c.real.Err()
	}
	return c.check()
}

// check keeps and returns the error of an ended context, nil if it is
// still live. It is called with c.mu held and c.real nil.
func (c *lazyContext) check() error {
	if c.err != nil {
		return c.err
	}
	if err := c.parent.Err(); err != nil {
		c.err, c.cause = err, context.Cause(c.parent)
	} else if !c.deadline.IsZero() && !time.Now().Before(c.deadline) {
		c.err, c.cause = context.DeadlineExceeded, context.DeadlineExceeded
	}
	return c.err
}

// Done implements context.Context.
func (c *lazyContext) Done() <-chan struct{} {
	return c.materialize().Done()
}

// Value implements context.Context.
func (c *lazyContext) Value(key any) any {
	c.mu.Lock()
	if c.real == nil && c.check() == nil {
		c.mu.Unlock()
		return c.parent.Value(key)
	}
	c.mu.Unlock()
	return c.materialize().Value(key)
}

// String names the context as the standard library's do.
func (c *lazyContext) String() string {
	if c.deadline.IsZero() {
		return fmt.Sprintf("%v.WithCancel", c.parent)
	}
	return fmt.Sprintf("%v.WithDeadline(%v)", c.parent, c.deadline)
}

// materialize returns the standard library's context for c's state,
// building it on the first call.
func (c *lazyContext) materialize() context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.real != nil {
		return c.real
	}
	switch {
	case c.check() == nil && c.deadline.IsZero():
		c.real, c.stopCause = context.WithCancelCause(c.parent)
		return c.real
	case c.err == nil:
		c.real, c.stop = context.WithDeadline(c.parent, c.deadline)
		return c.real
	}
	// Ended: a context that reports the kept error and cause, with the
	// parent's values and without its cancellation, which can no longer
	// change anything.
	base := context.WithoutCancel(c.parent)
	if errors.Is(c.err, context.DeadlineExceeded) {
		c.real, c.stop = context.WithDeadlineCause(base, time.Time{}, c.cause)
		return c.real
	}
	c.real, c.stopCause = context.WithCancelCause(base)
	c.stopCause(c.cause)
	return c.real
}

// cancel ends c with context.Canceled and the given cause
// (context.Canceled if nil) unless it had already ended, and releases its
// timer if it had one. A context with a deadline of its own is cancelled
// with end only: once it has been built, a cause would be lost.
func (c *lazyContext) cancel(cause error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.stopCause != nil:
		c.stopCause(cause)
	case c.stop != nil:
		c.stop()
	case c.check() == nil:
		if cause == nil {
			cause = context.Canceled
		}
		c.err, c.cause = context.Canceled, cause
	}
}

// end is the CancelFunc of c: cancel with context.Canceled.
func (c *lazyContext) end() { c.cancel(nil) }
