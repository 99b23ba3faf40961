package middleware

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// withDeadline makes a context with a deadline and its cancel function:
// the standard library's, or Timeout's cancelContext.
type withDeadline func(parent context.Context, d time.Time) (context.Context, context.CancelFunc)

var deadlineImpls = map[string]withDeadline{
	"stdlib": context.WithDeadline,
	"own": func(parent context.Context, d time.Time) (context.Context, context.CancelFunc) {
		c := &cancelContext{parent: parent, deadline: d}
		return c, c.end
	},
	"own, its deadline served by a deadlineQueue": func(parent context.Context, d time.Time) (context.Context, context.CancelFunc) {
		c := &cancelContext{parent: parent, deadline: d, shared: &sharedWatch{by: &watchers{deadlines: newDeadlineQueue(new(sync.Mutex))}}}
		return c, c.end
	},
}

type ctxKey struct{}

var errParentCause = errors.New("the parent's cause")

// observed is what a scenario saw of a context, at its end.
type observed struct {
	err, cause error
	deadline   time.Time
	done       bool // Done was closed
	value      any
	afterFunc  bool // an AfterFunc registered on it ran
	child      error
	// The error and cause of a context derived from it, read as soon as
	// the scenario ended it: nil if the derived context is told through a
	// goroutine rather than at once.
	syncChild, syncChildCause error
}

// The scenarios, each run on both implementations inside a synctest
// bubble, whose clock starts at the same instant: the cancelContext must be
// seen exactly as the standard library's context.
var deadlineScenarios = []scenario[withDeadline]{
	{"deadline passes, Done never called", func(mk withDeadline) observed {
		ctx, cancel := mk(valued(), time.Now().Add(time.Second))
		defer cancel()
		time.Sleep(2 * time.Second)
		return observe(ctx, false)
	}},
	{"deadline passes while Done is watched", func(mk withDeadline) observed {
		ctx, cancel := mk(valued(), time.Now().Add(time.Second))
		defer cancel()
		<-ctx.Done()
		return observe(ctx, false)
	}},
	{"not yet due", func(mk withDeadline) observed {
		ctx, cancel := mk(valued(), time.Now().Add(time.Second))
		defer cancel()
		return observe(ctx, false)
	}},
	{"cancelled by its CancelFunc", func(mk withDeadline) observed {
		ctx, cancel := mk(valued(), time.Now().Add(time.Second))
		cancel()
		return observe(ctx, false)
	}},
	{"cancelled after its deadline passed", func(mk withDeadline) observed {
		ctx, cancel := mk(valued(), time.Now().Add(time.Second))
		time.Sleep(2 * time.Second)
		cancel()
		return observe(ctx, false)
	}},
	{"the parent cancelled with a cause", func(mk withDeadline) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent, time.Now().Add(time.Second))
		defer cancel()
		pcancel(errParentCause)
		return observe(ctx, false)
	}},
	{"the parent cancelled while Done is watched", func(mk withDeadline) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent, time.Now().Add(time.Second))
		defer cancel()
		go func() { time.Sleep(time.Millisecond); pcancel(errParentCause) }()
		<-ctx.Done()
		return observe(ctx, false)
	}},
	{"the parent already done", func(mk withDeadline) observed {
		parent, pcancel := context.WithCancelCause(valued())
		pcancel(errParentCause)
		ctx, cancel := mk(parent, time.Now().Add(time.Second))
		defer cancel()
		return observe(ctx, false)
	}},
	{"the parent's earlier deadline", func(mk withDeadline) observed {
		parent, pcancel := context.WithTimeout(valued(), time.Second)
		defer pcancel()
		ctx, cancel := mk(parent, time.Now().Add(time.Hour))
		defer cancel()
		time.Sleep(2 * time.Second)
		return observe(ctx, false)
	}},
	{"the deadline already past", func(mk withDeadline) observed {
		ctx, cancel := mk(valued(), time.Now().Add(-time.Second))
		defer cancel()
		return observe(ctx, false)
	}},
	{"AfterFunc and a child, at the deadline", func(mk withDeadline) observed {
		ctx, cancel := mk(valued(), time.Now().Add(time.Second))
		defer cancel()
		return observe(ctx, true)
	}},
	{"AfterFunc and a child, at the parent's cancellation", func(mk withDeadline) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent, time.Now().Add(time.Hour))
		defer cancel()
		go func() { time.Sleep(time.Second); pcancel(errParentCause) }()
		return observe(ctx, true)
	}},
	{"the error stays once seen", func(mk withDeadline) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent, time.Now().Add(time.Second))
		defer cancel()
		time.Sleep(2 * time.Second)
		_ = ctx.Err()
		pcancel(errParentCause)
		return observe(ctx, false)
	}},
}

func valued() context.Context { return context.WithValue(context.Background(), ctxKey{}, "v") }

// observe reads ctx; with watch, it first registers an AfterFunc and
// derives a child, and waits for both to see ctx end.
func observe(ctx context.Context, watch bool) observed {
	var o observed
	if watch {
		ran := make(chan struct{})
		context.AfterFunc(ctx, func() { close(ran) })
		child, cancel := context.WithCancel(ctx)
		defer cancel()
		<-child.Done()
		<-ran
		o.afterFunc, o.child = true, child.Err()
	}
	o.err, o.cause = ctx.Err(), context.Cause(ctx)
	o.deadline, _ = ctx.Deadline()
	o.value = ctx.Value(ctxKey{})
	select {
	case <-ctx.Done():
		o.done = true
	default:
	}
	// What was seen stays.
	if err := ctx.Err(); err != o.err {
		o.err = errors.New("Err changed")
	}
	return o
}

func TestDeadlineContextAsStdlib(t *testing.T) { asStdlib(t, deadlineImpls, deadlineScenarios) }

// detachedImpls make a detached context with a deadline, as settling
// makes for the store calls that record an attempt: the standard
// library's context.WithDeadline(context.WithoutCancel(parent), d), or
// our own.
var detachedImpls = map[string]withDeadline{
	"stdlib": func(parent context.Context, d time.Time) (context.Context, context.CancelFunc) {
		return context.WithDeadline(context.WithoutCancel(parent), d)
	},
	"own": func(parent context.Context, d time.Time) (context.Context, context.CancelFunc) {
		c := &cancelContext{parent: parent, deadline: d, detached: true}
		return c, c.end
	},
}

// A detached context is seen as the standard library's, whatever its
// parent does.
func TestDetachedContextAsStdlib(t *testing.T) { asStdlib(t, detachedImpls, deadlineScenarios) }

// A scenario does something to a context made by mk, and says what it saw.
type scenario[M any] struct {
	name string
	run  func(mk M) observed
}

// asStdlib runs each scenario on both implementations, each in a synctest
// bubble whose clock starts at the same instant, and fails where our own
// one is not seen exactly as the standard library's.
func asStdlib[M any](t *testing.T, impls map[string]M, scenarios []scenario[M]) {
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			got := map[string]observed{}
			for name, mk := range impls {
				synctest.Test(t, func(t *testing.T) {
					got[name] = sc.run(mk)
				})
			}
			for name, o := range got {
				if o != got["stdlib"] {
					t.Errorf("%s: %+v\nwant as stdlib: %+v", name, o, got["stdlib"])
				}
			}
		})
	}
}

// Many goroutines asking for Done at once get one channel, closed at the
// deadline (run with -race).
func TestDeadlineContextConcurrentDone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := &cancelContext{parent: context.Background(), deadline: time.Now().Add(time.Second)}
		defer c.end()
		chans := make([]<-chan struct{}, 8)
		var wg sync.WaitGroup
		for i := range chans {
			wg.Go(func() {
				_ = c.Err()
				chans[i] = c.Done()
				<-chans[i]
			})
		}
		wg.Wait()
		for _, ch := range chans[1:] {
			if ch != chans[0] {
				t.Fatal("concurrent Done calls returned different channels")
			}
		}
		if err := c.Err(); err != context.DeadlineExceeded {
			t.Errorf("Err = %v; want DeadlineExceeded", err)
		}
	})
}

// Unwatched, the context allocates nothing beyond itself.
func TestDeadlineContextAllocs(t *testing.T) {
	parent := context.Background()
	d := time.Now().Add(time.Hour)
	n := testing.AllocsPerRun(100, func() {
		c := &cancelContext{parent: parent, deadline: d}
		_ = c.Err()
		_, _ = c.Deadline()
		c.end()
	})
	if n > 1 {
		t.Errorf("%v allocations per unwatched context; want 1", n)
	}
}

// withCancel makes a cancellable context and its cancel function: the
// standard library's, or the claimContext that Dedup gives the handler.
type withCancel func(parent context.Context) (context.Context, context.CancelCauseFunc)

var cancelImpls = map[string]withCancel{
	"stdlib": context.WithCancelCause,
	"own": func(parent context.Context) (context.Context, context.CancelCauseFunc) {
		c := newClaimContext(parent, "k", "t", time.Hour, time.Time{}, nil)
		return c, c.cancel
	},
	"own, its parent watched by a parentWatcher": func(parent context.Context) (context.Context, context.CancelCauseFunc) {
		c := newClaimContext(parent, "k", "t", time.Hour, time.Time{}, &watchers{parents: new(parentWatcher)})
		return c, c.cancel
	},
}

var errOwnCause = errors.New("the context's own cause")

// oddEnd is a parent that ends as its parent does, but with an error of
// its own, errOddEnd, outside the context contract: a context derived
// from it passes that error on as it is. Like valueless, it hides its
// parent's values, so that the context package watches it with a
// goroutine, and asks its Err.
type oddEnd struct{ context.Context }

var errOddEnd = errors.New("an end of another kind")

func (oddEnd) Value(any) any { return nil }

func (c oddEnd) Err() error {
	if c.Context.Err() != nil {
		return errOddEnd
	}
	return nil
}

// The scenarios, each run on both implementations inside a synctest
// bubble: claimContext must be seen exactly as context.WithCancelCause.
var cancelScenarios = []scenario[withCancel]{
	{"live", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		defer cancel(nil)
		return observe(ctx, false)
	}},
	{"cancelled with a cause, Done never called", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		cancel(errOwnCause)
		return observe(ctx, false)
	}},
	{"cancelled without a cause", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		cancel(nil)
		return observe(ctx, false)
	}},
	{"cancelled twice: the first cause stays", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		cancel(errOwnCause)
		cancel(errParentCause)
		return observe(ctx, false)
	}},
	{"cancelled after Done was called", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		_ = ctx.Done()
		cancel(errOwnCause)
		return observe(ctx, false)
	}},
	{"cancelled while Done is watched", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		go func() { time.Sleep(time.Second); cancel(errOwnCause) }()
		<-ctx.Done()
		return observe(ctx, false)
	}},
	{"the parent cancelled with a cause, Done never called", func(mk withCancel) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent)
		defer cancel(nil)
		pcancel(errParentCause)
		return observe(ctx, false)
	}},
	{"the parent cancelled while Done is watched", func(mk withCancel) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent)
		defer cancel(nil)
		go func() { time.Sleep(time.Second); pcancel(errParentCause) }()
		<-ctx.Done()
		return observe(ctx, false)
	}},
	{"the parent already done", func(mk withCancel) observed {
		parent, pcancel := context.WithCancelCause(valued())
		pcancel(errParentCause)
		ctx, cancel := mk(parent)
		defer cancel(nil)
		return observe(ctx, false)
	}},
	{"the parent ends with an error of another kind", func(mk withCancel) observed {
		base, bcancel := context.WithCancel(valued())
		ctx, cancel := mk(oddEnd{base})
		defer cancel(nil)
		bcancel()
		synctest.Wait() // the standard library's goroutine that watches the parent
		return observe(ctx, false)
	}},
	{"the parent ends with an error of another kind while Done is watched", func(mk withCancel) observed {
		base, bcancel := context.WithCancel(valued())
		ctx, cancel := mk(oddEnd{base})
		defer cancel(nil)
		go func() { time.Sleep(time.Second); bcancel() }()
		<-ctx.Done()
		return observe(ctx, true)
	}},
	{"the parent's deadline passes", func(mk withCancel) observed {
		parent, pcancel := context.WithTimeout(valued(), time.Second)
		defer pcancel()
		ctx, cancel := mk(parent)
		defer cancel(nil)
		time.Sleep(2 * time.Second)
		return observe(ctx, false)
	}},
	{"cancelled, then the parent: its own cause stays", func(mk withCancel) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent)
		cancel(errOwnCause)
		pcancel(errParentCause)
		return observe(ctx, false)
	}},
	{"the parent's cause stays once seen", func(mk withCancel) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent)
		pcancel(errParentCause)
		_ = ctx.Err()
		cancel(errOwnCause)
		return observe(ctx, false)
	}},
	{"AfterFunc and a child, at its cancellation", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		go func() { time.Sleep(time.Second); cancel(errOwnCause) }()
		return observe(ctx, true)
	}},
	{"AfterFunc and a child, at the parent's cancellation", func(mk withCancel) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent)
		defer cancel(nil)
		go func() { time.Sleep(time.Second); pcancel(errParentCause) }()
		return observe(ctx, true)
	}},
	{"a child WithTimeout, at its cancellation", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		child, ccancel := context.WithTimeout(ctx, time.Hour)
		defer ccancel()
		cancel(errOwnCause)
		o := observed{syncChild: child.Err(), syncChildCause: context.Cause(child)}
		return merge(o, observe(ctx, false))
	}},
	{"a child WithTimeout, at the parent's cancellation", func(mk withCancel) observed {
		parent, pcancel := context.WithCancelCause(valued())
		ctx, cancel := mk(parent)
		defer cancel(nil)
		child, ccancel := context.WithTimeout(ctx, time.Hour)
		defer ccancel()
		pcancel(errParentCause)
		// The end of a parent of the standard library reaches our own
		// context through context.AfterFunc, on a goroutine, and so its
		// children a moment later.
		synctest.Wait()
		o := observed{syncChild: child.Err(), syncChildCause: context.Cause(child)}
		return merge(o, observe(ctx, false))
	}},
}

// merge returns o with what observe saw.
func merge(o, seen observed) observed {
	seen.syncChild, seen.syncChildCause = o.syncChild, o.syncChildCause
	return seen
}

func TestClaimContextAsStdlib(t *testing.T) { asStdlib(t, cancelImpls, cancelScenarios) }

// The Claim is found through the handler's context, and through contexts
// derived from it, live or ended.
func TestClaimContextValue(t *testing.T) {
	c := newClaimContext(valued(), "k", "t", time.Hour, time.Time{}, nil)
	child, cancel := context.WithTimeout(context.WithValue(c, ctxKey{}, "child"), time.Hour)
	defer cancel()
	for _, ended := range []bool{false, true} {
		if ended {
			c.cancel(errOwnCause)
		}
		for name, ctx := range map[string]context.Context{"the handler's": c, "a derived": child} {
			if got, ok := ClaimFrom(ctx); !ok || got != &c.claim {
				t.Errorf("ended %v: ClaimFrom(%s context) = %p, %v; want %p, true", ended, name, got, ok, &c.claim)
			}
		}
		if got := c.Value(ctxKey{}); got != "v" {
			t.Errorf("ended %v: Value(ctxKey) = %v; want the parent's v", ended, got)
		}
	}
}

// A context derived from the handler's context (through Timeout's, as
// in the stack) joins the built context's children: no goroutine watches
// it.
func TestClaimContextChildWithoutGoroutine(t *testing.T) {
	parent, pcancel := context.WithCancel(context.Background())
	defer pcancel()
	c := newClaimContext(parent, "k", "t", time.Hour, time.Time{}, nil)
	defer c.end()
	tctx := &cancelContext{parent: c, deadline: time.Now().Add(time.Hour)}
	defer tctx.end()
	before := goleak.IgnoreCurrent()
	child, cancel := context.WithTimeout(tctx, time.Minute)
	defer cancel()
	assert.NoError(t, goleak.Find(before), "context.WithTimeout(the handler's context) started a goroutine")
	c.cancel(errOwnCause)
	if err := context.Cause(child); err != errOwnCause {
		t.Errorf("Cause(child) at once after the cancellation = %v; want %v", err, errOwnCause)
	}
}

// endCause, which Dedup calls instead of context.Cause and end, answers
// as context.Cause does, whether the context is live, cancelled with a
// cause, ended by its parent or past its deadline unseen, and then leaves
// the context as end does.
func TestCancelContextEndCause(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		for _, tc := range []struct {
			name string
			end  func(c *claimContext, pcancel context.CancelCauseFunc)
			want error
		}{
			{"live", func(*claimContext, context.CancelCauseFunc) {}, nil},
			{"cancelled", func(c *claimContext, _ context.CancelCauseFunc) { c.cancel(errOwnCause) }, errOwnCause},
			{"the parent cancelled", func(_ *claimContext, pcancel context.CancelCauseFunc) { pcancel(errParentCause) }, errParentCause},
			{"past its deadline", func(*claimContext, context.CancelCauseFunc) { time.Sleep(2 * time.Second) }, context.DeadlineExceeded},
		} {
			var got, after [2]error
			for i, cause := range []func(*claimContext) error{
				func(c *claimContext) error { err := context.Cause(c); c.end(); return err },
				(*claimContext).endCause,
			} {
				parent, pcancel := context.WithCancelCause(valued())
				c := newClaimContext(parent, "k", "t", time.Hour, time.Now().Add(time.Second), nil)
				tc.end(c, pcancel)
				got[i] = cause(c)
				after[i] = context.Cause(c)
				select {
				case <-c.Done():
				default:
					t.Errorf("%s: Done not closed after the end", tc.name)
				}
				c.end()
				pcancel(nil)
			}
			assert.Equal(t, tc.want, got[0], "%s: context.Cause", tc.name)
			assert.Equal(t, got[0], got[1], "%s: endCause", tc.name)
			assert.Equal(t, after[0], after[1], "%s: context.Cause after the end", tc.name)
		}
	})
}

// Many goroutines asking for Done while the context is cancelled get one
// channel, closed with the cause (run with -race).
func TestClaimContextConcurrentCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newClaimContext(context.Background(), "k", "t", time.Hour, time.Time{}, nil)
		chans := make([]<-chan struct{}, 8)
		var wg sync.WaitGroup
		for i := range chans {
			wg.Go(func() {
				_ = c.Err()
				chans[i] = c.Done()
				<-chans[i]
			})
		}
		wg.Go(func() { c.cancel(errOwnCause) })
		wg.Wait()
		for _, ch := range chans[1:] {
			if ch != chans[0] {
				t.Fatal("concurrent Done calls returned different channels")
			}
		}
		if err := context.Cause(c); err != errOwnCause {
			t.Errorf("Cause = %v; want %v", err, errOwnCause)
		}
	})
}

// Unwatched, the handler's context allocates nothing beyond itself.
func TestClaimContextAllocs(t *testing.T) {
	parent := context.Background()
	n := testing.AllocsPerRun(100, func() {
		c := newClaimContext(parent, "k", "t", time.Hour, time.Time{}, nil)
		_ = c.Err()
		_, _ = c.Deadline()
		_, _ = ClaimFrom(c)
		_ = context.Cause(c)
		c.end()
	})
	if n > 1 {
		t.Errorf("%v allocations per unwatched context; want 1", n)
	}
}

// A callback that context.AfterFunc registers on our own context runs at
// its end unless stopped first, as on the standard library's.
func TestCancelContextAfterFuncStop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := &cancelContext{parent: context.Background()}
		ran := make(chan string, 2)
		stopKept := context.AfterFunc(c, func() { ran <- "kept" })
		stopStopped := context.AfterFunc(c, func() { ran <- "stopped" })
		assert.True(t, stopStopped(), "stop before the end")
		c.cancel(errOwnCause)
		synctest.Wait()
		assert.False(t, stopKept(), "stop after the end")
		close(ran)
		var got []string
		for r := range ran {
			got = append(got, r)
		}
		assert.Equal(t, []string{"kept"}, got)
		// Registered once it has ended: it runs at once.
		late := make(chan struct{})
		context.AfterFunc(c, func() { close(late) })
		<-late
	})
}

// Contexts whose parent ends, whose deadline passes and which are ended,
// all at once, while contexts are derived from them and callbacks
// registered and stopped, all end once, with one of those errors, and
// take their children with them (run with -race).
func TestCancelContextConcurrentEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var w parentWatcher
		q := newDeadlineQueue(new(sync.Mutex))
		parent, pcancel := context.WithCancelCause(context.Background())
		var wg sync.WaitGroup
		ctxs := make([]*cancelContext, 64)
		for i := range ctxs {
			// Deadlines from 15 ms to 960 ms; the parent ends at 500 ms.
			// Half of them are served by one deadlineQueue.
			c := &cancelContext{parent: parent, deadline: time.Now().Add(time.Duration(i+1) * 15 * time.Millisecond), shared: &sharedWatch{by: &watchers{parents: &w}}}
			if i%4 < 2 {
				c.shared.by.deadlines = q
			}
			ctxs[i] = c
			wg.Go(func() { <-c.Done() })
			wg.Go(func() {
				child, cancel := context.WithTimeout(c, time.Hour)
				defer cancel()
				<-child.Done()
			})
			wg.Go(func() {
				stop := context.AfterFunc(c, func() {})
				if i%2 == 0 {
					stop()
				}
			})
			switch i % 3 {
			case 0:
				wg.Go(func() { c.cancel(errOwnCause) })
			case 1:
				wg.Go(func() { time.Sleep(time.Second) })
			}
		}
		wg.Go(func() { time.Sleep(time.Second / 2); pcancel(errParentCause) })
		wg.Wait()
		for i, c := range ctxs {
			cause := context.Cause(c)
			switch want := errParentCause; {
			case i%3 == 0:
				if cause != errOwnCause {
					t.Errorf("context %d, cancelled at once: cause %v", i, cause)
				}
			case (i+1)*15 < 500:
				want = context.DeadlineExceeded
				fallthrough
			default:
				if cause != want {
					t.Errorf("context %d: cause %v; want %v", i, cause, want)
				}
			}
			if err := c.Err(); err == nil {
				t.Errorf("context %d: live at the end", i)
			}
		}
		w.mu.Lock()
		assert.Empty(t, w.parents, "parents left watched")
		w.mu.Unlock()
		q.mu.Lock()
		assert.Nil(t, q.list.head, "deadlines left queued")
		q.mu.Unlock()
	})
}

// Thousands of watched contexts with deadlines, under parents that never
// end, some shared and some each their own, leave nothing queued or
// listed once they have ended before their deadlines, whatever the order
// of their ends.
func TestWatchedContextsLeaveNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const n = 5000
		var w parentWatcher
		q := newDeadlineQueue(new(sync.Mutex))
		// The parents are cancelled only once the test is over.
		var cancels []context.CancelFunc
		defer func() {
			for _, cancel := range cancels {
				cancel()
			}
		}()
		live := func(parent context.Context) context.Context {
			ctx, cancel := context.WithCancel(parent)
			cancels = append(cancels, cancel)
			return ctx
		}
		shared := make([]context.Context, 3)
		for i := range shared {
			shared[i] = live(context.WithValue(context.Background(), ctxKey{}, i))
		}
		cs := make([]*cancelContext, n)
		for i := range cs {
			parent := shared[i%len(shared)]
			if i%5 == 0 {
				parent = live(context.Background())
			}
			cs[i] = &cancelContext{parent: parent, deadline: time.Now().Add(time.Hour), shared: &sharedWatch{by: &watchers{parents: &w, deadlines: q}}}
			_ = cs[i].Done()
			if i%7 == 0 {
				time.Sleep(time.Millisecond) // deadlines apart, in order
			}
		}
		// End them in an order unlike their deadlines': odd ones first,
		// from the last, then the even ones.
		for i := n - 1; i >= 0; i-- {
			if i%2 == 1 {
				cs[i].end()
			}
		}
		for i := 0; i < n; i += 2 {
			cs[i].end()
		}
		q.mu.Lock()
		assert.Nil(t, q.list.head, "the deadline queue's head")
		assert.Nil(t, q.list.tail, "the deadline queue's tail")
		q.mu.Unlock()
		w.mu.Lock()
		assert.LessOrEqual(t, len(w.parents), maxWatchedParents, "parents watched")
		for _, p := range w.parents {
			assert.Nil(t, p.head, "contexts listed under a parent")
		}
		w.mu.Unlock()
		for _, c := range cs {
			assert.ErrorIs(t, c.Err(), context.Canceled)
			assert.False(t, c.shared.deadlineLinks.queued || c.shared.watchedBy != nil, "a context still queued or listed")
		}
	})
}

// lateNews is a consumer's context that ends at once, as its Err and Done
// say, but tells the callbacks of its AfterFunc only when told to: as the
// standard library's contexts do, which call them on a goroutine of their
// own, a moment after the end.
type lateNews struct {
	context.Context // values

	mu    sync.Mutex
	done  chan struct{}
	err   error
	funcs []func()
}

func newLateNews() *lateNews {
	return &lateNews{Context: context.Background(), done: make(chan struct{})}
}

func (c *lateNews) Done() <-chan struct{} { return c.done }

func (c *lateNews) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}

func (c *lateNews) AfterFunc(f func()) func() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.funcs = append(c.funcs, f)
	return func() bool { return false }
}

// cancel ends c, and tell tells its callbacks.
func (c *lateNews) cancel() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.err = context.Canceled
	close(c.done)
}

func (c *lateNews) tell() {
	c.mu.Lock()
	funcs := c.funcs
	c.funcs = nil
	c.mu.Unlock()
	for _, f := range funcs {
		f()
	}
}

// A cancelContext beneath another, both watched (a Timeout's beneath
// Dedup's, or another Timeout's), whose grandparent has ended but not yet
// told them: whatever finds that end first, through the one beneath (its
// Err, context.Cause, endCause, its end, or its deadline's timer), ends
// both, with the grandparent's error. The one beneath asks the one above
// for its error, which then finds the end and ends, and tells the one
// beneath, at once, on that same goroutine.
func TestCancelContextUnderAnUnseenEnd(t *testing.T) {
	for _, tc := range []struct {
		name string
		find func(c *cancelContext) // what finds the end, through c
	}{
		{"Err", func(c *cancelContext) { c.Err() }},
		{"context.Cause", func(c *cancelContext) { context.Cause(c) }},
		{"endCause", func(c *cancelContext) { c.endCause() }},
		{"end", func(c *cancelContext) { c.end() }},
		{"its deadline", func(c *cancelContext) { c.expire() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			late := newLateNews()
			above := &cancelContext{parent: late}
			beneath := &cancelContext{parent: above, deadline: time.Now().Add(time.Hour)}
			beneath.Done() // both watched
			late.cancel()
			found := make(chan struct{})
			go func() {
				defer close(found)
				tc.find(beneath)
			}()
			select {
			case <-found:
			case <-time.After(5 * time.Second):
				t.Fatalf("%s of the context beneath has not returned in 5 s: deadlocked", tc.name)
			}
			assert.Equal(t, context.Canceled, above.Err(), "the context above")
			assert.Equal(t, context.Canceled, beneath.Err(), "the context beneath")
			late.tell()
			beneath.end()
			above.end()
		})
	}
}

// So on a delivery's path: beneath Dedup and a layer, a Timeout's handler
// that asks for its context's error once its consumer's context has
// ended, before the news of that end has come, finds it, and returns.
func TestDedupUnderAnUnseenEnd(t *testing.T) {
	late := newLateNews()
	asked := make(chan struct{})
	h := Dedup(store.NewMemory(), DedupOptions{})(rabbitmw.HandlerFunc(Timeout(time.Hour)(
		rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			ctx.Done() // watched, as by a handler that does I/O
			late.cancel()
			close(asked)
			return ctx.Err()
		})).Handle))
	result := make(chan error, 1)
	go func() { result <- h.Handle(late, &amqp.Delivery{MessageId: "m1"}) }()
	<-asked
	select {
	case err := <-result:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("the delivery has not returned in 5 s: deadlocked")
	}
	late.tell()
}
