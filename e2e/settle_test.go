package e2e_test

// A consumer that stops gracefully cancels its handlers' context at its
// shutdown deadline. A handler may have just returned: the layers are then
// writing what its attempt leaves in the store (Dedup's done mark or
// release, Retry's failure count or its reset). These tests cut that
// context at every point of every store call made after the handler
// returned (just before the call, while it waits in the batcher's queue,
// while its request is on the wire, just after it), on every store, and
// then redeliver the message until it leaves the queue, as RabbitMQ would:
// its effect must happen once, and it must never wait out its lease.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// A cut is where, around one store call, the consumer's context ends.
type cut int

const (
	cutBefore cut = iota // as the call begins, with the context it was given
	cutQueued            // while the call waits in the batcher's queue behind another pipeline
	cutWire              // once the call's request is written to the server, before its answer
	cutAfter             // once the call returned
)

func (c cut) String() string {
	return [...]string{"before", "queued", "on the wire", "after"}[c]
}

// A settleBackend is a store under test, and the means to cut its calls.
type settleBackend struct {
	store   store.Store
	lease   time.Duration
	advance func(time.Duration) // lets d pass on the store's clock
	cuts    []cut
	wire    *wireTrip // nil without a network
	// queue runs call while another pipeline of the batcher is in flight,
	// and calls cut once call waits in the queue (on its context's Done),
	// before that pipeline's answer. Nil without a batcher.
	queue func(ctx context.Context, call func(context.Context) error, cut func()) error
}

// A wireTrip wraps a backend's connections and runs a function once, after
// the next write to any of them: the request is then on the wire.
type wireTrip struct{ armed atomic.Pointer[func()] }

func (w *wireTrip) arm(f func()) { w.armed.Store(&f) }
func (w *wireTrip) disarm()      { w.armed.Store(nil) }

func (w *wireTrip) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := new(net.Dialer).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &trippingConn{Conn: c, w: w}, nil
}

type trippingConn struct {
	net.Conn
	w *wireTrip
}

func (c *trippingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if f := c.w.armed.Swap(nil); f != nil {
		(*f)()
	}
	return n, err
}

// A pipelineGate is a redis.Hook that holds the next pipeline before it
// is sent, until the test lets it go.
type pipelineGate struct {
	hold atomic.Bool
	held chan struct{}
	open chan struct{}
}

func (g *pipelineGate) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (g *pipelineGate) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (g *pipelineGate) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if n := cmds[0].Name(); n != "hello" && n != "client" && g.hold.CompareAndSwap(true, false) {
			g.held <- struct{}{}
			<-g.open
		}
		return next(ctx, cmds)
	}
}

// doneWatch is a context that calls onDone the first time its Done is
// called: when the callee begins to wait on it.
type doneWatch struct {
	context.Context
	once   sync.Once
	onDone func()
}

func (c *doneWatch) Done() <-chan struct{} {
	c.once.Do(c.onDone)
	return c.Context.Done()
}

func memoryBackend(*testing.T) settleBackend {
	return settleBackend{
		store: store.NewMemory(), lease: time.Minute,
		advance: time.Sleep, // in a synctest bubble
		cuts:    []cut{cutBefore, cutAfter},
	}
}

func miniredisBackend(batched bool) func(*testing.T) settleBackend {
	return func(t *testing.T) settleBackend {
		m := miniredis.RunT(t) // TTLs pass by FastForward
		w := new(wireTrip)
		c := redis.NewClient(&redis.Options{Addr: m.Addr(), ContextTimeoutEnabled: true, Dialer: w.dial})
		t.Cleanup(func() { c.Close() })
		b := settleBackend{lease: time.Minute, advance: m.FastForward, wire: w, cuts: []cut{cutBefore, cutWire, cutAfter}}
		if !batched {
			b.store = redisstore.New(c, redisstore.Options{NoBatching: true})
			return b
		}
		g := &pipelineGate{held: make(chan struct{}), open: make(chan struct{})}
		c.AddHook(g)
		batcher := redisstore.NewBatcher(c, redisstore.BatcherOptions{})
		b.store = redisstore.New(batcher, redisstore.Options{})
		b.cuts = append(b.cuts, cutQueued)
		b.queue = func(ctx context.Context, call func(context.Context) error, cut func()) error {
			g.hold.Store(true)
			other := make(chan struct{})
			go func() {
				defer close(other)
				batcher.Del(context.Background(), "another-caller")
			}()
			<-g.held
			err := call(&doneWatch{Context: ctx, onDone: func() {
				cut()
				go func() { g.open <- struct{}{} }()
			}})
			<-other
			return err
		}
		return b
	}
}

func postgresBackend(t *testing.T) settleBackend {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	require.NoError(t, err)
	w := new(wireTrip)
	cfg.ConnConfig.DialFunc = w.dial
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	table := fmt.Sprintf("rmwtest_settle_%d", time.Now().UnixNano())
	t.Cleanup(func() {
		pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+table+`, `+table+`_failures`)
	})
	s := pgstore.New(pool, pgstore.Options{Table: table})
	t.Cleanup(s.Close)
	require.NoError(t, s.Migrate(context.Background()))
	return settleBackend{
		store: s, lease: 2 * time.Second, // on the database's clock
		advance: time.Sleep, wire: w,
		cuts: []cut{cutBefore, cutWire, cutAfter},
	}
}

// cuttingStore counts the calls made after the handler returned (the
// settlement calls) and cuts the consumer's context around one of them.
type cuttingStore struct {
	store.Store
	b *settleBackend

	mu     sync.Mutex
	armed  bool // the handler of the delivery in progress has returned
	n      int  // settlement calls so far
	at     int  // the call to cut around, from 1; 0: none
	how    cut
	cancel context.CancelFunc // the delivery in progress's
}

// begin starts a delivery whose context cancel ends.
func (s *cuttingStore) begin(cancel context.CancelFunc) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.armed, s.cancel = false, cancel
}

// returned is called when the handler returns.
func (s *cuttingStore) returned() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.armed = true
}

func (s *cuttingStore) calls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.n
}

func (s *cuttingStore) settle(ctx context.Context, call func(context.Context) error) error {
	s.mu.Lock()
	if s.armed {
		s.n++
	}
	hit, cancel := s.armed && s.n == s.at, s.cancel
	s.mu.Unlock()
	if !hit {
		return call(ctx)
	}
	switch s.how {
	case cutBefore:
		cancel()
		return call(ctx)
	case cutQueued:
		return s.b.queue(ctx, call, cancel)
	case cutWire:
		s.b.wire.arm(cancel)
		defer s.b.wire.disarm()
		return call(ctx)
	}
	err := call(ctx)
	cancel()
	return err
}

func (s *cuttingStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return s.settle(ctx, func(ctx context.Context) error { return s.Store.Complete(ctx, key, token, retention) })
}

func (s *cuttingStore) Release(ctx context.Context, key, token string) error {
	return s.settle(ctx, func(ctx context.Context) error { return s.Store.Release(ctx, key, token) })
}

func (s *cuttingStore) Fail(ctx context.Context, key string, ttl time.Duration) (n int64, err error) {
	err = s.settle(ctx, func(ctx context.Context) (err error) { n, err = s.Store.Fail(ctx, key, ttl); return err })
	return n, err
}

func (s *cuttingStore) ResetFailures(ctx context.Context, key string) error {
	return s.settle(ctx, func(ctx context.Context) error { return s.Store.ResetFailures(ctx, key) })
}

// settleRun is what became of one message.
type settleRun struct {
	calls, effects int     // handler calls; of those, successes
	results        []error // of each delivery
	ended          rabbitmw.Outcome
	settlement     int // store calls made after the handler returned
	failures       int64
}

// runSettle delivers message id until it leaves the queue, through the
// recommended stack over b's store, with the handler failing its first
// attempt if failFirst, and the consumer's context cut around settlement
// call at (from 1; 0 for none) as how says.
func runSettle(t *testing.T, b settleBackend, id string, failFirst bool, at int, how cut) settleRun {
	cs := &cuttingStore{Store: b.store, b: &b, at: at, how: how}
	var r settleRun
	stack := middleware.Stack(cs, middleware.StackOptions{
		Retry:   middleware.RetryOptions{MaxAttempts: 10, Backoff: func(int) time.Duration { return time.Millisecond }},
		Dedup:   middleware.DedupOptions{Lease: b.lease},
		Timeout: b.lease / 2,
	})
	h := stack(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
		defer cs.returned()
		r.calls++
		if r.calls == 1 && failFirst {
			return errBoom
		}
		r.effects++
		return nil
	}))
	for i := range 10 {
		ctx, cancel := context.WithCancel(context.Background())
		cs.begin(cancel)
		d, _ := deliverytest.New(id, "")
		d.Redelivered = i > 0
		err := h.Handle(ctx, d)
		cancel()
		r.results = append(r.results, err)
		switch r.ended = rabbitmw.Decide(err).Outcome; r.ended {
		case rabbitmw.Ack, rabbitmw.Duplicate, rabbitmw.DeadLetter:
			r.settlement = cs.calls()
			n, ferr := b.store.Fail(context.Background(), id, time.Minute)
			require.NoError(t, ferr)
			r.failures = n - 1
			return r
		}
		if errors.Is(err, middleware.ErrBusy) {
			b.advance(b.lease) // as RabbitMQ would redeliver it, over and over
		}
	}
	t.Fatalf("message %q still in the queue after 10 deliveries: %v", id, r.results)
	return r
}

var errBoom = errors.New("boom")

func TestStackCancelledDuringSettlement(t *testing.T) {
	backends := []struct {
		name     string
		make     func(*testing.T) settleBackend
		synctest bool
	}{
		{"memory", memoryBackend, true},
		{"redis batched", miniredisBackend(true), false},
		{"redis unbatched", miniredisBackend(false), false},
		{"postgres", postgresBackend, false},
	}
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			run := func(t *testing.T) {
				b := be.make(t)
				for _, failFirst := range []bool{false, true} {
					wantCalls := 1
					if failFirst {
						wantCalls = 2
					}
					// A run without a cut counts the settlement calls.
					clean := runSettle(t, b, fmt.Sprintf("clean-%v", failFirst), failFirst, 0, cutBefore)
					require.Equal(t, rabbitmw.Ack, clean.ended, "without a cut: %v", clean.results)
					require.Equal(t, wantCalls, clean.calls, "without a cut: %v", clean.results)
					for at := 1; at <= clean.settlement; at++ {
						for _, how := range b.cuts {
							name := fmt.Sprintf("fail first %v, call %d, %v", failFirst, at, how)
							id := fmt.Sprintf("m-%v-%d-%d", failFirst, at, how)
							r := runSettle(t, b, id, failFirst, at, how)
							assert.Equal(t, 1, r.effects, "%s: effects (results %v)", name, r.results)
							assert.Equal(t, wantCalls, r.calls, "%s: handler calls (results %v)", name, r.results)
							assert.Contains(t, []rabbitmw.Outcome{rabbitmw.Ack, rabbitmw.Duplicate}, r.ended, "%s: the message ended (results %v)", name, r.results)
							for i, err := range r.results {
								assert.False(t, errors.Is(err, middleware.ErrBusy) || errors.Is(err, middleware.ErrAbandoned),
									"%s: delivery %d waited out the lease: %v", name, i+1, err)
							}
							assert.Zero(t, r.failures, "%s: a failure count was left", name)
						}
					}
				}
			}
			if be.synctest {
				synctest.Test(t, run)
				return
			}
			run(t)
		})
	}
}
