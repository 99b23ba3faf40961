package middleware

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"go.uber.org/goleak"
)

// withCancel makes a cancellable context and its cancel function: the
// standard library's, or the claimContext that Dedup gives the handler.
type withCancel func(parent context.Context) (context.Context, context.CancelCauseFunc)

var cancelImpls = map[string]withCancel{
	"stdlib": context.WithCancelCause,
	"lazy": func(parent context.Context) (context.Context, context.CancelCauseFunc) {
		c := newClaimContext(parent, "k", "t", time.Hour)
		return c, c.cancel
	},
}

var errOwnCause = errors.New("the context's own cause")

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
		o := observed{syncChild: child.Err(), syncChildCause: context.Cause(child)}
		return merge(o, observe(ctx, false))
	}},
	{"Timeout's context and a child WithTimeout beneath, at its cancellation", func(mk withCancel) observed {
		ctx, cancel := mk(valued())
		tctx := newLazyDeadline(ctx, time.Now().Add(time.Minute))
		defer tctx.end()
		child, ccancel := context.WithTimeout(tctx, time.Hour)
		defer ccancel()
		cancel(errOwnCause)
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
	c := newClaimContext(valued(), "k", "t", time.Hour)
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
	c := newClaimContext(parent, "k", "t", time.Hour)
	defer c.end()
	tctx := newLazyDeadline(c, time.Now().Add(time.Hour))
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

// Many goroutines asking for Done while the context is cancelled get one
// channel, closed with the cause (run with -race).
func TestClaimContextConcurrentCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		c := newClaimContext(context.Background(), "k", "t", time.Hour)
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
		c := newClaimContext(parent, "k", "t", time.Hour)
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
