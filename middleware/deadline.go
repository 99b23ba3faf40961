package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// A lazyDeadline is a context with a deadline that allocates its done
// channel and its timer only when someone asks for them. A handler that
// never calls Done (nor derives a context, nor registers an AfterFunc,
// which call Done) costs one allocation instead of
// context.WithDeadline's four.
//
// It behaves as context.WithDeadline(parent, deadline) would:
//   - Deadline is the earlier of the parent's deadline and its own.
//   - Err is nil until the parent ends, the deadline passes or end is
//     called, and then the same error ever after: the parent's error,
//     context.DeadlineExceeded or context.Canceled. Without a channel to
//     close, "passes" is read from the clock when Err is called; the first
//     non-nil answer is kept, so it never changes.
//   - Done, on its first call, builds the standard library's context for
//     the same state (a live context.WithDeadline of the parent, or one
//     already ended with the kept error and cause) and answers from it
//     from then on, Err included.
//   - Value is the parent's; once the context has ended it is the built
//     context's, so that context.Cause sees this context's own cause and
//     not the parent's.
type lazyDeadline struct {
	parent   context.Context
	deadline time.Time

	mu     sync.Mutex
	err    error // the kept error, nil while live
	cause  error // the kept cause, with err
	real   context.Context
	cancel context.CancelFunc
}

func newLazyDeadline(parent context.Context, deadline time.Time) *lazyDeadline {
	return &lazyDeadline{parent: parent, deadline: deadline}
}

// Deadline implements context.Context.
func (c *lazyDeadline) Deadline() (time.Time, bool) {
	if d, ok := c.parent.Deadline(); ok && d.Before(c.deadline) {
		return d, true
	}
	return c.deadline, true
}

// Err implements context.Context.
func (c *lazyDeadline) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.real != nil {
		return c.real.Err()
	}
	return c.check()
}

// check keeps and returns the error of an ended context, nil if it is
// still live. It is called with c.mu held and c.real nil.
func (c *lazyDeadline) check() error {
	if c.err != nil {
		return c.err
	}
	if err := c.parent.Err(); err != nil {
		c.err, c.cause = err, context.Cause(c.parent)
	} else if !time.Now().Before(c.deadline) {
		c.err, c.cause = context.DeadlineExceeded, context.DeadlineExceeded
	}
	return c.err
}

// Done implements context.Context.
func (c *lazyDeadline) Done() <-chan struct{} {
	return c.materialize().Done()
}

// Value implements context.Context.
func (c *lazyDeadline) Value(key any) any {
	c.mu.Lock()
	if c.real == nil && c.check() == nil {
		c.mu.Unlock()
		return c.parent.Value(key)
	}
	c.mu.Unlock()
	return c.materialize().Value(key)
}

// String names the context as the standard library's do.
func (c *lazyDeadline) String() string {
	return fmt.Sprintf("%v.WithDeadline(%v)", c.parent, c.deadline)
}

// materialize returns the standard library's context for c's state,
// building it on the first call.
func (c *lazyDeadline) materialize() context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.real != nil {
		return c.real
	}
	if c.check() == nil {
		c.real, c.cancel = context.WithDeadline(c.parent, c.deadline)
		return c.real
	}
	// Ended: a context that reports the kept error and cause, with the
	// parent's values and without its cancellation, which can no longer
	// change anything.
	base := context.WithoutCancel(c.parent)
	if errors.Is(c.err, context.DeadlineExceeded) {
		c.real, c.cancel = context.WithDeadlineCause(base, time.Time{}, c.cause)
		return c.real
	}
	ctx, cancel := context.WithCancelCause(base)
	cancel(c.cause)
	c.real, c.cancel = ctx, func() {}
	return c.real
}

// end is the CancelFunc of c: it ends c with context.Canceled unless it
// had already ended, and releases its timer if it had one.
func (c *lazyDeadline) end() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.real != nil {
		c.cancel()
		return
	}
	if c.check() == nil {
		c.err, c.cause = context.Canceled, context.Canceled
	}
}
