package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
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

// exclusive is a handler that checks that two of its runs for a message
// never overlap, and that each message's effect happens once. A run
// takes a random while, up to most, and then applies its effect, unless
// its context ends first: it then stops within an interval of the lease
// (a third of it), at random, with the context's error.
type exclusive struct {
	t           *testing.T
	lease, most time.Duration

	mu      sync.Mutex
	rng     *rand.Rand
	running map[string]int
	effects map[string]int
}

func newExclusive(t *testing.T, seed uint64, lease, most time.Duration) *exclusive {
	return &exclusive{t: t, lease: lease, most: most, rng: rand.New(rand.NewPCG(seed, 2)),
		running: map[string]int{}, effects: map[string]int{}}
}

// draw returns a random duration below d.
func (x *exclusive) draw(d time.Duration) time.Duration {
	x.mu.Lock()
	defer x.mu.Unlock()
	return time.Duration(x.rng.Int64N(int64(d)))
}

func (x *exclusive) Handle(ctx context.Context, d *amqp.Delivery) error {
	id := d.MessageId
	x.mu.Lock()
	if x.running[id]++; x.running[id] > 1 {
		x.t.Errorf("%s: %d handlers at once at %v", id, x.running[id], time.Now())
	}
	x.mu.Unlock()
	defer func() {
		x.mu.Lock()
		x.running[id]--
		x.mu.Unlock()
	}()
	select {
	case <-ctx.Done():
		time.Sleep(x.draw(x.lease/3 - 1)) // slow to stop, within an interval
		return ctx.Err()
	case <-time.After(x.draw(x.most)):
	}
	x.mu.Lock()
	x.effects[id]++
	x.mu.Unlock()
	return nil
}

// deliver delivers messages m0, m1... (as many as messages) to h, each
// on as many consumers at once, each consumer again every 10 ms until h
// answers that the message is done or a duplicate; shutdowns cancels one
// delivery's context in ten, at random, while it runs. Then it checks
// that each message's effect happened once.
func (x *exclusive) deliver(h rabbitmw.Handler, messages, consumers int, shutdowns bool) {
	var wg sync.WaitGroup
	for m := range messages {
		id := fmt.Sprint("m", m)
		for range consumers {
			wg.Go(func() {
				var err error
				for range 2000 {
					ctx, cancel := context.WithCancel(context.Background())
					if shutdowns && x.draw(10) == 0 {
						time.AfterFunc(x.draw(x.lease), cancel)
					}
					d, _ := deliverytest.New(id, "")
					err = h.Handle(ctx, d)
					cancel()
					switch {
					case err == nil || errors.Is(err, rabbitmw.ErrDuplicate):
						return
					case rabbitmw.Decide(err).Outcome == rabbitmw.DeadLetter:
						x.t.Errorf("%s dead-lettered: %v", id, err)
						return
					}
					time.Sleep(10 * time.Millisecond)
				}
				x.t.Errorf("%s never done: %v", id, err)
			})
		}
	}
	wg.Wait()
	x.mu.Lock()
	defer x.mu.Unlock()
	for m := range messages {
		id := fmt.Sprint("m", m)
		if n := x.effects[id]; n != 1 {
			x.t.Errorf("%s: effect applied %d times; want once", id, n)
		}
	}
}
