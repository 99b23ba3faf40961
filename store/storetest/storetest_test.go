package storetest_test

import (
	"context"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/storetest"
	"github.com/stretchr/testify/require"
)

// A kit that cannot fail proves nothing. Each mutant below breaks one clause
// of the Store contract; the kit, run on it in a child process, must fail
// the case that checks that clause.
var mutants = map[string]struct {
	newStore func() store.Store
	failing  string // a case that must fail
}{
	"racy claim":                 {func() store.Store { return &racyClaim{Memory: store.NewMemory()} }, "ConcurrentClaims"},
	"complete ignores owner":     {func() store.Store { return &completeAnyone{Memory: store.NewMemory()} }, "OwnerChecks"},
	"release ignores owner":      {func() store.Store { return &releaseAnyone{Memory: store.NewMemory()} }, "OwnerChecks"},
	"lease never expires":        {func() store.Store { return &endlessLease{Memory: store.NewMemory()} }, "LeaseExpiry"},
	"extend does nothing":        {func() store.Store { return &noExtend{Memory: store.NewMemory()} }, "Extend"},
	"done never expires":         {func() store.Store { return &endlessDone{Memory: store.NewMemory()} }, "DoneExpiry"},
	"failures never expire":      {func() store.Store { return &endlessFailures{Memory: store.NewMemory()} }, "FailureExpiry"},
	"reset does nothing":         {func() store.Store { return &noReset{Memory: store.NewMemory()} }, "Failures"},
	"context ignored":            {func() store.Store { return &ignoresContext{Memory: store.NewMemory()} }, "DoneContext"},
	"keys truncated to 8 byte":   {func() store.Store { return &shortKeys{Memory: store.NewMemory()} }, "KeysIndependent"},
	"abandoned claims forgotten": {func() store.Store { return &forgetsAbandoned{Memory: store.NewMemory()} }, "LeaseExpiry"},
	"abandoned claims kept":      {func() store.Store { return &keepsAbandoned{Memory: store.NewMemory()} }, "LeaseExpiry"},
	"expired owner completes":    {func() store.Store { return &expiredOwner{Memory: store.NewMemory()} }, "LeaseExpiry"},
	"abandoned seen twice":       {func() store.Store { return &staleAbandoned{Memory: store.NewMemory()} }, "ConcurrentAbandonedClaims"},
}

func TestMemoryPasses(t *testing.T) {
	storetest.Run(t, func(*testing.T) store.Store { return store.NewMemory() })
}

func TestKitCatchesMutants(t *testing.T) {
	if name := os.Getenv("STORETEST_MUTANT"); name != "" {
		storetest.Run(t, func(*testing.T) store.Store { return mutants[name].newStore() })
		return
	}
	for name, m := range mutants {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], "-test.run=^TestKitCatchesMutants$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), "STORETEST_MUTANT="+name)
			out, err := cmd.CombinedOutput()
			require.Error(t, err, "the kit passed a store whose %s; want a failure\n%s", name, out)
			if want := "--- FAIL: TestKitCatchesMutants/" + m.failing + " "; !strings.Contains(string(out), want) {
				t.Fatalf("the kit did not fail case %s for a store whose %s; output:\n%s", m.failing, name, out)
			}
		})
	}
}

type racyClaim struct {
	*store.Memory
	mu    sync.Mutex
	owner map[string]string
}

// Claim checks, then sets, with a window between: the bug of SETNX emulated
// with GET and SET.
func (r *racyClaim) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	r.mu.Lock()
	_, taken := r.owner[key]
	r.mu.Unlock()
	if taken {
		return store.Processing, nil
	}
	time.Sleep(time.Millisecond)
	r.mu.Lock()
	if r.owner == nil {
		r.owner = map[string]string{}
	}
	r.owner[key] = token
	r.mu.Unlock()
	return store.Claimed, nil
}

type completeAnyone struct{ *store.Memory }

func (c *completeAnyone) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	if err := c.Memory.Complete(ctx, key, token, retention); err == nil {
		return nil
	}
	c.Memory.Claim(ctx, key, token, time.Hour)
	return nil
}

type releaseAnyone struct{ *store.Memory }

func (r *releaseAnyone) Release(ctx context.Context, key, token string) error {
	return nil
}

type endlessLease struct{ *store.Memory }

func (e *endlessLease) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	return e.Memory.Claim(ctx, key, token, time.Hour)
}

type noExtend struct{ *store.Memory }

func (n *noExtend) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	return nil
}

type endlessDone struct{ *store.Memory }

func (e *endlessDone) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return e.Memory.Complete(ctx, key, token, time.Hour)
}

type endlessFailures struct{ *store.Memory }

func (e *endlessFailures) Fail(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	return e.Memory.Fail(ctx, key, time.Hour)
}

type noReset struct{ *store.Memory }

func (n *noReset) ResetFailures(ctx context.Context, key string) error { return nil }

type ignoresContext struct{ *store.Memory }

func (i *ignoresContext) Claim(_ context.Context, key, token string, lease time.Duration) (store.Status, error) {
	return i.Memory.Claim(context.Background(), key, token, lease)
}

type shortKeys struct{ *store.Memory }

func short(k string) string {
	if i := strings.LastIndexByte(k, ':'); i >= 0 {
		k = k[:i+1] + "x"
	}
	return k
}

func (s *shortKeys) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	return s.Memory.Claim(ctx, short(key), token, lease)
}
func (s *shortKeys) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return s.Memory.Complete(ctx, short(key), token, retention)
}
func (s *shortKeys) Release(ctx context.Context, key, token string) error {
	return s.Memory.Release(ctx, short(key), token)
}

// forgetsAbandoned treats a claim whose lease ended as absent, as if the
// key expired with the lease.
type forgetsAbandoned struct{ *store.Memory }

func (f *forgetsAbandoned) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	st, err := f.Memory.Claim(ctx, key, token, lease)
	if st == store.Abandoned {
		return f.Memory.Claim(ctx, key, token, lease)
	}
	return st, err
}

// keepsAbandoned reports an abandoned claim, but leaves it in place: every
// later Claim reports it again.
type keepsAbandoned struct{ *store.Memory }

func (k *keepsAbandoned) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	st, err := k.Memory.Claim(ctx, key, token, lease)
	if st == store.Abandoned {
		k.Memory.Claim(ctx, key, "ghost", time.Nanosecond) // abandoned again at once
	}
	return st, err
}

// expiredOwner lets the last claimer of a key complete it after its lease
// ended.
type expiredOwner struct {
	*store.Memory
	mu   sync.Mutex
	last map[string]string // key -> the token of its last claim
}

func (e *expiredOwner) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	st, err := e.Memory.Claim(ctx, key, token, lease)
	if st == store.Claimed {
		e.mu.Lock()
		if e.last == nil {
			e.last = map[string]string{}
		}
		e.last[key] = token
		e.mu.Unlock()
	}
	return st, err
}

func (e *expiredOwner) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	err := e.Memory.Complete(ctx, key, token, retention)
	e.mu.Lock()
	mine := e.last[key] == token
	e.mu.Unlock()
	if err != nil && mine {
		if st, _ := e.Memory.Claim(ctx, key, token, time.Hour); st == store.Abandoned {
			e.Memory.Claim(ctx, key, token, time.Hour)
		}
		return e.Memory.Complete(ctx, key, token, retention)
	}
	return err
}

// staleAbandoned checks a claim's lease and removes the claim in two
// steps: for a while after one Claim found a key abandoned, others that
// read it before the removal report it abandoned too.
type staleAbandoned struct {
	*store.Memory
	mu    sync.Mutex
	until map[string]time.Time
}

func (s *staleAbandoned) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	st, err := s.Memory.Claim(ctx, key, token, lease)
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case st == store.Abandoned:
		if s.until == nil {
			s.until = map[string]time.Time{}
		}
		s.until[key] = time.Now().Add(50 * time.Millisecond)
	case st != store.Done && time.Now().Before(s.until[key]):
		if st == store.Claimed {
			s.Memory.Release(ctx, key, token)
		}
		return store.Abandoned, err
	}
	return st, err
}
