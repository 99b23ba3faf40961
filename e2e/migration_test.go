package e2e_test

// Migration from the hand-written pattern, on real servers: hand-written
// consumers (legacyConsumer, on a plain amqp091 channel) and broker.Consume
// with Topology{Declare: DeclareSupport} share one work queue, declared the
// hand-written way, and one Redis with the store's default key layout.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// migrationTopology is the setup the README gives for a work queue that
// hand-written consumers declare, with delays short enough for a test.
var migrationTopology = broker.Topology{Declare: broker.DeclareSupport, Delays: e2eTopology.Delays}

// declarePlain declares queue as hand-written consumers do:
// queue_declare(durable=True), no arguments.
func declarePlain(ch *amqp.Channel, queue string) error {
	_, err := ch.QueueDeclare(queue, true, false, false, false, nil)
	return err
}

// declarePlainOnce declares queue the hand-written way on a connection of
// its own, and returns the server's answer.
func declarePlainOnce(t *testing.T, url, queue string) error {
	t.Helper()
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	return declarePlain(ch, queue)
}

// runHandWritten is one hand-written consumer process: it declares queue
// (declarePlain), takes one delivery at a time (prefetch 1) and settles each
// by legacyConsumer's answer, until ctx is done; it finishes the delivery in
// hand and closes its connection, and the server requeues what it had
// prefetched. It returns nil when ctx ended it, else what stopped it: a
// refused declare is the crash of a restarting hand-written consumer.
func runHandWritten(ctx context.Context, url, queue string, c *redis.Client, effect func(string) error, settled func(string)) error {
	conn, err := amqp.Dial(url)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := declarePlain(ch, queue); err != nil {
		return fmt.Errorf("queue_declare(%q, durable=True): %w", queue, err)
	}
	if err := ch.Qos(1, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case d, ok := <-deliveries:
			if !ok {
				return errors.New("hand-written consumer: channel closed")
			}
			r := legacyConsumer(context.WithoutCancel(ctx), c, &d, effect)
			if r == "requeued" {
				err = d.Nack(false, true)
			} else {
				err = d.Ack(false)
			}
			settled(r)
			if err != nil {
				return err
			}
		}
	}
}

// A fleetKind is one of the two kinds of consumer in the mixed fleet.
type fleetKind int

const (
	handWrittenKind fleetKind = iota
	rabbitmwKind
)

func (k fleetKind) String() string {
	if k == handWrittenKind {
		return "hand-written"
	}
	return "rabbitmw"
}

// migrationRun is one queue, one Redis and the consumers of a mixed fleet.
type migrationRun struct {
	t     *testing.T
	ctx   context.Context
	url   string
	queue string
	names broker.Queues
	rdb   *redis.Client
	st    store.Store
	b     *broker.Broker   // the test's own: publishes and reads the queues
	conn  *amqp.Connection // the test's own: counts the consumers

	ids     []string // every message published, but the poison one
	copies  int      // copies published, the poison one included
	effects sync.Map // id -> *atomic.Int64: business effects
	tries   sync.Map // id -> *atomic.Int64: calls of the business function

	ended    atomic.Int64    // copies that left the queue: acked (done or duplicate) or dead-lettered
	failures [2]atomic.Int64 // injected failures, by the kind that saw them
	delayed  atomic.Int64    // rabbitmw's retries, through a delay queue
	dropped  atomic.Int64    // hand-written "moved to dead letter": a lost message
	misled   atomic.Int64    // the poison message seen by a hand-written consumer
}

// business is the business handler of both kinds: an id ending in "-fail"
// fails on its first call, whoever makes it; the id ending in "-poison"
// always fails for good (only rabbitmw consumers are given it); every other
// call is an effect.
func (r *migrationRun) business(k fleetKind, id string) error {
	switch {
	case strings.HasSuffix(id, "-poison"):
		if k == handWrittenKind {
			r.misled.Add(1)
		}
		return rabbitmw.Permanent(errors.New("poison"))
	case strings.HasSuffix(id, "-fail") && counter(&r.tries, id).Add(1) == 1:
		r.failures[k].Add(1)
		return fmt.Errorf("injected failure of %s", id)
	}
	counter(&r.effects, id).Add(1)
	return nil
}

func counter(m *sync.Map, id string) *atomic.Int64 {
	v, _ := m.LoadOrStore(id, new(atomic.Int64))
	return v.(*atomic.Int64)
}

// A fleetProcess is one consumer running in the background.
type fleetProcess struct {
	kind   fleetKind
	cancel context.CancelFunc
	done   chan struct{}
	err    error // set before done is closed
}

// start starts a consumer of kind k: a hand-written one, or broker.Consume
// with migrationTopology and the end-to-end stack, on a connection of its
// own.
func (r *migrationRun) start(k fleetKind) *fleetProcess {
	ctx, cancel := context.WithCancel(r.ctx)
	p := &fleetProcess{kind: k, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		if k == handWrittenKind {
			p.err = runHandWritten(ctx, r.url, r.queue, r.rdb,
				func(id string) error { return r.business(handWrittenKind, id) },
				func(settled string) {
					switch settled {
					case "acked":
						r.ended.Add(1)
					case "dropped":
						r.dropped.Add(1)
					}
				})
			return
		}
		b := broker.New(r.url, broker.Options{})
		defer b.Close()
		h := e2eStack(r.st)(rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
			return r.business(rabbitmwKind, d.MessageId)
		}))
		p.err = b.Consume(ctx, r.queue, h, broker.ConsumeOptions{
			Topology: migrationTopology,
			OnSettle: func(_ *amqp.Delivery, o rabbitmw.Outcome, err error) {
				switch {
				case err != nil:
				case o == rabbitmw.Delay:
					r.delayed.Add(1)
				case o == rabbitmw.Ack, o == rabbitmw.Duplicate, o == rabbitmw.DeadLetter:
					r.ended.Add(1)
				}
			},
		})
	}()
	return p
}

// stop stops p and fails the test if p had crashed.
func (r *migrationRun) stop(p *fleetProcess) {
	r.t.Helper()
	p.cancel()
	<-p.done
	require.NoError(r.t, p.err, "%v consumer", p.kind)
}

// await polls cond until it holds; it fails the test if a consumer of live
// ends meanwhile (a crash) or the test's deadline passes.
func (r *migrationRun) await(what string, cond func() bool, live ...*fleetProcess) {
	r.t.Helper()
	for {
		if r.ctx.Err() != nil {
			r.t.Fatalf("still waiting for %s: %v", what, r.ctx.Err())
		}
		if cond() {
			return
		}
		for _, p := range live {
			select {
			case <-p.done:
				r.t.Fatalf("while waiting for %s: the %v consumer stopped: %v", what, p.kind, p.err)
			default:
			}
		}
		time.Sleep(20 * time.Millisecond) // waits for the servers and the consumers
	}
}

// consumers returns how many consumers the work queue has: 0 before a
// hand-written consumer declared it.
func (r *migrationRun) consumers() int {
	ch, err := r.conn.Channel() // one per call: a 404 closes it
	require.NoError(r.t, err)
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(r.queue, true, false, false, false, nil)
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Code == amqp.NotFound {
		return 0
	}
	require.NoError(r.t, err, "QueueDeclarePassive(%s)", r.queue)
	return q.Consumers
}

// publish publishes a batch of n messages named after phase: every fifth
// id three times over, one copy right after the other; every seventh id
// (from the fourth) fails once; with poison, one more message that always
// fails for good. It returns the batch's ids, the poison one excepted.
func (r *migrationRun) publish(phase string, n int, poison bool) []string {
	r.t.Helper()
	var batch []string
	pub := func(id string, copies int) {
		for range copies {
			require.NoError(r.t, r.b.Publish(r.ctx, "", r.queue, amqp.Publishing{MessageId: id, Body: []byte(id)}), "publish %s", id)
			r.copies++
		}
	}
	for i := range n {
		id := fmt.Sprintf("%s-%s-%03d", r.queue, phase, i)
		if i%7 == 3 {
			id += "-fail"
		}
		copies := 1
		if i%5 == 0 {
			copies = 3
		}
		batch = append(batch, id)
		r.ids = append(r.ids, id)
		pub(id, copies)
	}
	if poison {
		pub(r.queue+"-"+phase+"-poison", 1)
	}
	return batch
}

// applied reports whether every id of batch had its effect.
func (r *migrationRun) applied(batch []string) func() bool {
	return func() bool {
		for _, id := range batch {
			if counter(&r.effects, id).Load() == 0 {
				return false
			}
		}
		return true
	}
}

// length returns the number of ready messages in queue.
func (r *migrationRun) length(queue string) int {
	n, err := r.b.Len(r.ctx, queue)
	require.NoError(r.t, err, "Len(%s)", queue)
	return n
}

// runMigration runs a mixed fleet on one queue, declared the hand-written
// way, and one Redis, with the kind first starting first:
//
//	A  first alone                  its retry path runs
//	B  second joins: both           a hand-written consumer declares the
//	                                queue after rabbitmw started, or
//	                                rabbitmw joins a hand-written fleet
//	C  first stopped: second alone  the other retry path runs
//	D  first restarts: both         a hand-written consumer re-declares the
//	                                queue, or rabbitmw checks it again
//
// The rabbitmw consumer is alone in A or C, and is then given a poison
// message: it must reach the dead-letter queue, although the work queue has
// no dead-letter exchange. Then every message had its effect once, no
// consumer crashed, no message was lost, and the work queue is still the
// hand-written one.
func runMigration(t *testing.T, first fleetKind) {
	url, addr := testenv.RabbitMQURL(t), testenv.RedisAddr(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	r := &migrationRun{t: t, ctx: ctx, url: url, queue: fmt.Sprintf("rabbitmw-migration-%d", time.Now().UnixNano())}
	var err error
	r.names, err = migrationTopology.Queues(r.queue)
	require.NoError(t, err)
	// The default key layout, msg:<id> and retry:<id>, as legacyConsumer
	// writes it; the ids, named after the queue, keep this run apart.
	r.rdb = redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	r.st = redisstore.New(r.rdb, redisstore.Options{})
	r.b = broker.New(url, broker.Options{})
	r.conn, err = amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx := context.Background()
		r.b.Delete(ctx, r.queue, migrationTopology)
		r.b.Close()
		r.conn.Close()
		iter := r.rdb.Scan(ctx, 0, "*"+r.queue+"-*", 1000).Iterator()
		for iter.Next(ctx) {
			if k := iter.Val(); strings.HasPrefix(k, "msg:") || strings.HasPrefix(k, "retry:") {
				r.rdb.Del(ctx, k)
			}
		}
		r.rdb.Close()
	})
	second := handWrittenKind
	if first == handWrittenKind {
		second = rabbitmwKind
	}
	if first == rabbitmwKind {
		// The queue exists already, as the hand-written fleet declared it:
		// DeclareSupport checks that it does.
		require.NoError(t, declarePlainOnce(t, url, r.queue))
	}
	const n = 50
	phase := func(name string, live ...*fleetProcess) {
		t.Helper()
		r.await(fmt.Sprintf("%d consumers", len(live)), func() bool { return r.consumers() == len(live) }, live...)
		poison := len(live) == 1 && live[0].kind == rabbitmwKind
		batch := r.publish(name, n, poison)
		r.await("the effects of batch "+name, r.applied(batch), live...)
		if poison {
			const dlq = 0 // the poison message is the only one in it
			r.await("the poison message in "+r.names.DeadLetter, func() bool { return r.length(r.names.DeadLetter) == dlq+1 }, live...)
		}
	}

	p1 := r.start(first)
	phase("A", p1)
	p2 := r.start(second)
	phase("B", p1, p2)
	r.stop(p1)
	phase("C", p2)
	p1 = r.start(first)
	phase("D", p1, p2)

	// Every copy has ended and nothing waits in the work queue or a delay
	// queue. Then the consumers stop, and the server gives back what they
	// had prefetched and not handled yet, which Len does not show: if the
	// queues are still empty, nothing is left anywhere; else the consumers
	// start again.
	empty := func() bool {
		for _, q := range append([]string{r.queue}, r.names.Delays...) {
			if r.length(q) != 0 {
				return false
			}
		}
		return true
	}
	quiet := func() bool { return r.ended.Load() >= int64(r.copies) && empty() }
	for {
		r.await("every copy to end", quiet, p1, p2)
		r.stop(p1)
		r.stop(p2)
		if empty() {
			break
		}
		t.Log("messages back in the queues when the consumers stopped: consuming again")
		p1, p2 = r.start(first), r.start(second)
	}

	var twice, never []string
	for _, id := range r.ids {
		switch c := counter(&r.effects, id).Load(); {
		case c == 0:
			never = append(never, id)
		case c > 1:
			twice = append(twice, id)
		}
	}
	if len(never) > 0 || len(twice) > 0 {
		t.Errorf("%d ids never applied (first: %v), %d applied more than once (first: %v)", len(never), first5(never), len(twice), first5(twice))
	}
	if d := r.dropped.Load(); d > 0 {
		t.Errorf("a hand-written consumer dropped %d messages at its fifth failure; want none", d)
	}
	if m := r.misled.Load(); m > 0 {
		t.Errorf("a hand-written consumer was given the poison message %d times; want 0 (the test's phases are wrong)", m)
	}
	for k := range r.failures {
		if r.failures[k].Load() == 0 {
			t.Errorf("no injected failure reached a %v consumer; want both retry paths run", fleetKind(k))
		}
	}
	if r.delayed.Load() == 0 {
		t.Error("no rabbitmw retry went through a delay queue")
	}
	for _, q := range append([]string{r.queue}, r.names.Delays...) {
		if l := r.length(q); l != 0 {
			t.Errorf("Len(%s) = %d after the run; want 0", q, l)
		}
	}
	d, ok, err := r.b.Get(ctx, r.names.DeadLetter)
	switch {
	case err != nil || !ok:
		t.Errorf("Get(%s) = %v, %v; want the poison message", r.names.DeadLetter, ok, err)
	case !strings.HasSuffix(d.MessageId, "-poison") || d.Headers[broker.HeaderError] != "poison":
		t.Errorf("%s holds %q with %s %q; want the poison message, with its error", r.names.DeadLetter, d.MessageId, broker.HeaderError, d.Headers[broker.HeaderError])
	}
	if d != nil {
		d.Ack(false)
	}
	if l := r.length(r.names.DeadLetter); l != 0 {
		t.Errorf("Len(%s) = %d more; want the poison message only", r.names.DeadLetter, l)
	}
	// The work queue is still the hand-written one: it can be declared so
	// once more.
	if err := declarePlainOnce(t, url, r.queue); err != nil {
		t.Errorf("queue_declare(%q, durable=True) after the run: %v; want the queue unchanged", r.queue, err)
	}
	t.Logf("%d messages, %d copies published; failures injected: %d hand-written, %d rabbitmw; %d rabbitmw delays; %d copies ended",
		len(r.ids), r.copies, r.failures[handWrittenKind].Load(), r.failures[rabbitmwKind].Load(), r.delayed.Load(), r.ended.Load())
}

func first5(ids []string) []string { return ids[:min(len(ids), 5)] }

// Hand-written consumers and rabbitmw consumers with
// Topology{Declare: DeclareSupport} on one queue and one Redis, started in
// either order: each effect once, no consumer crashes, nothing lost.
func TestMigrationMixedFleet(t *testing.T) {
	t.Run("hand-written first", func(t *testing.T) { runMigration(t, handWrittenKind) })
	t.Run("rabbitmw first", func(t *testing.T) { runMigration(t, rabbitmwKind) })
}

// The collisions that the README's migration section warns of, and what a
// work queue declared the hand-written way lacks.
func TestMigrationQueueArguments(t *testing.T) {
	url := testenv.RabbitMQURL(t)
	b := broker.New(url, broker.Options{})
	t.Cleanup(func() { b.Close() })
	newQueue := func(t *testing.T) string {
		q := fmt.Sprintf("rabbitmw-migration-%d", time.Now().UnixNano())
		t.Cleanup(func() { b.Delete(context.Background(), q, broker.Topology{}) })
		return q
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	t.Run("default topology on the hand-written queue", func(t *testing.T) {
		q := newQueue(t)
		require.NoError(t, declarePlainOnce(t, url, q))
		h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
		err := b.Consume(ctx, q, h, broker.ConsumeOptions{})
		if !errors.Is(err, broker.ErrQueueArguments) || !strings.Contains(err.Error(), "DeclareSupport") {
			t.Fatalf("Consume with the default topology on a plain queue = %v; want ErrQueueArguments that names DeclareSupport", err)
		}
		if err := declarePlainOnce(t, url, q); err != nil {
			t.Errorf("queue_declare after the refused Consume: %v; want the queue unchanged", err)
		}
	})

	t.Run("DeclareSupport before the hand-written queue exists", func(t *testing.T) {
		q := newQueue(t)
		h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
		err := b.Consume(ctx, q, h, broker.ConsumeOptions{Topology: broker.Topology{Declare: broker.DeclareSupport}})
		require.ErrorIs(t, err, broker.ErrQueueNotFound, "Consume with DeclareSupport before the work queue exists")
	})

	t.Run("hand-written declare of the default topology's queue", func(t *testing.T) {
		q := newQueue(t)
		require.NoError(t, b.Declare(ctx, q, broker.Topology{}))
		err := declarePlainOnce(t, url, q)
		var ae *amqp.Error
		if !errors.As(err, &ae) || ae.Code != amqp.PreconditionFailed {
			t.Fatalf("queue_declare(durable=True) of a queue that the default topology declared = %v; want PRECONDITION_FAILED", err)
		}
	})

	// A reject without requeue (rabbitmw.Settle's dead-letter on a plain
	// channel) reaches the dead-letter queue from our work queue, and is
	// dropped by the server from the hand-written one.
	t.Run("reject from the hand-written queue is dropped", func(t *testing.T) {
		plain, ours := newQueue(t), newQueue(t)
		require.NoError(t, declarePlainOnce(t, url, plain))
		require.NoError(t, b.Declare(ctx, plain, broker.Topology{Declare: broker.DeclareSupport}))
		require.NoError(t, b.Declare(ctx, ours, broker.Topology{}))
		reject := func(q string) {
			t.Helper()
			require.NoError(t, b.Publish(ctx, "", q, amqp.Publishing{Body: []byte("x")}))
			var d *amqp.Delivery
			for d == nil {
				got, ok, err := b.Get(ctx, q)
				require.NoError(t, err)
				if ok {
					d = got
				}
			}
			require.NoError(t, rabbitmw.Settle(ctx, d, rabbitmw.Permanent(errors.New("poison"))))
		}
		length := func(q string) int {
			t.Helper()
			n, err := b.Len(ctx, q)
			require.NoError(t, err)
			return n
		}
		reject(plain)
		reject(ours)
		deadline, _ := ctx.Deadline()
		require.EventuallyWithT(t, func(c *assert.CollectT) { // waits for the server
			n, err := b.Len(ctx, ours+".dlq")
			assert.NoError(c, err)
			assert.Equal(c, 1, n, "messages in %s.dlq", ours)
		}, time.Until(deadline), 20*time.Millisecond, "the reject from %s never reached %s.dlq", ours, ours)
		// The server dead-lettered the later reject: it would have routed
		// the earlier one by now, if the plain queue had a route.
		if l, d := length(plain), length(plain+".dlq"); l != 0 || d != 0 {
			t.Errorf("after a reject from the plain queue: %d in it, %d in its dead-letter queue; want 0 and 0 (dropped)", l, d)
		}
	})
}
