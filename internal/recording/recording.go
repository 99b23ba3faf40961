// Package recording lets the layers that record a finished attempt in a
// store (a done mark, a release, a failure count, a transaction's commit)
// tell the consumer that runs them that they are still writing. Those
// writes run after the handler returned, under a context its cancellation
// does not end; a consumer that stops, and so lets its process exit, waits
// for them until their deadlines, rather than lose a done mark and let the
// message's effect repeat.
package recording

import (
	"context"
	"sync"
	"time"
)

// A Tracker counts the writes in progress under the contexts that carry it
// (see [With]). The zero value is ready to use; it is safe for concurrent
// use.
type Tracker struct {
	mu    sync.Mutex
	n     int
	until time.Time // the latest deadline of the writes in progress
}

type trackerKey struct{}

// With returns ctx carrying t: the writes begun under it, or under a
// context derived from it, are counted by t.
func With(ctx context.Context, t *Tracker) context.Context {
	return context.WithValue(ctx, trackerKey{}, t)
}

// Begin records that a write, which ends by deadline at the latest, is
// under way for the attempt that ran under ctx, and returns the tracker
// that counts it, or nil if ctx carries none. The caller ends it with
// [Tracker.End] (which a nil Tracker allows).
func Begin(ctx context.Context, deadline time.Time) *Tracker {
	t, _ := ctx.Value(trackerKey{}).(*Tracker)
	if t == nil {
		return nil
	}
	t.mu.Lock()
	t.n++
	if deadline.After(t.until) {
		t.until = deadline
	}
	t.mu.Unlock()
	return t
}

// End records that a write begun by [Begin] has ended.
func (t *Tracker) End() {
	if t == nil {
		return
	}
	t.mu.Lock()
	t.n--
	if t.n == 0 {
		t.until = time.Time{}
	}
	t.mu.Unlock()
}

// Pending returns the number of writes in progress, and the latest of
// their deadlines.
func (t *Tracker) Pending() (n int, until time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.n, t.until
}
