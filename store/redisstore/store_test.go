package redisstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

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

func TestConformanceMiniredis(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		_, c := newMiniredis(t)
		return redisstore.New(c, redisstore.Options{})
	})
}

func TestConformanceServer(t *testing.T) {
	addr := testenv.RedisAddr(t)
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	storetest.Run(t, func(t *testing.T) store.Store {
		return redisstore.New(c, redisstore.Options{Prefix: "rabbitmw-test:"})
	})
}

// The default layout is the one hand-written consumers use, so both can
// work on one Redis: msg:<id> is "done" once done, any other value is in
// progress, and retry:<id> counts failures.
func TestLegacyLayout(t *testing.T) {
	m, c := newMiniredis(t)
	s := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()

	// Our claim is visible to a hand-written consumer as "not done".
	if got, err := s.Claim(ctx, "a", "tok", time.Minute); err != nil || got != store.Claimed {
		t.Fatalf("Claim(a) = %v, %v; want claimed", got, err)
	}
	if v, _ := m.Get("msg:a"); v == "done" || v == "" {
		t.Fatalf("msg:a = %q while processing; want a token that is not \"done\"", v)
	}
	if ttl, want := m.TTL("msg:a"), time.Minute+store.DefaultAbandonedRetention; ttl <= store.DefaultAbandonedRetention || ttl > want {
		t.Fatalf("TTL(msg:a) = %v; want %v, the lease and the abandoned retention, set with the claim", ttl, want)
	}
	if err := s.Complete(ctx, "a", "tok", 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	if v, _ := m.Get("msg:a"); v != "done" {
		t.Fatalf("msg:a = %q after Complete; want \"done\"", v)
	}

	// A hand-written consumer's marks are honoured.
	m.Set("msg:b", "done")
	m.Set("msg:c", "processing")
	m.SetTTL("msg:c", 300*time.Second)
	for key, want := range map[string]store.Status{"b": store.Done, "c": store.Processing} {
		if got, err := s.Claim(ctx, key, "tok", time.Minute); err != nil || got != want {
			t.Fatalf("Claim(%s) = %v, %v; want %v", key, got, err, want)
		}
	}
	// Its claims cannot be stolen: no token of ours owns them, not even
	// one spelt as the mark.
	for _, tok := range []string{"tok", "processing"} {
		if err := s.Complete(ctx, "c", tok, time.Hour); !errors.Is(err, store.ErrLostClaim) {
			t.Fatalf("Complete(c, %q) of a hand-written claim = %v; want ErrLostClaim", tok, err)
		}
	}
	// It keeps its meaning to the end: processing until it expires, then
	// absent, never abandoned (its consumer's crash is not ours to count).
	m.FastForward(299 * time.Second)
	if got, err := s.Claim(ctx, "c", "tok", time.Minute); err != nil || got != store.Processing {
		t.Fatalf("Claim(c) near the end of its EXPIRE = %v, %v; want processing", got, err)
	}
	m.FastForward(2 * time.Second)
	if got, err := s.Claim(ctx, "c", "tok", time.Minute); err != nil || got != store.Claimed {
		t.Fatalf("Claim(c) after its EXPIRE = %v, %v; want claimed", got, err)
	}

	// SETNX without EXPIRE (a crash between the two) would block the
	// message forever; Claim gives the orphan a lease instead.
	m.Set("msg:d", "processing")
	if got, err := s.Claim(ctx, "d", "tok", time.Minute); err != nil || got != store.Processing {
		t.Fatalf("Claim(d) = %v, %v; want processing", got, err)
	}
	if ttl := m.TTL("msg:d"); ttl <= 0 || ttl > time.Minute {
		t.Fatalf("TTL(msg:d) = %v after Claim; want the orphan to get the lease", ttl)
	}

	// Failure counts share retry:<id> with INCR-based counters.
	m.Set("retry:e", "3")
	if n, err := s.Fail(ctx, "e", time.Hour); err != nil || n != 4 {
		t.Fatalf("Fail(e) = %d, %v; want 4", n, err)
	}
	if err := s.ResetFailures(ctx, "e"); err != nil || m.Exists("retry:e") {
		t.Fatalf("ResetFailures(e) = %v, exists %v; want the key deleted", err, m.Exists("retry:e"))
	}
}

func TestPrefixes(t *testing.T) {
	m, c := newMiniredis(t)
	s := redisstore.New(c, redisstore.Options{Prefix: "billing:", ClaimPrefix: "m/", FailurePrefix: "r/"})
	ctx := context.Background()
	if _, err := s.Claim(ctx, "x", "tok", time.Minute); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Fail(ctx, "x", time.Minute); err != nil {
		t.Fatal(err)
	}
	keys := strings.Join(m.Keys(), ",")
	if keys != "billing:m/x,billing:r/x" {
		t.Fatalf("keys = %s; want billing:m/x,billing:r/x", keys)
	}
}

// Each state change is one round trip once Load has cached the scripts.
func TestRoundTrips(t *testing.T) {
	_, c, rt := redistest.Start(t)
	s := redisstore.New(c, redisstore.Options{})
	ctx := context.Background()
	if err := s.Load(ctx); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		call func() error
	}{
		{"Claim", func() error { _, err := s.Claim(ctx, "k", "t", time.Minute); return err }},
		{"Extend", func() error { return s.Extend(ctx, "k", "t", time.Minute) }},
		{"Complete", func() error { return s.Complete(ctx, "k", "t", time.Minute) }},
		{"Claim of done", func() error { _, err := s.Claim(ctx, "k", "t", time.Minute); return err }},
		{"Fail", func() error { _, err := s.Fail(ctx, "k", time.Minute); return err }},
		{"ResetFailures", func() error { return s.ResetFailures(ctx, "k") }},
		{"Claim again", func() error { _, err := s.Claim(ctx, "j", "t", time.Minute); return err }},
		{"Release", func() error { return s.Release(ctx, "j", "t") }},
	} {
		before := rt.Count()
		if err := tc.call(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := rt.Count() - before; got != 1 {
			t.Errorf("%s took %d round trips; want 1", tc.name, got)
		}
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
		if err != nil {
			t.Fatal(err)
		}
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
	if err := s.Extend(ctx, "a", "tok", time.Minute); !errors.Is(err, store.ErrLostClaim) {
		t.Fatalf("Extend after the lease = %v; want ErrLostClaim", err)
	}
	if !m.Exists("msg:a") {
		t.Fatal("msg:a gone with the lease; want it kept for the abandoned retention")
	}
	for i, want := range []store.Status{store.Abandoned, store.Claimed} {
		if got, err := s.Claim(ctx, "a", "tok2", time.Minute); err != nil || got != want {
			t.Fatalf("Claim %d of a after its lease = %v, %v; want %v", i+1, got, err, want)
		}
	}

	// Past the abandoned retention, the key is gone and the crash uncounted.
	if _, err := s.Claim(ctx, "b", "tok", time.Minute); err != nil {
		t.Fatal(err)
	}
	m.FastForward(time.Hour + time.Minute)
	if got, err := s.Claim(ctx, "b", "tok2", time.Minute); err != nil || got != store.Claimed {
		t.Fatalf("Claim(b) after the abandoned retention = %v, %v; want claimed", got, err)
	}

	// Extend keeps the claim's own retention.
	if err := s.Extend(ctx, "b", "tok2", 2*time.Minute); err != nil {
		t.Fatal(err)
	}
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
	if _, err := short.Claim(ctx, "k", "tok", time.Hour); err != nil {
		t.Fatal(err)
	}
	if got, err := long.Claim(ctx, "k", "tok2", time.Hour); err != nil || got != store.Processing {
		t.Fatalf("Claim by a store with a longer retention, within the lease = %v, %v; want processing", got, err)
	}
	if err := long.Complete(ctx, "k", "tok", time.Hour); err != nil {
		t.Fatalf("Complete by the owner through a store with a longer retention = %v; want nil", err)
	}
	if _, err := long.Claim(ctx, "j", "tok", time.Minute); err != nil {
		t.Fatal(err)
	}
	m.FastForward(time.Minute)
	if got, err := short.Claim(ctx, "j", "tok2", time.Hour); err != nil || got != store.Abandoned {
		t.Fatalf("Claim by a store with a shorter retention, after the lease = %v, %v; want abandoned", got, err)
	}
}
