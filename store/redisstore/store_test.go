package redisstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
	"github.com/rabbitmw/rabbitmw/store/storetest"
)

func newMiniredis(t *testing.T) (*miniredis.Miniredis, *redis.Client) {
	m, c, _ := redistest.Start(t)
	return m, c
}

// The conformance kit, against the default store (batched) and one with
// NoBatching.
func TestConformanceMiniredis(t *testing.T) {
	for _, noBatching := range []bool{false, true} {
		t.Run(fmt.Sprintf("NoBatching=%v", noBatching), func(t *testing.T) {
			storetest.Run(t, func(t *testing.T) store.Store {
				_, c := newMiniredis(t)
				s := redisstore.New(c, redisstore.Options{NoBatching: noBatching})
				require.Equal(t, !noBatching, s.Batched(), "batched with NoBatching %v", noBatching)
				return s
			})
		})
	}
}

func TestConformanceServer(t *testing.T) {
	addr := testenv.RedisAddr(t)
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	t.Cleanup(func() { c.Close() })
	for _, noBatching := range []bool{false, true} {
		t.Run(fmt.Sprintf("NoBatching=%v", noBatching), func(t *testing.T) {
			s := redisstore.New(c, redisstore.Options{Prefix: "rabbitmw-test:", NoBatching: noBatching})
			storetest.Run(t, func(t *testing.T) store.Store { return s })
		})
	}
}

// New batches over the clients it knows can pipeline, and uses any other
// client as it is, so that a wrapper's methods run.
func TestNewBatches(t *testing.T) {
	_, c := newMiniredis(t)
	addr := c.Options().Addr
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{addr}})
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": addr}})
	universal := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{addr}})
	ap, err := c.AutoPipeline()
	require.NoError(t, err)
	t.Cleanup(func() { cluster.Close(); ring.Close(); universal.Close(); ap.Close() })
	for _, tc := range []struct {
		name   string
		client redisstore.Client
		opts   redisstore.Options
		want   bool
	}{
		{"Client", c, redisstore.Options{}, true},
		{"ClusterClient", cluster, redisstore.Options{}, true},
		{"Ring", ring, redisstore.Options{}, true},
		{"UniversalClient", universal, redisstore.Options{}, true},
		{"Client with NoBatching", c, redisstore.Options{NoBatching: true}, false},
		{"AutoPipeliner", ap, redisstore.Options{}, false},
		{"a wrapper", &oldRedis{Client: c}, redisstore.Options{}, false},
		{"a Batcher", redisstore.NewBatcher(c, redisstore.BatcherOptions{}), redisstore.Options{}, false},
	} {
		assert.Equal(t, tc.want, redisstore.New(tc.client, tc.opts).Batched(), "New(%s, %+v) batched", tc.name, tc.opts)
	}
}

// Options.Batch configures the batcher New makes; a negative cap panics.
func TestNewBatchOptions(t *testing.T) {
	_, c := newMiniredis(t)
	gc, _, g := gatedClient(t)
	s := redisstore.New(gc, redisstore.Options{Batch: redisstore.BatcherOptions{MaxBatch: 2}})
	ctx := context.Background()
	var wg sync.WaitGroup
	wg.Go(func() { s.ResetFailures(ctx, "x") })
	<-g.held
	for i := range 3 {
		wg.Go(func() { s.ResetFailures(ctx, "k"+strconv.Itoa(i)) })
	}
	waitQueued(t, s.Batcher(), 3)
	g.open <- struct{}{}
	for range 2 {
		<-g.held
		g.open <- struct{}{}
	}
	wg.Wait()
	assert.Equal(t, []int{1, 2, 1}, g.Sizes(), "pipeline sizes")

	assert.PanicsWithValue(t, "redisstore: New: negative Batch.MaxBatch -1", func() {
		redisstore.New(c, redisstore.Options{Batch: redisstore.BatcherOptions{MaxBatch: -1}})
	})
}

// The default layout is the one hand-written consumers use, so both can
// work on one Redis: msg:<id> is "done" once done, any other value is in
// progress, and retry:<id> counts failures.
func TestLegacyLayout(t *testing.T) {
	m, c := newMiniredis(t)
	s := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	claim := func(key string) store.Status {
		t.Helper()
		st, err := s.Claim(ctx, key, "tok", time.Minute)
		require.NoError(t, err, "Claim(%s)", key)
		return st
	}

	// Our claim is visible to a hand-written consumer as "not done".
	require.Equal(t, store.Claimed, claim("a"), "Claim(a)")
	v, _ := m.Get("msg:a")
	require.NotContains(t, []string{"done", ""}, v, "msg:a while processing: a token that is not \"done\"")
	ttl, want := m.TTL("msg:a"), time.Minute+store.DefaultAbandonedRetention
	require.True(t, ttl > store.DefaultAbandonedRetention && ttl <= want,
		"TTL(msg:a) = %v; want %v, the lease and the abandoned retention, set with the claim", ttl, want)
	require.NoError(t, s.Complete(ctx, "a", "tok", 24*time.Hour))
	v, _ = m.Get("msg:a")
	require.Equal(t, "done", v, "msg:a after Complete")

	// A hand-written consumer's marks are honoured.
	m.Set("msg:b", "done")
	m.Set("msg:c", "processing")
	m.SetTTL("msg:c", 300*time.Second)
	for key, want := range map[string]store.Status{"b": store.Done, "c": store.Processing} {
		require.Equal(t, want, claim(key), "Claim(%s)", key)
	}
	// Its claims cannot be stolen: no token of ours owns them, not even
	// one spelt as the mark.
	for _, tok := range []string{"tok", "processing"} {
		require.ErrorIs(t, s.Complete(ctx, "c", tok, time.Hour), store.ErrLostClaim, "Complete(c, %q) of a hand-written claim", tok)
	}
	// It keeps its meaning to the end: processing until it expires, then
	// absent, never abandoned (its consumer's crash is not ours to count).
	m.FastForward(299 * time.Second)
	require.Equal(t, store.Processing, claim("c"), "Claim(c) near the end of its EXPIRE")
	m.FastForward(2 * time.Second)
	require.Equal(t, store.Claimed, claim("c"), "Claim(c) after its EXPIRE")

	// SETNX without EXPIRE (a crash between the two) would block the
	// message forever; Claim gives the orphan a lease instead.
	m.Set("msg:d", "processing")
	require.Equal(t, store.Processing, claim("d"), "Claim(d)")
	ttl = m.TTL("msg:d")
	require.True(t, ttl > 0 && ttl <= time.Minute, "TTL(msg:d) = %v after Claim; want the orphan to get the lease", ttl)

	// Failure counts share retry:<id> with INCR-based counters.
	m.Set("retry:e", "3")
	n, err := s.Fail(ctx, "e", time.Hour)
	require.NoError(t, err)
	require.EqualValues(t, 4, n, "Fail(e)")
	require.NoError(t, s.ResetFailures(ctx, "e"))
	require.False(t, m.Exists("retry:e"), "retry:e after ResetFailures")
}

func TestPrefixes(t *testing.T) {
	m, c := newMiniredis(t)
	s := redisstore.New(c, redisstore.Options{Prefix: "billing:", ClaimPrefix: "m/", FailurePrefix: "r/"})
	ctx := context.Background()
	_, err := s.Claim(ctx, "x", "tok", time.Minute)
	require.NoError(t, err)
	_, err = s.Fail(ctx, "x", time.Minute)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"billing:m/x", "billing:r/x"}, m.Keys())
}

// Each state change is one round trip once Load has cached the scripts,
// but for a claim that finds the key claimed: two, the SET and the script.
func TestRoundTrips(t *testing.T) {
	_, c, rt := redistest.Start(t)
	s := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	require.NoError(t, s.Load(ctx))
	// The batcher's pipelines may dial a connection of their own, whose
	// handshake the counter would count.
	require.NoError(t, s.ResetFailures(ctx, "warm-up"))
	for _, tc := range []struct {
		name string
		call func() error
		want int64
	}{
		{"Claim", func() error { _, err := s.Claim(ctx, "k", "t", time.Minute); return err }, 1},
		{"Claim of a claimed key", func() error { _, err := s.Claim(ctx, "k", "u", time.Minute); return err }, 2},
		{"Extend", func() error { return s.Extend(ctx, "k", "t", time.Minute) }, 1},
		{"Complete", func() error { return s.Complete(ctx, "k", "t", time.Minute) }, 1},
		{"Claim of done", func() error { _, err := s.Claim(ctx, "k", "t", time.Minute); return err }, 1},
		{"Fail", func() error { _, err := s.Fail(ctx, "k", time.Minute); return err }, 1},
		{"ResetFailures", func() error { return s.ResetFailures(ctx, "k") }, 1},
		{"Claim again", func() error { _, err := s.Claim(ctx, "j", "t", time.Minute); return err }, 1},
		{"Release", func() error { return s.Release(ctx, "j", "t") }, 1},
	} {
		before := rt.Count()
		require.NoError(t, tc.call(), "%s", tc.name)
		assert.Equal(t, tc.want, rt.Count()-before, "%s: round trips", tc.name)
	}
}

func TestErrors(t *testing.T) {
	m, c := newMiniredis(t)
	s := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	m.HSet("msg:h", "f", "v") // a key of the wrong type
	if _, err := s.Claim(ctx, "h", "t", time.Minute); err == nil || !strings.Contains(err.Error(), `redisstore: claim "h"`) {
		t.Fatalf("Claim of a hash key = %v; want a store error naming the operation and key", err)
	}
	addr := m.Addr()
	m.Close()
	c2 := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1})
	defer c2.Close()
	s = redisstore.New(c2, redisstore.Options{})
	if _, err := s.Claim(ctx, "k", "t", time.Minute); err == nil || errors.Is(err, store.ErrLostClaim) {
		t.Fatalf("Claim with the server gone = %v; want an error other than ErrLostClaim", err)
	}
	if err := s.Load(ctx); err == nil || !strings.Contains(err.Error(), "redisstore: load scripts") {
		t.Fatalf("Load with the server gone = %v; want a store error", err)
	}
}

// The store runs unchanged over go-redis's autopipeliner, which batches
// the commands of concurrent callers into pipelines.
func TestConformanceAutoPipeline(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		_, c := newMiniredis(t)
		ap, err := c.AutoPipeline()
		require.NoError(t, err)
		t.Cleanup(func() { ap.Close() })
		return redisstore.New(ap, redisstore.Options{})
	})
}

// A claim's key outlives its lease by the abandoned retention, measured by
// Redis: within it, Claim reports the claim abandoned (once); after it,
// the key is gone.
func TestAbandonedClaims(t *testing.T) {
	m, c := newMiniredis(t)
	ctx := context.Background()
	s := redisstore.New(c, redisstore.Options{AbandonedRetention: time.Hour})
	if got, err := s.Claim(ctx, "a", "tok", time.Minute); err != nil || got != store.Claimed {
		t.Fatalf("Claim(a) = %v, %v; want claimed", got, err)
	}
	if v, _ := m.Get("msg:a"); v != "rabbitmw:claim:3600000:tok" {
		t.Fatalf("msg:a = %q; want the tagged claim with its abandoned retention", v)
	}
	if ttl := m.TTL("msg:a"); !near(ttl, time.Hour+time.Minute) {
		t.Fatalf("TTL(msg:a) = %v; want the lease and the abandoned retention", ttl)
	}
	m.FastForward(time.Minute)
	require.ErrorIs(t, s.Extend(ctx, "a", "tok", time.Minute), store.ErrLostClaim, "Extend after the lease")
	require.True(t, m.Exists("msg:a"), "msg:a gone with the lease; want it kept for the abandoned retention")
	for i, want := range []store.Status{store.Abandoned, store.Claimed} {
		if got, err := s.Claim(ctx, "a", "tok2", time.Minute); err != nil || got != want {
			t.Fatalf("Claim %d of a after its lease = %v, %v; want %v", i+1, got, err, want)
		}
	}

	// Past the abandoned retention, the key is gone and the crash uncounted.
	_, err := s.Claim(ctx, "b", "tok", time.Minute)
	require.NoError(t, err)
	m.FastForward(time.Hour + time.Minute)
	if got, err := s.Claim(ctx, "b", "tok2", time.Minute); err != nil || got != store.Claimed {
		t.Fatalf("Claim(b) after the abandoned retention = %v, %v; want claimed", got, err)
	}

	// Extend keeps the claim's own retention.
	require.NoError(t, s.Extend(ctx, "b", "tok2", 2*time.Minute))
	if ttl := m.TTL("msg:b"); !near(ttl, time.Hour+2*time.Minute) {
		t.Fatalf("TTL(msg:b) after Extend = %v; want the new lease and the abandoned retention", ttl)
	}
}

// near reports whether a TTL read on miniredis's wall clock is want, set
// within the last seconds.
func near(ttl, want time.Duration) bool { return ttl <= want && ttl > want-5*time.Second }

// Each claim carries its abandoned retention: a store with another setting
// reads a claim's lease right.
func TestAbandonedRetentionPerClaim(t *testing.T) {
	m, c := newMiniredis(t)
	ctx := context.Background()
	short := redisstore.New(c, redisstore.Options{AbandonedRetention: time.Minute})
	long := redisstore.New(c, redisstore.Options{}) // 24 hours
	_, err := short.Claim(ctx, "k", "tok", time.Hour)
	require.NoError(t, err)
	if got, err := long.Claim(ctx, "k", "tok2", time.Hour); err != nil || got != store.Processing {
		t.Fatalf("Claim by a store with a longer retention, within the lease = %v, %v; want processing", got, err)
	}
	require.NoError(t, long.Complete(ctx, "k", "tok", time.Hour), "Complete by the owner through a store with a longer retention")
	_, err = long.Claim(ctx, "j", "tok", time.Minute)
	require.NoError(t, err)
	m.FastForward(time.Minute)
	if got, err := short.Claim(ctx, "j", "tok2", time.Hour); err != nil || got != store.Abandoned {
		t.Fatalf("Claim by a store with a shorter retention, after the lease = %v, %v; want abandoned", got, err)
	}
}

// commands is a redis.Hook that records the name of every command a client
// sends, alone or in a pipeline.
type commands struct {
	mu    sync.Mutex
	names []string
}

func (c *commands) take() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := c.names
	c.names = nil
	return n
}

func (c *commands) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *commands) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.mu.Lock()
		c.names = append(c.names, cmd.Name())
		c.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (c *commands) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.mu.Lock()
		for _, cmd := range cmds {
			c.names = append(c.names, cmd.Name())
		}
		c.mu.Unlock()
		return next(ctx, cmds)
	}
}

// The common claims, of an absent key and of a done one, are one native SET
// (NX GET), which costs Redis a third of a script; only a claim that finds
// a claim or a hand-written mark runs the script, to read the key's PTTL
// and decide.
func TestClaimCommands(t *testing.T) {
	m, c := newMiniredis(t)
	rec := new(commands)
	c.AddHook(rec)
	s := redisstore.New(c, redisstore.Options{AbandonedRetention: time.Hour})
	ctx := context.Background()
	require.NoError(t, s.Load(ctx))
	m.Set("msg:hand", "processing")
	m.SetTTL("msg:hand", time.Hour)
	_, err := s.Claim(ctx, "gone", "tok", time.Minute)
	require.NoError(t, err)
	m.FastForward(time.Minute) // gone's lease ends: abandoned
	rec.take()
	for _, tc := range []struct {
		name string
		key  string
		want store.Status
		cmds []string
	}{
		{"absent", "a", store.Claimed, []string{"set"}},
		{"processing", "a", store.Processing, []string{"set", "evalsha"}}, // by tok, not tok2: see below
		{"hand-written mark", "hand", store.Processing, []string{"set", "evalsha"}},
		{"abandoned", "gone", store.Abandoned, []string{"set", "evalsha"}},
		{"absent again", "gone", store.Claimed, []string{"set"}},
	} {
		token := "tok2"
		if tc.name == "processing" {
			token = "tok" // another owner: tok2's own claim, sent again, is claimed
		}
		got, err := s.Claim(ctx, tc.key, token, time.Minute)
		if err != nil || got != tc.want {
			t.Errorf("Claim(%s) of %s = %v, %v; want %v", tc.key, tc.name, got, err, tc.want)
		}
		assert.Equal(t, tc.cmds, rec.take(), "Claim(%s) of %s sent", tc.key, tc.name)
	}
	require.NoError(t, s.Complete(ctx, "a", "tok2", time.Hour))
	rec.take()
	if got, err := s.Claim(ctx, "a", "tok3", time.Minute); err != nil || got != store.Done {
		t.Errorf("Claim(a) of done = %v, %v; want done", got, err)
	}
	assert.Equal(t, []string{"set"}, rec.take(), "Claim(a) of done sent")
	v, _ := m.Get("msg:a")
	assert.Equal(t, "done", v, "msg:a after a Claim of done, untouched")
}

// oldRedis is a Client whose SETs are answered as Redis 6.2 answers SET
// NX GET: a syntax error.
type oldRedis struct {
	*redis.Client
	sets atomic.Int64
}

type syntaxError struct{}

func (syntaxError) Error() string { return "ERR syntax error" }
func (syntaxError) RedisError()   {}

func (o *oldRedis) SetArgs(ctx context.Context, key string, value any, a redis.SetArgs) *redis.StatusCmd {
	o.sets.Add(1)
	cmd := redis.NewStatusCmd(ctx, "set", key, value)
	cmd.SetErr(syntaxError{})
	return cmd
}

// On a Redis older than 7.0, Claim runs the script, as it did before SET NX
// GET, and stops trying the SET after the first refusal.
func TestClaimBeforeRedis7(t *testing.T) {
	_, c := newMiniredis(t)
	if err := c.Do(context.Background(), "set", "k", "v", "bogus").Err(); !redisstore.IsSyntaxError(err) {
		t.Fatalf("isSyntaxError(%v) of Redis's answer to a bad SET = false; want true", err)
	}
	old := &oldRedis{Client: c}
	s := redisstore.New(old, redisstore.Options{})
	ctx := context.Background()
	for i, want := range []store.Status{store.Claimed, store.Processing} {
		if got, err := s.Claim(ctx, "k", "tok"+strconv.Itoa(i), time.Minute); err != nil || got != want {
			t.Fatalf("Claim %d = %v, %v; want %v", i+1, got, err, want)
		}
	}
	assert.EqualValues(t, 1, old.sets.Load(), "SETs tried: the one refused")
	storetest.Run(t, func(t *testing.T) store.Store {
		_, c := newMiniredis(t)
		return redisstore.New(&oldRedis{Client: c}, redisstore.Options{})
	})
}

// A lateProxy forwards TCP connections to a server. Once armed with a
// key, it holds the answer to the next request that names the key past the
// client's read timeout: the command took effect, and its answer comes too
// late.
type lateProxy struct {
	l     net.Listener
	to    string
	late  time.Duration
	armed atomic.Pointer[string]
	wg    sync.WaitGroup
	mu    sync.Mutex
	conns []net.Conn
}

// startLateProxy starts a proxy to addr, closed when t ends.
func startLateProxy(t *testing.T, addr string, late time.Duration) *lateProxy {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &lateProxy{l: l, to: addr, late: late}
	p.wg.Go(p.accept) // ends when l is closed
	t.Cleanup(func() {
		l.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

// lateFor holds the answer to the next request that names key.
func (p *lateProxy) lateFor(key string) { p.armed.Store(&key) }

func (p *lateProxy) accept() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.to)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		late := new(atomic.Bool) // the next answer on this connection is late
		// Each pump ends when either side closes.
		p.wg.Go(func() {
			p.pump(s, c, func(b []byte) {
				if k := p.armed.Load(); k != nil && bytes.Contains(b, []byte(*k)) && p.armed.CompareAndSwap(k, nil) {
					late.Store(true)
				}
			})
		})
		p.wg.Go(func() {
			p.pump(c, s, func([]byte) {
				if late.CompareAndSwap(true, false) {
					time.Sleep(p.late) // the slow link this proxy plays
				}
			})
		})
	}
}

// pump copies src to dst, calling seen with each read before it forwards
// it.
func (p *lateProxy) pump(dst, src net.Conn, seen func([]byte)) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			seen(buf[:n])
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// go-redis sends a command again, on a new connection, when its answer
// does not come within the read timeout (as it does a whole pipeline). A
// claim whose first send took effect then finds the key held by its own
// token: it is the caller's claim, not another consumer's.
func TestClaimResentAfterItsAnswerWasLost(t *testing.T) {
	for _, tc := range []struct {
		name  string
		store func(c *redis.Client) *redisstore.Store
	}{
		{"batched", func(c *redis.Client) *redisstore.Store { return redisstore.New(c, redisstore.Options{}) }},
		{"unbatched", func(c *redis.Client) *redisstore.Store {
			return redisstore.New(c, redisstore.Options{NoBatching: true})
		}},
		{"script alone, as on Redis before 7.0", func(c *redis.Client) *redisstore.Store {
			return redisstore.New(&oldRedis{Client: c}, redisstore.Options{})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			m := miniredis.RunT(t)
			p := startLateProxy(t, m.Addr(), 300*time.Millisecond)
			c := redis.NewClient(&redis.Options{Addr: p.l.Addr().String(), ReadTimeout: 100 * time.Millisecond})
			t.Cleanup(func() { c.Close() })
			s := tc.store(c)
			require.NoError(t, s.Load(ctx)) // the connection is open, the scripts cached

			p.lateFor("msg:k")
			st, err := s.Claim(ctx, "k", "mine", time.Minute)
			require.Nil(t, p.armed.Load(), "no answer was late")
			require.NoError(t, err)
			assert.Equal(t, store.Claimed, st, "the claim resent after its answer was lost")
			assert.NoError(t, s.Complete(ctx, "k", "mine", time.Hour), "the token owns the key")

			// Another token still finds the key taken.
			st, err = s.Claim(ctx, "k2", "mine", time.Minute)
			require.NoError(t, err)
			require.Equal(t, store.Claimed, st)
			st, err = s.Claim(ctx, "k2", "other", time.Minute)
			require.NoError(t, err)
			assert.Equal(t, store.Processing, st, "another token's claim")
		})
	}
}

// Fail's INCR is no claim: a second send adds one more. go-redis must not
// send it again when its answer does not come within the read timeout (as
// it does other commands): one failure is counted once, or the count is
// unknown (an error), never counted twice, which would make Retry
// dead-letter a message before its last attempt.
func TestFailNotResentAfterItsAnswerWasLost(t *testing.T) {
	for _, noBatching := range []bool{false, true} {
		t.Run(fmt.Sprintf("NoBatching=%v", noBatching), func(t *testing.T) {
			ctx := context.Background()
			m := miniredis.RunT(t)
			p := startLateProxy(t, m.Addr(), 300*time.Millisecond)
			c := redis.NewClient(&redis.Options{Addr: p.l.Addr().String(), ReadTimeout: 100 * time.Millisecond})
			t.Cleanup(func() { c.Close() })
			s := redisstore.New(c, redisstore.Options{NoBatching: noBatching})
			require.NoError(t, s.Load(ctx)) // the connection is open, the scripts cached

			p.lateFor("retry:k")
			n, err := s.Fail(ctx, "k", time.Hour)
			require.Nil(t, p.armed.Load(), "no answer was late")
			assert.True(t, err != nil || n == 1, "Fail after one failure = %d, %v; want 1 or an error", n, err)
			n, err = s.Fail(ctx, "k", time.Hour)
			require.NoError(t, err)
			assert.Equal(t, int64(2), n, "the count after two failures")
		})
	}
}

// servers are the servers that a test of the scripts runs on: miniredis
// and a real Redis, whose Lua differ.
var servers = []struct {
	name   string
	client func(t *testing.T) *redis.Client
}{
	{"miniredis", func(t *testing.T) *redis.Client { _, c := newMiniredis(t); return c }},
	{"redis", func(t *testing.T) *redis.Client {
		c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t)})
		t.Cleanup(func() { c.Close() })
		return c
	}},
}

// The owner check of Extend, Complete and Release, against the values a
// key can hold: claims written by this store, by a store with another
// abandoned retention (or an older version: the format is the same), and
// marks that are no claim of ours. On miniredis and on a real Redis, whose
// Lua differ.
func TestOwnerCheck(t *testing.T) {
	const day, minute = 86_400_000, 60_000 // ms: the default retention, another one
	claim := func(keep int, token string) string { return fmt.Sprintf("rabbitmw:claim:%d:%s", keep, token) }
	cases := []struct {
		name  string
		value string // "" for an absent key
		pttl  int    // ms; 0 for none
		token string
		owned bool
	}{
		{"its own claim", claim(day, "tok"), day + minute, "tok", true},
		{"a claim with another retention", claim(minute, "tok"), 2 * minute, "tok", true},
		{"its lease ended", claim(day, "tok"), day - 1000, "tok", false},
		{"another retention, its lease ended", claim(minute, "tok"), minute - 1000, "tok", false},
		{"another token", claim(day, "tik"), day + minute, "tok", false},
		{"another retention, another token", claim(minute, "tik"), 2 * minute, "tok", false},
		{"a token with colons", claim(day, "a:b"), day + minute, "a:b", true},
		{"a token with colons, another retention", claim(minute, "a:b"), 2 * minute, "a:b", true},
		{"the end of a token with colons", claim(day, "a:b"), day + minute, "b", false},
		{"the retention and token of another", claim(day, "a:b"), day + minute, "86400000:a:b", false},
		{"a token ending another", claim(day, "xtok"), day + minute, "tok", false},
		{"a token beginning another", claim(day, "tok"), day + minute, "to", false},
		{"no retention", "rabbitmw:claim::tok", day + minute, "tok", false},
		{"done", "done", day, "tok", false},
		{"a hand-written mark", "processing", day, "processing", false},
		{"a hand-written mark without expiry", "processing", 0, "processing", false},
		{"absent", "", 0, "tok", false},
	}
	ops := []struct {
		name string
		call func(s *redisstore.Store, key, token string) error
		// after is the key's value after the call by its owner
		after string
	}{
		{"Complete", func(s *redisstore.Store, key, token string) error {
			return s.Complete(context.Background(), key, token, time.Hour)
		}, "done"},
		{"Extend", func(s *redisstore.Store, key, token string) error {
			return s.Extend(context.Background(), key, token, time.Hour)
		}, "unchanged"},
		{"Release", func(s *redisstore.Store, key, token string) error {
			return s.Release(context.Background(), key, token)
		}, ""},
	}
	for _, srv := range servers {
		t.Run(srv.name, func(t *testing.T) {
			c := srv.client(t)
			ctx := context.Background()
			prefix := "rabbitmw-test-owner-" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
			s := redisstore.New(c, redisstore.Options{Prefix: prefix})
			for _, op := range ops {
				for i, tc := range cases {
					key := op.name + strconv.Itoa(i)
					k := prefix + "msg:" + key
					if tc.value != "" {
						require.NoError(t, c.Set(ctx, k, tc.value, time.Duration(tc.pttl)*time.Millisecond).Err())
						t.Cleanup(func() { c.Del(context.Background(), k) })
					}
					err := op.call(s, key, tc.token)
					got, gerr := c.Get(ctx, k).Result()
					if errors.Is(gerr, redis.Nil) {
						got = ""
					} else {
						require.NoError(t, gerr)
					}
					if !tc.owned {
						assert.ErrorIs(t, err, store.ErrLostClaim, "%s of %s by %q", op.name, tc.name, tc.token)
						assert.Equal(t, tc.value, got, "%s of %s by %q: the key's value after", op.name, tc.name, tc.token)
						continue
					}
					assert.NoError(t, err, "%s of %s by %q", op.name, tc.name, tc.token)
					want := op.after
					if want == "unchanged" {
						want = tc.value
					}
					assert.Equal(t, want, got, "%s of %s by %q: the key's value after", op.name, tc.name, tc.token)
					if op.name == "Extend" {
						// The new lease, and the claim's own retention after it.
						keep, _, _ := strings.Cut(strings.TrimPrefix(tc.value, "rabbitmw:claim:"), ":")
						ms, err := strconv.Atoi(keep)
						require.NoError(t, err)
						pttl, err := c.PTTL(ctx, k).Result()
						require.NoError(t, err)
						assert.True(t, near(pttl, time.Hour+time.Duration(ms)*time.Millisecond),
							"Extend of %s: PTTL %v; want an hour and %d ms", tc.name, pttl, ms)
					}
				}
			}
		})
	}
}
