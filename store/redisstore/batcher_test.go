package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// A gate is a redis.Hook that records the size of every pipeline and, while
// closed, holds each pipeline before it is sent until the test lets it go.
type gate struct {
	mu     sync.Mutex
	sizes  []int
	closed bool
	held   chan struct{} // receives once per held pipeline
	open   chan struct{} // a send lets one held pipeline go
}

func newGate() *gate {
	return &gate{held: make(chan struct{}, 100), open: make(chan struct{})}
}

func (g *gate) close() { g.mu.Lock(); g.closed = true; g.mu.Unlock() }

func (g *gate) Sizes() []int { g.mu.Lock(); defer g.mu.Unlock(); return slices.Clone(g.sizes) }

func (g *gate) DialHook(next redis.DialHook) redis.DialHook { return next }

func (g *gate) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }

func (g *gate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if n := cmds[0].Name(); n == "hello" || n == "client" || n == "auth" {
			return next(ctx, cmds) // a new connection's handshake
		}
		g.mu.Lock()
		g.sizes = append(g.sizes, len(cmds))
		closed := g.closed
		g.mu.Unlock()
		if closed {
			g.held <- struct{}{}
			<-g.open
		}
		return next(ctx, cmds)
	}
}

// gatedClient returns a miniredis client with a closed gate.
func gatedClient(t *testing.T) (*redis.Client, *miniredis.Miniredis, *gate) {
	t.Helper()
	m, c := newMiniredis(t)
	g := newGate()
	g.close()
	c.AddHook(g)
	return c, m, g
}

// gated returns a miniredis client with a closed gate, and a batcher over it.
func gated(t *testing.T, opts redisstore.BatcherOptions) (*miniredis.Miniredis, *redis.Client, *gate, *redisstore.Batcher) {
	t.Helper()
	c, m, g := gatedClient(t)
	return m, c, g, redisstore.NewBatcher(c, opts)
}

// waitQueued waits until n calls wait in b's queue: they are goroutines of
// the test, scheduled by the runtime, and nothing else tells when they got
// there.
func waitQueued(t *testing.T, b *redisstore.Batcher, n int) {
	t.Helper()
	for b.Queued() < n {
		runtime.Gosched()
	}
}

const echo = "return ARGV[1]"

// While a pipeline is in flight, concurrent calls queue, and the next
// pipeline carries all of them, each with its own result.
func TestBatcherCoalesces(t *testing.T) {
	_, _, g, b := gated(t, redisstore.BatcherOptions{})
	ctx := context.Background()

	first := make(chan string, 1)
	go func() { first <- b.Eval(ctx, echo, []string{"k0"}, "first").Val().(string) }()
	<-g.held

	const n = 20
	got := make([]string, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			key := "k" + strconv.Itoa(i)
			got[i], errs[i] = b.Eval(ctx, echo, []string{key}, "v"+strconv.Itoa(i)).Text()
		})
	}
	waitQueued(t, b, n)
	g.open <- struct{}{} // the first pipeline
	<-g.held
	g.open <- struct{}{} // the second
	wg.Wait()
	if v := <-first; v != "first" {
		t.Errorf("first call = %q; want %q", v, "first")
	}
	for i := range n {
		if want := "v" + strconv.Itoa(i); got[i] != want || errs[i] != nil {
			t.Errorf("call %d = %q, %v; want %q, nil", i, got[i], errs[i], want)
		}
	}
	if s := g.Sizes(); !slices.Equal(s, []int{1, n}) {
		t.Errorf("pipeline sizes = %v; want [1 %d]", s, n)
	}
}

// The calls of goroutines that are ready to run when a call finds the
// batcher idle share its pipeline: that call yields its processor before
// it sends, until a yield brings no new call, and they queue meanwhile,
// rather than the first going alone and the others after it. With one
// processor the goroutines started together run in turn, so the pipeline
// carries every one, unless the runtime resumed the yielding goroutine
// before the others (its scheduler takes a goroutine from the global run
// queue, where a yield puts it, first once in 61 turns): the test tries
// three times. Without the yield it fails every time (sizes [1 1 7]).
func TestBatcherIdleCallYieldsToReadyCallers(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	const n = 8
	var sizes [][]int
	for range 3 {
		_, c := newMiniredis(t)
		g := newGate()
		c.AddHook(g)
		b := redisstore.NewBatcher(c, redisstore.BatcherOptions{})
		require.NoError(t, b.Del(context.Background(), "warm").Err()) // the connection's handshake

		start := make(chan struct{})
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i := range n {
			wg.Go(func() {
				<-start
				errs[i] = b.SetArgs(context.Background(), "k"+strconv.Itoa(i), "v", redis.SetArgs{}).Err()
			})
		}
		close(start)
		wg.Wait()
		for i, err := range errs {
			require.NoError(t, err, "call %d", i)
		}
		if s := g.Sizes(); slices.Equal(s, []int{1, n}) {
			return
		}
		sizes = append(sizes, g.Sizes())
	}
	t.Errorf("pipeline sizes %v; want [1 %d] (the warm-up alone, then every ready caller in one)", sizes, n)
}

// MaxBatch caps a pipeline; the calls beyond it go in the next one.
func TestBatcherMaxBatch(t *testing.T) {
	_, _, g, b := gated(t, redisstore.BatcherOptions{MaxBatch: 3})
	ctx := context.Background()
	var wg sync.WaitGroup
	wg.Go(func() { b.Del(ctx, "x") })
	<-g.held
	for i := range 7 {
		wg.Go(func() { b.Del(ctx, "k"+strconv.Itoa(i)) })
	}
	waitQueued(t, b, 7)
	g.open <- struct{}{}
	for range 3 {
		<-g.held
		g.open <- struct{}{}
	}
	wg.Wait()
	if s := g.Sizes(); !slices.Equal(s, []int{1, 3, 3, 1}) {
		t.Errorf("pipeline sizes = %v; want [1 3 3 1]", s)
	}
}

// Many goroutines, with no gate: every caller gets its own result, and the
// commands travel in fewer pipelines than there are calls.
func TestBatcherConcurrent(t *testing.T) {
	_, c := newMiniredis(t)
	g := newGate()
	c.AddHook(g)
	b := redisstore.NewBatcher(c, redisstore.BatcherOptions{MaxBatch: 8})
	ctx := context.Background()
	const workers, each = 16, 50
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				want := fmt.Sprintf("%d-%d", w, i)
				assert.Error(t, b.EvalSha(ctx, "", nil).Err(), "EvalSha of an empty digest succeeded")
				got, err := b.Eval(ctx, echo, []string{want}, want).Text()
				if got != want || err != nil {
					t.Errorf("Eval(%s) = %q, %v; want %q, nil", want, got, err, want)
				}
			}
		})
	}
	wg.Wait()
	sizes := g.Sizes()
	total := 0
	for _, s := range sizes {
		total += s
		if s > 8 {
			t.Errorf("a pipeline of %d commands; want at most MaxBatch 8", s)
		}
	}
	if total != 2*workers*each {
		t.Errorf("%d commands sent; want %d", total, 2*workers*each)
	}
	t.Logf("%d commands in %d pipelines", total, len(sizes))
}

// Script.Run over the batcher: EVALSHA answered NOSCRIPT in a pipeline is
// sent again as EVAL, for each caller, and the others of its pipeline are
// not touched.
func TestBatcherNoScript(t *testing.T) {
	_, c, g, b := gated(t, redisstore.BatcherOptions{})
	ctx := context.Background()
	s := redis.NewScript("return 'ran ' .. ARGV[1]")
	require.NoError(t, s.Load(ctx, b).Err())
	var wg sync.WaitGroup
	wg.Go(func() { b.Del(ctx, "x") })
	<-g.held
	c.ScriptFlush(ctx) // every EVALSHA of the next pipeline fails
	const n = 6
	got := make([]string, n)
	for i := range n {
		wg.Go(func() { got[i], _ = s.Run(ctx, b, []string{"k"}, strconv.Itoa(i)).Text() })
	}
	waitQueued(t, b, n)
	g.mu.Lock()
	g.closed = false
	g.mu.Unlock()
	g.open <- struct{}{}
	wg.Wait()
	for i := range n {
		if want := "ran " + strconv.Itoa(i); got[i] != want {
			t.Errorf("Run %d = %q; want %q", i, got[i], want)
		}
	}
}

// A caller whose context ends while it waits returns at once, and its
// command is never sent; the others are not touched. So for each kind of
// command the batcher queues.
func TestBatcherContextEndsWhileQueued(t *testing.T) {
	commands := []struct {
		name string
		call func(b *redisstore.Batcher, ctx context.Context, key string) error
	}{
		{"Eval", func(b *redisstore.Batcher, ctx context.Context, key string) error {
			return b.Eval(ctx, "redis.call('SET', KEYS[1], 'x')", []string{key}).Err()
		}},
		{"SetArgs", func(b *redisstore.Batcher, ctx context.Context, key string) error {
			return b.SetArgs(ctx, key, "v", redis.SetArgs{}).Err()
		}},
	}
	for _, c := range commands {
		t.Run(c.name, func(t *testing.T) {
			m, _, g, b := gated(t, redisstore.BatcherOptions{})
			bg := context.Background()
			var wg sync.WaitGroup
			wg.Go(func() { b.Del(bg, "x") })
			<-g.held

			ctx, cancel := context.WithCancelCause(bg)
			var leftErr error
			var left sync.WaitGroup
			left.Go(func() { leftErr = c.call(b, ctx, "abandoned") })
			waitQueued(t, b, 1)
			wg.Go(func() { c.call(b, bg, "kept") })
			waitQueued(t, b, 2)
			cancel(errors.New("caller gave up"))
			left.Wait()
			assert.ErrorIs(t, leftErr, context.Canceled, "%s after its context ended", c.name)
			if q := b.Queued(); q != 1 {
				t.Errorf("%d calls queued after one left; want 1", q)
			}
			g.open <- struct{}{}
			<-g.held
			g.open <- struct{}{}
			wg.Wait()
			if m.Exists("abandoned") || !m.Exists("kept") {
				t.Errorf("abandoned exists %v, kept %v; want false, true", m.Exists("abandoned"), m.Exists("kept"))
			}
			if s := g.Sizes(); !slices.Equal(s, []int{1, 1}) {
				t.Errorf("pipeline sizes = %v; want [1 1]", s)
			}
		})
	}
}

// A caller whose context ends while its pipeline is in flight returns at
// once with the context's error; the pipeline goes on for the others. The
// caller that sends the pipeline (the oldest) returns when it does, with
// its result, even if its own context ended first.
func TestBatcherContextEndsInFlight(t *testing.T) {
	_, _, g, b := gated(t, redisstore.BatcherOptions{})
	bg := context.Background()
	var wg sync.WaitGroup
	wg.Go(func() { b.Del(bg, "x") })
	<-g.held

	senderCtx, cancelSender := context.WithCancel(bg)
	var sent string
	var sentErr error
	var sender sync.WaitGroup
	sender.Go(func() { sent, sentErr = b.Eval(senderCtx, echo, []string{"s"}, "s").Text() })
	waitQueued(t, b, 1)
	ctx, cancel := context.WithCancel(bg)
	var leftErr error
	var left sync.WaitGroup
	left.Go(func() { leftErr = b.Eval(ctx, echo, []string{"a"}, "a").Err() })
	var kept string
	wg.Go(func() { kept, _ = b.Eval(bg, echo, []string{"b"}, "b").Text() })
	waitQueued(t, b, 3)
	g.open <- struct{}{}
	<-g.held // the second pipeline, holding all three, is in flight
	cancel()
	cancelSender()
	left.Wait()
	assert.ErrorIs(t, leftErr, context.Canceled, "Eval whose context ended in flight")
	g.open <- struct{}{}
	wg.Wait()
	sender.Wait()
	if kept != "b" {
		t.Errorf("the other call = %q; want %q", kept, "b")
	}
	if sent != "s" || sentErr != nil {
		t.Errorf("the sender's call = %q, %v; want %q, nil", sent, sentErr, "s")
	}
	if s := g.Sizes(); !slices.Equal(s, []int{1, 3}) {
		t.Errorf("pipeline sizes = %v; want [1 3]", s)
	}
}

// The batcher has no goroutine of its own: while a pipeline of queued
// calls is in flight, every goroutine that runs the batcher's code is a
// caller's.
func TestBatcherNoGoroutine(t *testing.T) {
	_, _, g, b := gated(t, redisstore.BatcherOptions{})
	bg := context.Background()
	var wg sync.WaitGroup
	firstDone := make(chan struct{})
	wg.Go(func() {
		defer close(firstDone)
		b.Del(bg, "x")
	})
	<-g.held
	for i := range 4 {
		wg.Go(func() { b.Del(bg, "k"+strconv.Itoa(i)) })
	}
	waitQueued(t, b, 4)
	g.open <- struct{}{}
	<-g.held // the second pipeline is in flight
	// The first caller returns once it has handed the second pipeline on,
	// without waiting for it; the stacks are read after it has.
	select {
	case <-firstDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the first caller waited for the second pipeline")
	}
	buf := make([]byte, 1<<20)
	stacks := strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n")
	g.open <- struct{}{}
	wg.Wait()
	callers := 0
	for _, st := range stacks {
		if !strings.Contains(st, "redisstore.(*Batcher)") {
			continue
		}
		if !strings.Contains(st, "TestBatcherNoGoroutine.func") {
			t.Errorf("a goroutine of the batcher's, not a caller's:\n%s", st)
		}
		callers++
	}
	if callers != 4 { // the first returned once it handed the second pipeline on
		t.Errorf("%d callers in the batcher; want 4", callers)
	}
}

// Redis restarts while a pipeline is in flight: its commands fail with the
// connection's error, each caller gets one, and the batcher goes on once
// Redis is back.
func TestBatcherRestartMidBatch(t *testing.T) {
	m, _, g, b := gated(t, redisstore.BatcherOptions{})
	bg := context.Background()
	var wg sync.WaitGroup
	wg.Go(func() { b.Del(bg, "x") })
	<-g.held
	const n = 5
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { errs[i] = b.Eval(bg, echo, []string{"k"}, "v").Err() })
	}
	waitQueued(t, b, n)
	g.open <- struct{}{}
	<-g.held
	m.Close()
	g.open <- struct{}{}
	wg.Wait()
	for i, err := range errs {
		if err == nil {
			t.Errorf("call %d while Redis was down = %v; want a connection error", i, err)
		}
	}
	require.NoError(t, m.Restart())
	g.mu.Lock()
	g.closed = false
	g.mu.Unlock()
	require.EventuallyWithT(t, func(c *assert.CollectT) { // waits for the server to answer
		v, err := b.Eval(bg, echo, []string{"k"}, "back").Text()
		assert.NoError(c, err, "Eval after the restart")
		assert.Equal(c, "back", v, "Eval after the restart")
	}, 10*time.Second, 10*time.Millisecond)
}

// SETs travel in the pipelines with the scripts and DELs, each with its own
// result: the old value for SET NX GET of a key that exists, redis.Nil for
// one that did not (and is now set).
func TestBatcherSet(t *testing.T) {
	m, _, g, b := gated(t, redisstore.BatcherOptions{})
	ctx := context.Background()
	m.Set("held", "old")
	var wg sync.WaitGroup
	wg.Go(func() { b.Del(ctx, "x") })
	<-g.held
	nx := redis.SetArgs{Mode: "NX", TTL: time.Minute, Get: true}
	var heldVal, freeVal string
	var heldErr, freeErr, evalErr error
	wg.Go(func() { heldVal, heldErr = b.SetArgs(ctx, "held", "new", nx).Result() })
	wg.Go(func() { freeVal, freeErr = b.SetArgs(ctx, "free", "new", nx).Result() })
	wg.Go(func() { evalErr = b.Eval(ctx, echo, []string{"e"}, "e").Err() })
	waitQueued(t, b, 3)
	g.open <- struct{}{}
	<-g.held
	g.open <- struct{}{}
	wg.Wait()
	if heldVal != "old" || heldErr != nil {
		t.Errorf("SET NX GET of a held key = %q, %v; want \"old\", nil", heldVal, heldErr)
	}
	if !errors.Is(freeErr, redis.Nil) {
		t.Errorf("SET NX GET of a free key = %q, %v; want redis.Nil", freeVal, freeErr)
	}
	if evalErr != nil {
		t.Errorf("Eval in the same pipeline = %v; want nil", evalErr)
	}
	if v, _ := m.Get("held"); v != "old" {
		t.Errorf("held = %q; want \"old\", untouched by NX", v)
	}
	if v, _ := m.Get("free"); v != "new" || !near(m.TTL("free"), time.Minute) {
		t.Errorf("free = %q with TTL %v; want \"new\" for a minute", v, m.TTL("free"))
	}
	if s := g.Sizes(); !slices.Equal(s, []int{1, 3}) {
		t.Errorf("pipeline sizes = %v; want [1 3]", s)
	}
}

// The caller woken to send the next pipeline yields first, as an idle
// caller does, so that the callers of the pipeline just done, woken with
// it and about to call again, share it rather than wait for the one
// after. Here four callers' first calls are held in flight while four
// others queue; each caller then calls once more. With one processor the
// woken sender runs first (the runtime runs the goroutine readied last
// before the others); without its yield it sends the four queued calls
// and the second call of the one caller that ran before it (sizes
// [4 5 4 3]), with it every call ready (sizes [4 8 4]). The test tries
// three times, as TestBatcherIdleCallYieldsToReadyCallers does.
func TestBatcherWokenSenderYieldsToReadyCallers(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	var sizes [][]int
	for range 3 {
		_, c := newMiniredis(t)
		g := newGate()
		c.AddHook(g)
		b := redisstore.NewBatcher(c, redisstore.BatcherOptions{})
		require.NoError(t, b.Del(context.Background(), "warm").Err()) // the connection's handshake
		g.close()

		twice := func(wg *sync.WaitGroup, start <-chan struct{}, i int, errs []error) {
			wg.Go(func() {
				<-start
				for j := range 2 {
					key := "k" + strconv.Itoa(i) + "-" + strconv.Itoa(j)
					if err := b.SetArgs(context.Background(), key, "v", redis.SetArgs{}).Err(); err != nil {
						errs[i] = err
					}
				}
			})
		}
		errs := make([]error, 8)
		var wg sync.WaitGroup
		first, second := make(chan struct{}), make(chan struct{})
		for i := range 4 {
			twice(&wg, first, i, errs)
		}
		close(first)
		<-g.held // the first calls of callers 0-3, in flight
		for i := 4; i < 8; i++ {
			twice(&wg, second, i, errs)
		}
		close(second)
		waitQueued(t, b, 4)
		go func() {
			for range g.held {
				g.open <- struct{}{}
			}
		}()
		g.open <- struct{}{}
		wg.Wait()
		close(g.held)
		for i, err := range errs {
			require.NoError(t, err, "caller %d", i)
		}
		s := g.Sizes()[1:] // after the warm-up
		if slices.Equal(s, []int{4, 8, 4}) {
			return
		}
		sizes = append(sizes, s)
	}
	t.Errorf("pipeline sizes %v; want [4 8 4] (the first calls of four, then every call ready, then the rest)", sizes)
}

// A store's own commands, which it builds for its batcher, leave as the
// batcher's methods' do when the caller's context ends: queued, never sent;
// in flight, at once, with the context's error, the pipeline going on for
// the others.
func TestStoreContextEnds(t *testing.T) {
	calls := []struct {
		name string
		call func(s *redisstore.Store, ctx context.Context, key string) error
	}{
		{"Claim", func(s *redisstore.Store, ctx context.Context, key string) error {
			_, err := s.Claim(ctx, key, "tok", time.Minute)
			return err
		}},
		{"Complete", func(s *redisstore.Store, ctx context.Context, key string) error {
			return s.Complete(ctx, key, "tok", time.Minute)
		}},
	}
	for _, c := range calls {
		for _, inFlight := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/in flight %v", c.name, inFlight), func(t *testing.T) {
				gc, m, g := gatedClient(t)
				s := redisstore.New(gc, redisstore.Options{})
				bg := context.Background()
				require.NoError(t, s.Load(bg))
				var wg sync.WaitGroup
				wg.Go(func() { s.ResetFailures(bg, "x") })
				<-g.held

				// The other call first: the oldest sends the next pipeline,
				// and returns when it does.
				wg.Go(func() { s.Claim(bg, "kept", "tok", time.Minute) })
				waitQueued(t, s.Batcher(), 1)
				ctx, cancel := context.WithCancel(bg)
				var leftErr error
				var left sync.WaitGroup
				left.Go(func() { leftErr = c.call(s, ctx, "left") })
				waitQueued(t, s.Batcher(), 2)
				if inFlight {
					g.open <- struct{}{}
					<-g.held // the second pipeline, holding both, is in flight
				}
				cancel()
				left.Wait()
				assert.ErrorIs(t, leftErr, context.Canceled, "%s after its context ended", c.name)
				g.open <- struct{}{}
				if !inFlight {
					<-g.held
					g.open <- struct{}{}
				}
				wg.Wait()
				assert.True(t, m.Exists("msg:kept"), "the other call's claim")
				want := []int{1, 1}
				if inFlight {
					want = []int{1, 2}
				}
				assert.Equal(t, want, g.Sizes(), "pipeline sizes")
				if !inFlight && c.name == "Claim" {
					assert.False(t, m.Exists("msg:left"), "the claim that left while queued")
				}
			})
		}
	}
}
