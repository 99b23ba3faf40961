package middleware

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// withDeadline makes a context with a deadline and its cancel function:
// the standard library's, or Timeout's lazyContext.
type withDeadline func(parent context.Context, d time.Time) (context.Context, context.CancelFunc)

var deadlineImpls = map[string]withDeadline{
	"stdlib": context.WithDeadline,
	"lazy": func(parent context.Context, d time.Time) (context.Context, context.CancelFunc) {
		c := newLazyDeadline(parent, d)
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
// bubble, whose clock starts at the same instant: the lazyContext must be
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

func TestLazyDeadlineAsStdlib(t *testing.T) { asStdlib(t, deadlineImpls, deadlineScenarios) }

// A scenario does something to a context made by mk, and says what it saw.
type scenario[M any] struct {
	name string
	run  func(mk M) observed
}

// asStdlib runs each scenario on both implementations, each in a synctest
// bubble whose clock starts at the same instant, and fails where the lazy
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
			if got["lazy"] != got["stdlib"] {
				t.Errorf("lazy: %+v\nwant as stdlib: %+v", got["lazy"], got["stdlib"])
			}
		})
	}
}

// Many goroutines asking for Done at once get one channel, closed at the
// deadline (run with -race).
func TestLazyDeadlineConcurrentDone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newLazyDeadline(context.Background(), time.Now().Add(time.Second))
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
func TestLazyDeadlineAllocs(t *testing.T) {
	parent := context.Background()
	d := time.Now().Add(time.Hour)
	n := testing.AllocsPerRun(100, func() {
		c := newLazyDeadline(parent, d)
		_ = c.Err()
		_, _ = c.Deadline()
		c.end()
	})
	if n > 1 {
		t.Errorf("%v allocations per unwatched context; want 1", n)
	}
}
