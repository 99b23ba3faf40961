package middleware_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/store"
)

// Every goroutine a layer starts (lease renewals) must have ended when its
// delivery is done.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var errBoom = errors.New("boom")

// effects counts calls of a handler per message id.
type effects struct {
	mu sync.Mutex
	n  map[string]int
}

func (e *effects) add(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = map[string]int{}
	}
	e.n[id]++
}

func (e *effects) count(id string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[id]
}

// faultyStore wraps a Store and can fail each operation on demand.
type faultyStore struct {
	store.Store
	claim, extend, complete, release, fail atomic.Pointer[error]
	calls                                  sync.Map // op name -> *atomic.Int64
}

func (f *faultyStore) count(op string) {
	v, _ := f.calls.LoadOrStore(op, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

// Calls returns how many times op was called.
func (f *faultyStore) Calls(op string) int64 {
	v, ok := f.calls.Load(op)
	if !ok {
		return 0
	}
	return v.(*atomic.Int64).Load()
}

func set(p *atomic.Pointer[error], err error) {
	if err == nil {
		p.Store(nil)
		return
	}
	p.Store(&err)
}

func get(p *atomic.Pointer[error]) error {
	if e := p.Load(); e != nil {
		return *e
	}
	return nil
}

func (f *faultyStore) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	f.count("claim")
	if err := get(&f.claim); err != nil {
		return 0, err
	}
	return f.Store.Claim(ctx, key, token, lease)
}

func (f *faultyStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	f.count("extend")
	if err := get(&f.extend); err != nil {
		return err
	}
	return f.Store.Extend(ctx, key, token, lease)
}

func (f *faultyStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	f.count("complete")
	if err := get(&f.complete); err != nil {
		return err
	}
	return f.Store.Complete(ctx, key, token, retention)
}

func (f *faultyStore) Release(ctx context.Context, key, token string) error {
	f.count("release")
	if err := get(&f.release); err != nil {
		return err
	}
	return f.Store.Release(ctx, key, token)
}

func (f *faultyStore) Fail(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	f.count("fail")
	if err := get(&f.fail); err != nil {
		return 0, err
	}
	return f.Store.Fail(ctx, key, ttl)
}

func (f *faultyStore) ResetFailures(ctx context.Context, key string) error {
	f.count("reset")
	return f.Store.ResetFailures(ctx, key)
}
