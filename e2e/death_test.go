package e2e_test

// A message that kills its consumer process (SIGKILL, an OOM, a segfault
// in cgo) must not loop forever: each attempt that never finished counts
// as a failed attempt, and after MaxAttempts of them the message is
// dead-lettered with a reason that says so.
//
// A process is emulated by a stack over its own view of the shared store:
// when the process dies, its view dies with it, so nothing it started
// (a renewal, a release, a done mark) reaches the store any more, exactly
// as after a SIGKILL. The handler that kills it never returns.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

var errDead = errors.New("test: the process is dead")

// mortalStore is the shared store as one process sees it: once the
// process is dead, every call fails without reaching the store.
type mortalStore struct {
	store.Store
	dead atomic.Bool
}

func (s *mortalStore) kill() { s.dead.Store(true) }

func (s *mortalStore) live() error {
	if s.dead.Load() {
		return errDead
	}
	return nil
}

func (s *mortalStore) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	if err := s.live(); err != nil {
		return 0, err
	}
	return s.Store.Claim(ctx, key, token, lease)
}

func (s *mortalStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	if err := s.live(); err != nil {
		return err
	}
	return s.Store.Extend(ctx, key, token, lease)
}

func (s *mortalStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	if err := s.live(); err != nil {
		return err
	}
	return s.Store.Complete(ctx, key, token, retention)
}

func (s *mortalStore) Release(ctx context.Context, key, token string) error {
	if err := s.live(); err != nil {
		return err
	}
	return s.Store.Release(ctx, key, token)
}

func (s *mortalStore) Fail(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	if err := s.live(); err != nil {
		return 0, err
	}
	return s.Store.Fail(ctx, key, ttl)
}

func (s *mortalStore) ResetFailures(ctx context.Context, key string) error {
	if err := s.live(); err != nil {
		return err
	}
	return s.Store.ResetFailures(ctx, key)
}

const deathAttempts = 3 // MaxAttempts of the stacks below

// deathStack is the recommended stack over st, with MaxAttempts
// deathAttempts and delays short enough for a test.
func deathStack(st store.Store, lease time.Duration) rabbitmw.Middleware {
	return rabbitmw.Chain(
		middleware.Retry(st, middleware.RetryOptions{MaxAttempts: deathAttempts, Backoff: middleware.Exponential(20*time.Millisecond, 200*time.Millisecond)}),
		middleware.Recover(),
		middleware.Dedup(st, middleware.DedupOptions{Lease: lease, BusyDelay: 50 * time.Millisecond, UnavailableDelay: 50 * time.Millisecond}),
		middleware.Timeout(10*time.Second),
	)
}

// The recommended stack, delivery by delivery (as on a plain channel): the
// message kills the process that handles it, a new process takes over,
// and the message is redelivered, until it is dead-lettered.
func TestStackMessageThatKillsItsConsumer(t *testing.T) {
	t.Run("memory", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			checkKillerDeadLettered(t, store.NewMemory(), time.Sleep)
		})
	})
	t.Run("miniredis", func(t *testing.T) {
		m, c, _ := redistest.Start(t)
		checkKillerDeadLettered(t, redisstore.New(c, redisstore.Options{}), m.FastForward)
	})
}

// checkKillerDeadLettered delivers a message that kills its consumer to
// one process after another, over shared; advance moves the store's clock.
func checkKillerDeadLettered(t *testing.T, shared store.Store, advance func(time.Duration)) {
	const lease = time.Minute
	msg := amqp.Publishing{MessageId: "kills-its-consumer", Body: []byte("x")}
	var mortal *mortalStore
	var h rabbitmw.Handler
	restart := func() { // a supervisor starts a new consumer process
		mortal = &mortalStore{Store: shared}
		h = deathStack(mortal, lease)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
			mortal.kill()
			runtime.Goexit() // the process is gone: nothing returns
			return nil
		}))
	}
	restart()
	crashes := 0
	for i := range 50 {
		dec, died := deliverOnce(h, msg, i > 0)
		switch {
		case died:
			crashes++
			if crashes > deathAttempts {
				t.Fatalf("the message killed its consumer %d times; want it dead-lettered after %d", crashes, deathAttempts)
			}
			restart()
		case dec.Outcome == rabbitmw.DeadLetter:
			if crashes != deathAttempts {
				t.Errorf("dead-lettered after %d crashes; want %d", crashes, deathAttempts)
			}
			if dec.Attempts != deathAttempts {
				t.Errorf("dead-lettered with attempts %d; want %d", dec.Attempts, deathAttempts)
			}
			if reason := dec.Err.Error(); !strings.Contains(reason, "consumer died") {
				t.Errorf("dead-letter reason %q; want it to say that the consumer died while handling the message", reason)
			}
			return
		case errors.Is(dec.Err, middleware.ErrBusy):
			// The dead process's claim holds until its lease ends: a
			// redelivery meanwhile is delayed as busy, and not counted.
			if dec.Attempts != 0 {
				t.Errorf("a busy delivery carries attempts %d; want it not counted", dec.Attempts)
			}
			advance(lease)
		case dec.Outcome == rabbitmw.Delay || dec.Outcome == rabbitmw.Requeue:
			// Retry's backoff, or a requeue: redelivered.
		default:
			t.Fatalf("delivery %d: %v (%v); want a crash, a delay or a dead-letter", i+1, dec.Outcome, dec.Err)
		}
	}
	t.Fatalf("not dead-lettered after 50 deliveries (%d crashes); want dead-lettered after %d crashes", crashes, deathAttempts)
}

// deliverOnce hands a delivery of msg to h and returns what h decided, or
// died if h never returned (its process died).
func deliverOnce(h rabbitmw.Handler, msg amqp.Publishing, redelivered bool) (dec rabbitmw.Decision, died bool) {
	done := make(chan struct{})
	died = true
	go func() {
		defer close(done)
		d := &amqp.Delivery{MessageId: msg.MessageId, Body: msg.Body, Headers: msg.Headers, Redelivered: redelivered}
		err := h.Handle(context.Background(), d)
		dec, died = rabbitmw.Decide(err), false
	}()
	<-done
	return dec, died
}

// The same through broker.Consume, on the in-memory broker with miniredis
// and on RabbitMQ with Redis, on a classic and on a quorum queue (with a
// delivery limit, as the README recommends). A killed process is a
// Consume whose handler never returns and whose store is dead; it is
// cancelled, so that it gives up its connection (and RabbitMQ redelivers
// its message) as a dead process's connection would drop.
func TestConsumeMessageThatKillsItsConsumer(t *testing.T) {
	topologies := map[string]broker.Topology{
		"classic": {Delays: e2eTopology.Delays},
		"quorum":  {Delays: e2eTopology.Delays, Quorum: true, DeliveryLimit: 3},
	}
	for _, backend := range []struct {
		name    string
		servers func(*testing.T) servers
	}{{"memory", memoryServers}, {"rabbitmq", realServers}} {
		for name, top := range topologies {
			t.Run(backend.name+"/"+name, func(t *testing.T) {
				runKiller(t, backend.servers(t), top)
			})
		}
	}
}

func runKiller(t *testing.T, srv servers, top broker.Topology) {
	const lease = 500 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	queue := fmt.Sprintf("rabbitmw-killer-%d", time.Now().UnixNano())
	t.Cleanup(func() { srv.broker.Delete(context.Background(), queue, top) })
	require.NoError(t, srv.broker.Declare(ctx, queue, top))
	names, err := top.Queues(queue)
	require.NoError(t, err)
	// The handlers of dead processes never return while the test runs.
	gone := make(chan struct{})
	var consumers sync.WaitGroup
	t.Cleanup(func() {
		close(gone)
		consumers.Wait()
	})
	var crashes atomic.Int64
	start := func() (died <-chan struct{}, stop context.CancelFunc) {
		pctx, stop := context.WithCancel(ctx)
		mortal := &mortalStore{Store: srv.store}
		dead := make(chan struct{})
		var once sync.Once
		h := deathStack(mortal, lease)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
			once.Do(func() {
				crashes.Add(1)
				mortal.kill()
				stop() // its connection goes, as a dead process's would
				close(dead)
			})
			<-gone
			return errDead
		}))
		consumers.Add(1)
		go func() {
			defer consumers.Done()
			// A killed process ends with ErrShutdownTimeout: its handler
			// did not return.
			srv.broker.Consume(pctx, queue, h, broker.ConsumeOptions{Topology: top, ShutdownTimeout: time.Millisecond})
		}()
		return dead, stop
	}
	require.NoError(t, srv.broker.Publish(ctx, "", queue, amqp.Publishing{MessageId: "kills-its-consumer", Body: []byte("x")}))

	died, stop := start()
	defer func() { stop() }()
	for {
		if n, err := srv.broker.Len(ctx, names.DeadLetter); err != nil {
			t.Fatal(err)
		} else if n > 0 {
			break
		}
		select {
		case <-died:
			if n := crashes.Load(); n > deathAttempts {
				t.Fatalf("the message killed its consumer %d times; want it dead-lettered after %d", n, deathAttempts)
			}
			died, stop = start() // the supervisor restarts it
		case <-ctx.Done():
			t.Fatalf("not dead-lettered within the test's time (%d crashes): %v", crashes.Load(), ctx.Err())
		case <-time.After(20 * time.Millisecond): // polls the server's queue
		}
	}
	stop()
	if n := crashes.Load(); n != deathAttempts {
		t.Errorf("dead-lettered after %d crashes; want %d", n, deathAttempts)
	}
	d, ok, err := srv.broker.Get(ctx, names.DeadLetter)
	if err != nil || !ok {
		t.Fatalf("Get(%s) = %v, %v", names.DeadLetter, ok, err)
	}
	d.Ack(false)
	if reason, _ := d.Headers[broker.HeaderError].(string); !strings.Contains(reason, "consumer died") {
		t.Errorf("%s = %q; want it to say that the consumer died while handling the message", broker.HeaderError, reason)
	}
	if n, _ := d.Headers[rabbitmw.HeaderAttempts].(int64); n != deathAttempts {
		t.Errorf("%s = %v; want %d", rabbitmw.HeaderAttempts, d.Headers[rabbitmw.HeaderAttempts], deathAttempts)
	}
	for _, q := range append([]string{names.Work, names.DeadLetter}, names.Delays...) {
		if n, err := srv.broker.Len(ctx, q); err != nil || n != 0 {
			t.Errorf("Len(%s) = %d, %v; want 0", q, n, err)
		}
	}
}
