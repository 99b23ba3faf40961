// Package storetest checks that a [store.Store] implementation keeps the
// contract written on store.Store, in the manner of testing/slogtest and
// testing/fstest. Every backend runs it in its own tests: the ones this
// module ships, and yours.
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) store.Store {
//			return mystore.New(...)
//		})
//	}
package storetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
)

// Timing used by the expiry cases. Expiry is measured by the backend's
// clock, which advances in real time (for miniredis, enable ClockTTL); the
// margins are wide because test machines are often loaded.
const (
	shortTTL = 400 * time.Millisecond // an entry meant to expire
	expired  = 3 * shortTTL           // waited for an entry to be gone
	longTTL  = time.Minute            // an entry meant to stay
)

// Run runs the conformance cases as subtests of t, in parallel. newStore is
// called once per subtest and must return a Store for it; the stores may
// share a backend, since every case uses keys of its own.
func Run(t *testing.T, newStore func(t *testing.T) store.Store) {
	t.Helper()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := newStore(t)
			if s == nil {
				t.Fatal("newStore returned nil")
			}
			c.run(t, &fixture{s: s, prefix: "storetest:" + c.name + ":" + randomHex(6) + ":"})
		})
	}
}

var cases = []struct {
	name string
	run  func(*testing.T, *fixture)
}{
	{"ClaimAbsent", testClaimAbsent},
	{"ClaimHeld", testClaimHeld},
	{"ConcurrentClaims", testConcurrentClaims},
	{"CompleteThenClaim", testCompleteThenClaim},
	{"OwnerChecks", testOwnerChecks},
	{"Release", testRelease},
	{"LeaseExpiry", testLeaseExpiry},
	{"ConcurrentAbandonedClaims", testConcurrentAbandonedClaims},
	{"Extend", testExtend},
	{"DoneExpiry", testDoneExpiry},
	{"KeysIndependent", testKeysIndependent},
	{"Failures", testFailures},
	{"ConcurrentFailures", testConcurrentFailures},
	{"FailureExpiry", testFailureExpiry},
	{"OddKeys", testOddKeys},
	{"HugeKey", testHugeKey},
	{"DoneContext", testDoneContext},
}

type fixture struct {
	s      store.Store
	prefix string
}

var bg = context.Background()

// key returns a key unique to this run and case.
func (f *fixture) key(name string) string { return f.prefix + name }

func (f *fixture) claim(t *testing.T, key, token string, lease time.Duration, want store.Status) {
	t.Helper()
	got, err := f.s.Claim(bg, key, token, lease)
	if err != nil {
		t.Fatalf("Claim(%q, %q) error: %v", key, token, err)
	}
	if got != want {
		t.Fatalf("Claim(%q, %q) = %v; want %v", key, token, got, want)
	}
}

// expect checks the result of an owner-checked call: nil when ok, else
// ErrLostClaim.
func expect(t *testing.T, call string, err error, ok bool) {
	t.Helper()
	switch {
	case ok && err != nil:
		t.Fatalf("%s = %v; want nil", call, err)
	case !ok && !errors.Is(err, store.ErrLostClaim):
		t.Fatalf("%s = %v; want store.ErrLostClaim", call, err)
	}
}

func testClaimAbsent(t *testing.T, f *fixture) {
	f.claim(t, f.key("k"), "t1", longTTL, store.Claimed)
}

func testClaimHeld(t *testing.T, f *fixture) {
	k := f.key("k")
	f.claim(t, k, "t1", longTTL, store.Claimed)
	f.claim(t, k, "t2", longTTL, store.Processing)
	// The losing claim must not have taken the key.
	expect(t, "Complete by the loser", f.s.Complete(bg, k, "t2", longTTL), false)
	expect(t, "Complete by the owner", f.s.Complete(bg, k, "t1", longTTL), true)
}

// claimAtOnce runs n claims of k at once, for tokens "token-0" to
// "token-<n-1>", and returns their statuses; a claim's error fails t.
func claimAtOnce(t *testing.T, f *fixture, k string, n int) []store.Status {
	t.Helper()
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		results = make([]store.Status, n)
		errs    = make([]error, n)
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			results[i], errs[i] = f.s.Claim(bg, k, fmt.Sprintf("token-%d", i), longTTL)
		}()
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("Claim %d error: %v", i, err)
		}
	}
	return results
}

func testConcurrentClaims(t *testing.T, f *fixture) {
	const n = 64
	k := f.key("k")
	results := claimAtOnce(t, f, k, n)
	winner := -1
	for i := range n {
		switch results[i] {
		case store.Claimed:
			if winner >= 0 {
				t.Fatalf("Claim %d and Claim %d both won the key", winner, i)
			}
			winner = i
		case store.Processing:
		default:
			t.Fatalf("Claim %d = %v; want claimed or processing", i, results[i])
		}
	}
	if winner < 0 {
		t.Fatalf("no claim of %d won the key; want exactly one", n)
	}
	expect(t, "Complete by the winner", f.s.Complete(bg, k, fmt.Sprintf("token-%d", winner), longTTL), true)
}

func testCompleteThenClaim(t *testing.T, f *fixture) {
	k := f.key("k")
	f.claim(t, k, "t1", longTTL, store.Claimed)
	expect(t, "Complete", f.s.Complete(bg, k, "t1", longTTL), true)
	f.claim(t, k, "t2", longTTL, store.Done)
	f.claim(t, k, "t1", longTTL, store.Done)
}

func testOwnerChecks(t *testing.T, f *fixture) {
	k := f.key("k")
	// Nothing is owned on an absent key.
	expect(t, "Extend of an absent key", f.s.Extend(bg, k, "t1", longTTL), false)
	expect(t, "Complete of an absent key", f.s.Complete(bg, k, "t1", longTTL), false)
	expect(t, "Release of an absent key", f.s.Release(bg, k, "t1"), false)
	f.claim(t, k, "t1", longTTL, store.Claimed) // the failed calls created nothing

	// A stranger can do nothing to the owner's claim.
	expect(t, "Extend by a stranger", f.s.Extend(bg, k, "t2", longTTL), false)
	expect(t, "Complete by a stranger", f.s.Complete(bg, k, "t2", longTTL), false)
	expect(t, "Release by a stranger", f.s.Release(bg, k, "t2"), false)
	f.claim(t, k, "t3", longTTL, store.Processing)

	// Once done, nobody owns the key, not even the one who completed it.
	expect(t, "Complete by the owner", f.s.Complete(bg, k, "t1", longTTL), true)
	expect(t, "Complete again", f.s.Complete(bg, k, "t1", longTTL), false)
	expect(t, "Extend after done", f.s.Extend(bg, k, "t1", longTTL), false)
	expect(t, "Release after done", f.s.Release(bg, k, "t1"), false)
	f.claim(t, k, "t4", longTTL, store.Done)
}

func testRelease(t *testing.T, f *fixture) {
	k := f.key("k")
	f.claim(t, k, "t1", longTTL, store.Claimed)
	expect(t, "Release by the owner", f.s.Release(bg, k, "t1"), true)
	expect(t, "Release again", f.s.Release(bg, k, "t1"), false)
	expect(t, "Complete after release", f.s.Complete(bg, k, "t1", longTTL), false)
	f.claim(t, k, "t2", longTTL, store.Claimed)

	// A released claim leaves nothing behind: not abandoned once its
	// lease would have ended.
	j := f.key("j")
	// The lease is long enough for the release to come before it ends on
	// a loaded machine; the wait is past its end.
	f.claim(t, j, "t1", expired, store.Claimed)
	expect(t, "Release by the owner", f.s.Release(bg, j, "t1"), true)
	time.Sleep(expired + shortTTL)
	f.claim(t, j, "t2", longTTL, store.Claimed)
}

// A lease that ends without Complete or Release leaves an abandoned claim:
// owned by nobody, reported once by Claim, which removes it.
func testLeaseExpiry(t *testing.T, f *fixture) {
	k := f.key("k")
	f.claim(t, k, "t1", shortTTL, store.Claimed)
	time.Sleep(expired)
	expect(t, "Extend by the expired owner", f.s.Extend(bg, k, "t1", longTTL), false)
	expect(t, "Complete by the expired owner", f.s.Complete(bg, k, "t1", longTTL), false)
	expect(t, "Release by the expired owner", f.s.Release(bg, k, "t1"), false)
	f.claim(t, k, "t2", longTTL, store.Abandoned)
	// Claim took nothing for t2, and left the key absent.
	expect(t, "Complete by the claimer that found the claim abandoned", f.s.Complete(bg, k, "t2", longTTL), false)
	f.claim(t, k, "t3", longTTL, store.Claimed)
	f.claim(t, k, "t4", longTTL, store.Processing)
	expect(t, "Complete by the new owner", f.s.Complete(bg, k, "t3", longTTL), true)
}

func testConcurrentAbandonedClaims(t *testing.T, f *fixture) {
	const n = 64
	k := f.key("k")
	f.claim(t, k, "t0", shortTTL, store.Claimed)
	time.Sleep(expired)
	results := claimAtOnce(t, f, k, n)
	got := map[store.Status]int{}
	winner := -1
	for i := range n {
		got[results[i]]++
		if results[i] == store.Claimed {
			winner = i
		}
	}
	// The first claim finds the claim abandoned and removes it; of those
	// after it, one takes the key and the others find it processing.
	if got[store.Abandoned] != 1 || got[store.Claimed] != 1 || got[store.Processing] != n-2 {
		t.Fatalf("%d concurrent claims of an abandoned key: %d abandoned, %d claimed, %d processing, %d other; want 1, 1, %d, 0",
			n, got[store.Abandoned], got[store.Claimed], got[store.Processing], n-got[store.Abandoned]-got[store.Claimed]-got[store.Processing], n-2)
	}
	expect(t, "Complete by the winner", f.s.Complete(bg, k, fmt.Sprintf("token-%d", winner), longTTL), true)
}

func testExtend(t *testing.T, f *fixture) {
	k := f.key("k")
	f.claim(t, k, "t1", shortTTL, store.Claimed)
	expect(t, "Extend by the owner", f.s.Extend(bg, k, "t1", longTTL), true)
	time.Sleep(expired)
	f.claim(t, k, "t2", longTTL, store.Processing)
	// Extend also shortens: the lease runs from the call.
	expect(t, "Extend by the owner", f.s.Extend(bg, k, "t1", shortTTL), true)
	time.Sleep(expired)
	f.claim(t, k, "t3", longTTL, store.Abandoned)
	f.claim(t, k, "t3", longTTL, store.Claimed)
}

func testDoneExpiry(t *testing.T, f *fixture) {
	k := f.key("k")
	f.claim(t, k, "t1", longTTL, store.Claimed)
	expect(t, "Complete", f.s.Complete(bg, k, "t1", shortTTL), true)
	f.claim(t, k, "t2", longTTL, store.Done)
	time.Sleep(expired)
	f.claim(t, k, "t3", longTTL, store.Claimed)
}

func testKeysIndependent(t *testing.T, f *fixture) {
	a, b := f.key("a"), f.key("b")
	f.claim(t, a, "t1", longTTL, store.Claimed)
	f.claim(t, b, "t1", longTTL, store.Claimed)
	expect(t, "Complete a", f.s.Complete(bg, a, "t1", longTTL), true)
	f.claim(t, b, "t2", longTTL, store.Processing)
	expect(t, "Release b", f.s.Release(bg, b, "t1"), true)
	f.claim(t, a, "t2", longTTL, store.Done)

	// A failure counter does not touch the claim of the same key, nor the
	// reverse.
	if _, err := f.s.Fail(bg, a, longTTL); err != nil {
		t.Fatalf("Fail(a) error: %v", err)
	}
	if err := f.s.ResetFailures(bg, b); err != nil {
		t.Fatalf("ResetFailures(b) error: %v", err)
	}
	f.claim(t, a, "t3", longTTL, store.Done)
	f.claim(t, b, "t3", longTTL, store.Claimed)
	if n, err := f.s.Fail(bg, a, longTTL); err != nil || n != 2 {
		t.Fatalf("Fail(a) = %d, %v; want 2, nil", n, err)
	}
}

func fail(t *testing.T, f *fixture, k string, ttl time.Duration, want int64) {
	t.Helper()
	got, err := f.s.Fail(bg, k, ttl)
	if err != nil {
		t.Fatalf("Fail(%q) error: %v", k, err)
	}
	if got != want {
		t.Fatalf("Fail(%q) = %d; want %d", k, got, want)
	}
}

func testFailures(t *testing.T, f *fixture) {
	a, b := f.key("a"), f.key("b")
	fail(t, f, a, longTTL, 1)
	fail(t, f, a, longTTL, 2)
	fail(t, f, b, longTTL, 1)
	fail(t, f, a, longTTL, 3)
	if err := f.s.ResetFailures(bg, a); err != nil {
		t.Fatalf("ResetFailures error: %v", err)
	}
	if err := f.s.ResetFailures(bg, a); err != nil {
		t.Fatalf("ResetFailures of an absent counter error: %v", err)
	}
	fail(t, f, a, longTTL, 1)
	fail(t, f, b, longTTL, 2)
}

func testConcurrentFailures(t *testing.T, f *fixture) {
	const n = 64
	k := f.key("k")
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		seen = make(map[int64]bool)
	)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got, err := f.s.Fail(bg, k, longTTL)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Errorf("Fail error: %v", err)
				return
			}
			if seen[got] {
				t.Errorf("Fail returned %d twice; every call must return a new count", got)
			}
			seen[got] = true
		}()
	}
	wg.Wait()
	fail(t, f, k, longTTL, n+1)
}

func testFailureExpiry(t *testing.T, f *fixture) {
	k := f.key("k")
	fail(t, f, k, longTTL, 1)
	fail(t, f, k, shortTTL, 2) // each Fail sets the expiry afresh
	time.Sleep(expired)
	fail(t, f, k, longTTL, 1)
}

func testOddKeys(t *testing.T, f *fixture) {
	long := make([]byte, 4096)
	for i := range long {
		long[i] = 'a' + byte(i%26)
	}
	for i, k := range []string{
		"with spaces and: colons",
		"ünïcødé ключ 鍵",
		"{hash-tag}",
		"new\nline\x00nul",
		"done",
		string(long),
	} {
		k := f.key(k)
		tok := fmt.Sprintf("token-%d", i)
		f.claim(t, k, tok, longTTL, store.Claimed)
		f.claim(t, k, "other", longTTL, store.Processing)
		expect(t, fmt.Sprintf("Complete(%.40q)", k), f.s.Complete(bg, k, tok, longTTL), true)
		f.claim(t, k, "other", longTTL, store.Done)
		fail(t, f, k, longTTL, 1)
	}
}

// testHugeKey: a key of 64 KB of random bytes, which no compression
// shortens, is either held like any other or refused, by Claim and Fail
// alike, with an error wrapping store.ErrKeyRejected, having changed
// nothing.
func testHugeKey(t *testing.T, f *fixture) {
	k := f.key(randomHex(32 << 10))
	st, err := f.s.Claim(bg, k, "t1", longTTL)
	if err != nil {
		if !errors.Is(err, store.ErrKeyRejected) {
			t.Fatalf("Claim of a 64 KB key: %.200v; want Claimed, or an error wrapping store.ErrKeyRejected", err)
		}
		if _, err := f.s.Fail(bg, k, longTTL); !errors.Is(err, store.ErrKeyRejected) {
			t.Fatalf("Fail of a 64 KB key that Claim refused: %.200v; want an error wrapping store.ErrKeyRejected", err)
		}
		f.claim(t, f.key("after"), "t1", longTTL, store.Claimed)
		return
	}
	if st != store.Claimed {
		t.Fatalf("Claim of a 64 KB key = %v; want Claimed", st)
	}
	f.claim(t, k, "other", longTTL, store.Processing)
	expect(t, "Complete of a 64 KB key", f.s.Complete(bg, k, "t1", longTTL), true)
	f.claim(t, k, "other", longTTL, store.Done)
	fail(t, f, k, longTTL, 1)
}

func testDoneContext(t *testing.T, f *fixture) {
	ctx, cancel := context.WithCancel(bg)
	cancel()
	k := f.key("k")
	calls := map[string]func() error{
		"Claim":  func() error { _, err := f.s.Claim(ctx, k, "t1", longTTL); return err },
		"Extend": func() error { return f.s.Extend(ctx, k, "t1", longTTL) },
		"Complete": func() error {
			return f.s.Complete(ctx, k, "t1", longTTL)
		},
		"Release":       func() error { return f.s.Release(ctx, k, "t1") },
		"Fail":          func() error { _, err := f.s.Fail(ctx, k, longTTL); return err },
		"ResetFailures": func() error { return f.s.ResetFailures(ctx, k) },
	}
	for name, call := range calls {
		done := make(chan error, 1)
		go func() { done <- call() }()
		select {
		case err := <-done:
			if err == nil {
				t.Errorf("%s with a cancelled context = nil; want an error", name)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s with a cancelled context did not return within 5s", name)
		}
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b)
}
