package middleware

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

// The contexts of one parentWatcher end with their parent, whether the
// watcher watches it for them (one registration per parent, up to
// maxWatchedParents) or they watch theirs themselves; each leaves the
// watcher's lists at its end.
func TestParentWatcher(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var w parentWatcher
		mk := func(parent context.Context) *cancelContext {
			c := &cancelContext{parent: parent, shared: &sharedWatch{by: &watchers{parents: &w}}}
			_ = c.Done()
			return c
		}
		watched := func(c *cancelContext) *watchedParent {
			w.mu.Lock()
			defer w.mu.Unlock()
			return c.shared.watchedBy
		}
		p1, cancel1 := context.WithCancelCause(valued())
		a, b := mk(p1), mk(context.WithValue(p1, ctxKey{}, "same Done"))
		early := mk(p1)
		early.end()
		assert.NotNil(t, watched(a))
		assert.Same(t, watched(a), watched(b), "one registration for one parent")
		assert.Nil(t, watched(early), "an ended context")

		// Up to maxWatchedParents parents are watched; a context under
		// one more, while each watches for a context, watches for itself.
		var others []*cancelContext
		var cancels []context.CancelCauseFunc
		for range maxWatchedParents {
			p, cancel := context.WithCancelCause(valued())
			others = append(others, mk(p))
			cancels = append(cancels, cancel)
		}
		for i, c := range others[:maxWatchedParents-1] {
			assert.NotNil(t, watched(c), "parent %d", i+2)
		}
		last := others[maxWatchedParents-1]
		assert.Nil(t, watched(last), "a context under one parent too many")

		// A parent whose contexts have all ended gives its place to a new
		// one; its registration is stopped.
		others[0].end()
		q, cancelQ := context.WithCancelCause(valued())
		reused := mk(q)
		assert.NotNil(t, watched(reused), "a context under a new parent, in the place of one that watches for none")
		cancels[0](errParentCause)
		cancelQ(errOwnCause)
		synctest.Wait()
		assert.Equal(t, errOwnCause, context.Cause(reused))
		others = others[1:]
		cancels = cancels[1:]

		cancel1(errParentCause)
		synctest.Wait()
		for name, c := range map[string]*cancelContext{"a": a, "b": b} {
			select {
			case <-c.Done():
			default:
				t.Errorf("%s: Done open after the parent's cancellation", name)
			}
			assert.Equal(t, context.Canceled, c.Err(), name)
			assert.Equal(t, errParentCause, context.Cause(c), name)
			assert.Nil(t, watched(c), name)
		}
		for i, c := range others {
			assert.NoError(t, c.Err(), "a context under parent %d", i+3)
		}
		// p1's place is free: the next new parent takes it.
		p, cancel := context.WithCancelCause(valued())
		next := mk(p)
		assert.NotNil(t, watched(next))
		cancel(errOwnCause)
		for _, cancel := range cancels {
			cancel(errOwnCause)
		}
		synctest.Wait()
		for i, c := range append(others, next) {
			assert.Equal(t, errOwnCause, context.Cause(c), "context %d", i)
		}
		w.mu.Lock()
		assert.Empty(t, w.parents, "parents left watched")
		w.mu.Unlock()
	})
}

// valueless is a context that passes on its parent's end but none of its
// values: the context package, which finds its own contexts through
// Value, does not know its Done channel, and watches it with a goroutine.
type valueless struct{ context.Context }

func (valueless) Value(any) any { return nil }

// embedded passes on everything of its parent.
type embedded struct{ context.Context }

// watchesWithoutGoroutine says of each kind of parent what
// context.AfterFunc does with it: whether it starts a goroutine.
func TestWatchesWithoutGoroutine(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	timed, cancelTimed := context.WithTimeout(context.Background(), time.Hour)
	defer cancelTimed()
	own := &cancelContext{parent: parent}
	defer own.end()
	for _, tc := range []struct {
		name   string
		parent context.Context
		want   bool
	}{
		{"WithCancel", parent, true},
		{"WithTimeout", timed, true},
		{"WithValue of WithCancel", context.WithValue(parent, ctxKey{}, 1), true},
		{"a type that embeds WithCancel", embedded{parent}, true},
		{"a cancelContext (an AfterFunc method)", own, true},
		{"a type whose Value hides WithCancel's", valueless{parent}, false},
		{"WithValue of that type", context.WithValue(valueless{parent}, ctxKey{}, 1), false},
	} {
		assert.Equal(t, tc.want, watchesWithoutGoroutine(tc.parent), tc.name)
		// And context.AfterFunc agrees.
		before := goleak.IgnoreCurrent()
		stop := context.AfterFunc(tc.parent, func() {})
		started := goleak.Find(before) != nil
		stop()
		assert.Equal(t, tc.want, !started, "%s: context.AfterFunc started no goroutine", tc.name)
	}
}

// A parentWatcher keeps the registration of a parent that costs no
// goroutine while the parent lives, and reuses it, allocating nothing;
// that of a parent that costs a goroutine ends, goroutine and all, when
// its last context ends, and is made again for the next. Contexts made
// after it ended still end with their parent.
func TestParentWatcherRegistrations(t *testing.T) {
	for _, tc := range []struct {
		name      string
		parent    func(context.Context) context.Context
		transient bool
	}{
		{"WithCancel", func(ctx context.Context) context.Context { return ctx }, false},
		{"a parent the context package does not know", func(ctx context.Context) context.Context { return valueless{ctx} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var w parentWatcher
				ws := &watchers{parents: &w}
				base, cancel := context.WithCancelCause(context.Background())
				parent := tc.parent(base)
				mk := func() *claimContext {
					c := newClaimContext(parent, "k", "t", time.Hour, time.Time{}, ws)
					c.watch(time.Time{})
					return c
				}
				registered := func() int {
					w.mu.Lock()
					defer w.mu.Unlock()
					return len(w.parents)
				}
				before := goleak.IgnoreCurrent()
				for range 3 {
					a, b := mk(), mk()
					assert.Equal(t, 1, registered(), "while contexts are watched for")
					a.end()
					assert.Equal(t, 1, registered(), "while one context is watched for")
					b.end()
					synctest.Wait()
					if tc.transient {
						assert.Zero(t, registered(), "once none is")
						assert.NoError(t, goleak.Find(before), "once none is")
					} else {
						assert.Equal(t, 1, registered(), "once none is")
					}
				}
				if !tc.transient {
					n := testing.AllocsPerRun(100, func() { mk().end() })
					assert.LessOrEqual(t, n, 1.0, "allocations per watched context (itself)")
				}
				live := mk()
				cancel(errParentCause)
				synctest.Wait()
				assert.Equal(t, context.Canceled, live.Err())
				assert.Equal(t, context.Cause(parent), context.Cause(live))
				assert.Zero(t, registered(), "once the parent has ended")
			})
		})
	}
}
