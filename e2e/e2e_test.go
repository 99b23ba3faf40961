package e2e_test

// End to end: the recommended stack, the broker and the Redis store
// together, on real servers (RabbitMQ and Redis) and on the in-memory
// broker with miniredis.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// servers is where an end-to-end test runs.
type servers struct {
	broker *broker.Broker
	store  store.Store
	drop   func(t *testing.T) // closes every connection to the broker
}

func realServers(t *testing.T) servers {
	url, addr := testenv.RabbitMQURL(t), testenv.RedisAddr(t)
	// The connections carry a name unique to the test, so that the test
	// closes its own and no other package's.
	marker := fmt.Sprintf("e2e-%d", time.Now().UnixNano())
	b := broker.New(url, broker.Options{Process: marker})
	t.Cleanup(func() { b.Close() })
	c := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	prefix := fmt.Sprintf("rabbitmw-e2e:%s:%d:", t.Name(), time.Now().UnixNano())
	t.Cleanup(func() {
		ctx := context.Background()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			c.Del(ctx, iter.Val())
		}
		c.Close()
	})
	return servers{
		broker: b,
		store:  redisstore.New(c, redisstore.Options{Prefix: prefix}),
		drop: func(t *testing.T) {
			if testenv.CloseConnections(t, marker, "rabbitmw end-to-end test") == 0 {
				t.Error("no connection to close")
			}
		},
	}
}

func memoryServers(t *testing.T) servers {
	m := brokertest.NewServer()
	t.Cleanup(m.Close)
	b := broker.New(m.URL(), broker.Options{})
	t.Cleanup(func() { b.Close() })
	_, c, _ := redistest.Start(t)
	return servers{
		broker: b,
		store:  redisstore.New(c, redisstore.Options{}),
		drop: func(t *testing.T) {
			if m.CloseConnections() == 0 {
				t.Error("no connection to close")
			}
		},
	}
}

// effects counts business effects per message id, and deliveries that
// left the queue for good (acknowledged, as done or as duplicates, or
// dead-lettered).
type effectCounter struct {
	m        sync.Map // id -> *atomic.Int64
	total    atomic.Int64
	ended    atomic.Int64
	inflight atomic.Int64

	// Set before the handler runs, by newEffectCounter.
	marks  []int64         // totals of effects ...
	passed []chan struct{} // ... each closed when the total reaches its mark
}

// newEffectCounter returns a counter with a channel closed at each of the
// totals of effects in marks.
func newEffectCounter(marks ...int64) *effectCounter {
	e := &effectCounter{marks: marks}
	for range marks {
		e.passed = append(e.passed, make(chan struct{}))
	}
	return e
}

// observe is an outermost layer that counts the deliveries that end.
func (e *effectCounter) observe(next rabbitmw.Handler) rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		e.inflight.Add(1)
		defer e.inflight.Add(-1)
		err := next.Handle(ctx, d)
		switch rabbitmw.Decide(err).Outcome {
		case rabbitmw.Ack, rabbitmw.Duplicate, rabbitmw.DeadLetter:
			e.ended.Add(1)
		}
		return err
	})
}

func (e *effectCounter) handler() rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		v, _ := e.m.LoadOrStore(d.MessageId, new(atomic.Int64))
		v.(*atomic.Int64).Add(1)
		total := e.total.Add(1)
		for i, m := range e.marks {
			if total == m {
				close(e.passed[i])
			}
		}
		return nil
	})
}

// check returns the ids applied other than once among want.
func (e *effectCounter) check(want []string) (missing, twice []string) {
	for _, id := range want {
		v, ok := e.m.Load(id)
		switch n := int64(0); {
		case ok && v.(*atomic.Int64).Load() > 1:
			twice = append(twice, id)
		case !ok || v.(*atomic.Int64).Load() == n:
			missing = append(missing, id)
		}
	}
	return missing, twice
}

// e2eStack is the recommended stack with delays short enough for a test.
func e2eStack(st store.Store) rabbitmw.Middleware {
	return middleware.Stack(st, middleware.StackOptions{
		Retry:   middleware.RetryOptions{Backoff: middleware.Exponential(20*time.Millisecond, 200*time.Millisecond)},
		Dedup:   middleware.DedupOptions{BusyDelay: 50 * time.Millisecond, UnavailableDelay: 50 * time.Millisecond},
		Timeout: 10 * time.Second,
	})
}

var e2eTopology = broker.Topology{Delays: []time.Duration{50 * time.Millisecond, 200 * time.Millisecond, time.Second}}

// runE2E publishes n messages (every fifth id published twice more, some
// copies at once), consumes them with two consumers, closes every broker
// connection drops times along the way, and checks that every message had
// its effect exactly once and the queue ends empty.
func runE2E(t *testing.T, srv servers, n, drops int) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	queue := fmt.Sprintf("rabbitmw-e2e-%d", time.Now().UnixNano())
	t.Cleanup(func() { srv.broker.Delete(context.Background(), queue, e2eTopology) })
	require.NoError(t, srv.broker.Declare(ctx, queue, e2eTopology))
	names, err := e2eTopology.Queues(queue)
	require.NoError(t, err)

	// The connections drop as the effects pass even intervals, so the
	// consumers are at work at each drop.
	var marks []int64
	for i := 1; i <= drops; i++ {
		marks = append(marks, int64(n*i/(drops+1)))
	}
	fx := newEffectCounter(marks...)
	h := rabbitmw.Chain(fx.observe, e2eStack(srv.store))(fx.handler())
	// consume starts the two consumers; stop stops them and checks that
	// they ended well.
	consume := func() (stop func()) {
		consumeCtx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i := range errs {
			wg.Go(func() {
				errs[i] = srv.broker.Consume(consumeCtx, queue, h, broker.ConsumeOptions{Topology: e2eTopology})
			})
		}
		return func() {
			cancel()
			wg.Wait()
			for i, err := range errs {
				assert.NoError(t, err, "consumer %d", i)
			}
		}
	}
	stop := consume()

	ids := make([]string, n)
	var copies []string
	for i := range ids {
		ids[i] = fmt.Sprintf("m-%05d", i)
		copies = append(copies, ids[i])
		if i%5 == 0 {
			copies = append(copies, ids[i], ids[i])
		}
	}
	// Publish from 16 goroutines.
	pubDone := make(chan struct{})
	go func() {
		defer close(pubDone)
		var pw sync.WaitGroup
		work := make(chan string)
		for range 16 {
			pw.Add(1)
			go func() {
				defer pw.Done()
				for id := range work {
					assert.NoError(t, srv.broker.Publish(ctx, "", queue, amqp.Publishing{MessageId: id, Body: []byte(id)}), "publish %s", id)
				}
			}()
		}
		for _, id := range copies {
			work <- id
		}
		close(work)
		pw.Wait()
	}()
	for _, passed := range fx.passed {
		select {
		case <-passed:
		case <-ctx.Done():
		}
		srv.drop(t)
	}
	<-pubDone

	// Every copy has ended (a copy delayed while another consumer held its
	// claim comes back through a delay queue; a copy whose settlement a
	// dropped connection lost comes back too), and nothing is left in the
	// work queue, the delay queues or a handler. Then the consumers stop,
	// and the server returns to the work queue what they held and had not
	// handled yet (prefetched), which neither Len nor a handler shows: if
	// the queues are still empty, nothing is left anywhere; else the
	// consumers start again.
	empty := func() bool {
		for _, q := range append([]string{queue}, names.Delays...) {
			if l, err := srv.broker.Len(ctx, q); err != nil || l != 0 {
				return false
			}
		}
		return true
	}
	quiet := func() bool {
		return fx.ended.Load() >= int64(len(copies)) && fx.inflight.Load() == 0 && empty()
	}
	poll := time.NewTicker(20 * time.Millisecond) // the queues are the server's: polled
	defer poll.Stop()
	for {
		for !quiet() && ctx.Err() == nil {
			select {
			case <-poll.C:
			case <-ctx.Done():
			}
		}
		stop()
		if empty() || ctx.Err() != nil {
			break
		}
		t.Log("messages back in the queues when the consumers stopped: consuming again")
		stop = consume()
	}
	missing, twice := fx.check(ids)
	if len(missing) > 0 || len(twice) > 0 {
		t.Errorf("%d ids never applied (first: %v), %d applied more than once (first: %v)", len(missing), first(missing), len(twice), first(twice))
	}
	if got := fx.total.Load(); got != int64(n) {
		t.Errorf("%d effects for %d messages; want one each", got, n)
	}
	for _, q := range []string{names.Work, names.DeadLetter} {
		if l, err := srv.broker.Len(context.Background(), q); err != nil || l != 0 {
			t.Errorf("Len(%s) = %d, %v; want 0", q, l, err)
		}
	}
	if got := fx.ended.Load(); got < int64(len(copies)) {
		t.Errorf("%d deliveries ended (acked or dead-lettered); want at least the %d copies published", got, len(copies))
	}
	t.Logf("%d messages, %d copies published, %d connection drops: %d effects, %d deliveries ended", n, len(copies), drops, fx.total.Load(), fx.ended.Load())
}

func first(ids []string) []string { return ids[:min(len(ids), 5)] }

// 10,000 messages through the stack with the Redis store on real servers.
func TestEndToEnd10000(t *testing.T) {
	runE2E(t, realServers(t), 10000, 0)
}

// The server closes every connection, twice, mid-stream.
func TestEndToEndConnectionLoss(t *testing.T) {
	t.Run("rabbitmq", func(t *testing.T) { runE2E(t, realServers(t), 3000, 2) })
	// miniredis, one lock for all its clients, bounds this one to a few
	// hundred messages a second.
	t.Run("memory", func(t *testing.T) { runE2E(t, memoryServers(t), 1000, 3) })
}
