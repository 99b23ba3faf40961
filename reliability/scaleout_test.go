//go:build reliability

package reliability_test

// Scenario 7, the scale-out store: the store conformance kit and the
// Dedup+Retry stack against a real three-node Redis Cluster. A script or
// multi-key command whose keys span hash slots is refused by the cluster
// (CROSSSLOT), which would fail the kit and leave the stack's messages
// delayed with ErrStoreUnavailable; the slot audit also checks every
// script the store sends, and the key counts per node show that the keys
// really were spread over the three nodes.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
	"github.com/rabbitmw/rabbitmw/store/storetest"
)

func TestClusterStoreConformance(t *testing.T) {
	t.Parallel()
	c := startRedisCluster(t)

	// The control: this cluster does refuse what the store must never do,
	// so the kit passing below means the store never did it.
	t.Run("CrossSlotScriptsRefused", func(t *testing.T) {
		testCrossSlotRefused(t, c.client(t, nil))
	})

	audit := new(slotAudit)
	client := c.client(t, audit)
	// The store batches by default, and the Cluster client's pipelines
	// split by slot; without batching each command goes on its own.
	for _, noBatching := range []bool{false, true} {
		t.Run(fmt.Sprintf("storetest/NoBatching=%v", noBatching), func(t *testing.T) {
			storetest.Run(t, func(*testing.T) store.Store {
				return redisstore.New(client, redisstore.Options{NoBatching: noBatching})
			})
		})
	}
	audit.verify(t)

	// The kit's keys (those that have not expired) are on every node: its
	// scripts ran against all three primaries, not against one that held
	// every slot they touched.
	perNode := c.keysPerNode(t)
	for addr, n := range perNode {
		if n == 0 {
			t.Errorf("node %s holds no key after the conformance kit (keys per node %v); want keys on every node", addr, perNode)
		}
	}
	commands, scripts, _ := audit.report()
	t.Logf("conformance kit on a 3-node cluster: %d commands, %d scripts, each with one key; keys left per node: %s", commands, scripts, c.perNode(perNode))
}

// testCrossSlotRefused checks that the cluster refuses a script whose
// declared keys are in two slots, and one that touches a key it did not
// declare, served by another node. (Redis 7.0 lets a script touch an
// undeclared key of another slot on its own node; the kit's many keys,
// spread over three nodes, are what would catch such a script.)
func testCrossSlotRefused(t *testing.T, client *redis.ClusterClient) {
	ctx := context.Background()
	a, b := "{a}canary", "{b}canary" // slots 15495 and 3300: the first and last nodes
	sa, errA := client.ClusterKeySlot(ctx, a).Result()
	sb, errB := client.ClusterKeySlot(ctx, b).Result()
	require.NoError(t, errors.Join(errA, errB), "CLUSTER KEYSLOT")
	if sa == sb {
		t.Fatalf("keys %q and %q are both in slot %d; want two slots", a, b, sa)
	}

	twoKeys := redis.NewScript(`redis.call('SET', KEYS[1], 'x'); return redis.call('SET', KEYS[2], 'x')`)
	err := twoKeys.Run(ctx, client, []string{a, b}).Err()
	if err == nil || !strings.Contains(err.Error(), "CROSSSLOT") {
		t.Errorf("script with keys in slots %d and %d: error %v; want CROSSSLOT", sa, sb, err)
	}
	t.Logf("two keys: %v", err)

	undeclared := redis.NewScript(`return redis.call('SET', ARGV[1], 'x')`)
	err = undeclared.Run(ctx, client, []string{a}, b).Err()
	assert.Error(t, err, "script declaring %q (slot %d) that writes %q (slot %d): no error; want a refusal", a, sa, b, sb)
	t.Logf("an undeclared key: %v", err)
}

// The recommended Retry, Recover, Dedup, Timeout chain over a Redis
// Cluster store, driven as a plain amqp091 consumer would drive it: each
// delivery is settled by rabbitmw.Settle on a recording Acknowledger, and
// a requeued message is delivered again once its delay has passed.
func TestClusterStack(t *testing.T) {
	t.Parallel()
	c := startRedisCluster(t)
	audit := new(slotAudit)
	client := c.client(t, audit)
	s := redisstore.New(client, redisstore.Options{})
	f := &stackFixture{effects: map[string]int{}, attempts: map[string]int{}}
	f.h = rabbitmw.Chain(
		middleware.Retry(s, middleware.RetryOptions{Backoff: func(int) time.Duration { return time.Millisecond }}),
		middleware.Recover(),
		middleware.Dedup(s, middleware.DedupOptions{BusyDelay: 5 * time.Millisecond, UnavailableDelay: 5 * time.Millisecond}),
		middleware.Timeout(5*time.Second),
	)(rabbitmw.HandlerFunc(f.business))

	const (
		ids     = 200 // distinct message ids, each delivered copies times at once
		copies  = 5
		failing = 10 // messages whose handler always fails
		limit   = 5  // RetryOptions.MaxAttempts' default
	)

	// (a) Duplicates across goroutines: each id once.
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		results = make([][]settlement, ids*copies)
		errs    = make([]error, ids*copies)
	)
	for i := range ids {
		for j := range copies {
			wg.Add(1)
			go func() { // ends when its copy is settled or given up on
				defer wg.Done()
				<-start
				k := i*copies + j
				results[k], errs[k] = untilSettled(f.h, amqp.Publishing{MessageId: goodID(i), Body: []byte("x")})
			}()
		}
	}
	close(start)
	wg.Wait()

	var acked, duplicates, busy, unavailable int
	for k, rs := range results {
		if errs[k] != nil {
			t.Errorf("copy %d of %s: %v", k%copies+1, goodID(k/copies), errs[k])
			continue
		}
		if last := rs[len(rs)-1]; last.settled != "acked" {
			t.Errorf("copy %d of %s settled %s (%v); want acked", k%copies+1, goodID(k/copies), last.settled, last.dec.Err)
		}
		for _, r := range rs {
			switch {
			case r.dec.Outcome == rabbitmw.Ack:
				acked++
			case r.dec.Outcome == rabbitmw.Duplicate:
				duplicates++
			case errors.Is(r.dec.Err, middleware.ErrBusy):
				busy++
			case errors.Is(r.dec.Err, middleware.ErrStoreUnavailable):
				unavailable++ // what a CROSSSLOT refusal would look like
			}
		}
	}
	if acked != ids || duplicates != ids*(copies-1) {
		t.Errorf("outcomes: %d acked, %d duplicates; want %d and %d", acked, duplicates, ids, ids*(copies-1))
	}
	if unavailable != 0 {
		t.Errorf("%d deliveries found the store unavailable; want 0", unavailable)
	}
	var once, twice, lost int
	for i := range ids {
		switch n := f.effectsOf(goodID(i)); {
		case n == 0:
			lost++
		case n == 1:
			once++
		default:
			twice++
			t.Errorf("%s applied %d times; want once", goodID(i), n)
		}
	}
	if lost > 0 {
		t.Errorf("%d of %d ids never applied; want 0", lost, ids)
	}

	// (b) A failing message is retried, and dead-lettered with its reason
	// after the last allowed attempt; never acked. The deliveries carry no
	// attempts header, so the count can only come from the cluster store.
	failed := make([][]settlement, failing)
	failErrs := make([]error, failing)
	for i := range failing {
		wg.Add(1)
		go func() { // ends when its message is settled or given up on
			defer wg.Done()
			failed[i], failErrs[i] = untilSettled(f.h, amqp.Publishing{MessageId: failID(i), Body: []byte("x")})
		}()
	}
	wg.Wait()
	deadLettered := 0
	for i, rs := range failed {
		id := failID(i)
		if failErrs[i] != nil {
			t.Errorf("%s: %v", id, failErrs[i])
			continue
		}
		if n := f.attemptsOf(id); n != limit {
			t.Errorf("%s: handler ran %d times; want %d", id, n, limit)
		}
		for j, r := range rs[:len(rs)-1] {
			if r.settled != "requeued" || r.dec.Outcome != rabbitmw.Delay || r.dec.Attempts != j+1 {
				t.Errorf("%s delivery %d: settled %s as %v, attempts %d; want requeued after a delay, attempts %d", id, j+1, r.settled, r.dec.Outcome, r.dec.Attempts, j+1)
			}
		}
		last := rs[len(rs)-1]
		if len(rs) != limit || last.settled != "dead-lettered" || last.dec.Outcome != rabbitmw.DeadLetter || last.dec.Attempts != limit {
			t.Errorf("%s: after %d deliveries settled %s as %v, attempts %d; want dead-lettered after %d, attempts %d", id, len(rs), last.settled, last.dec.Outcome, last.dec.Attempts, limit, limit)
			continue
		}
		if !errors.Is(last.dec.Err, middleware.ErrRetriesExhausted) || !errors.Is(last.dec.Err, errGateway) {
			t.Errorf("%s dead-letter reason %q; want ErrRetriesExhausted and the handler's error", id, last.dec.Err)
		}
		deadLettered++
	}

	// (c) What the cluster holds: a done mark per id and nothing else (no
	// failure count; the dead-lettered messages' claims and counts were
	// cleared), spread over the three nodes as the slot map says.
	ctx := context.Background()
	for i := range ids {
		if v, err := client.Get(ctx, "msg:"+goodID(i)).Result(); v != "done" {
			t.Errorf("GET msg:%s = %q, %v; want \"done\"", goodID(i), v, err)
		}
	}
	for i := range failing {
		for _, k := range []string{"msg:" + failID(i), "retry:" + failID(i)} {
			if n, err := client.Exists(ctx, k).Result(); n != 0 || err != nil {
				t.Errorf("EXISTS %s = %d, %v; want 0 after the dead-letter", k, n, err)
			}
		}
	}
	want := c.expectedPerNode(t, client, ids)
	got := c.keysPerNode(t)
	for addr, n := range got {
		if n != want[addr] || n == 0 {
			t.Errorf("node %s holds %d keys; want %d (its slots' share of the %d done marks), and more than 0", addr, n, want[addr], ids)
		}
	}
	audit.verify(t)

	// (d) The summary.
	commands, scripts, _ := audit.report()
	t.Logf("scale-out store: %d messages (%d ids × %d copies, %d failing), %d duplicates delivered, %d busy redeliveries, effects once %d, twice %d, lost %d, dead-lettered %d (after %d attempts); done marks per node: %s; %d store commands, %d scripts, each with one key",
		ids*copies+failing, ids, copies, failing, duplicates, busy, once, twice, lost, deadLettered, limit, c.perNode(got), commands, scripts)
	record(t, row{
		Scenario:     "7 scale-out store",
		Messages:     ids*copies + failing,
		Duplicates:   ids * (copies - 1),
		Faults:       fmt.Sprintf("3-node Redis Cluster; %d copies of each id at once; %d always failing", copies, failing),
		Once:         once,
		Twice:        twice,
		Lost:         lost,
		DeadLettered: deadLettered,
		Note:         fmt.Sprintf("in-process stack, no broker; %d scripts, each on one key", scripts),
	})
}

// expectedPerNode returns, by node address, how many of the done marks of
// the first n ids live on that node by the cluster's slot map.
func (c *redisCluster) expectedPerNode(t *testing.T, client *redis.ClusterClient, n int) map[string]int64 {
	t.Helper()
	ctx := context.Background()
	slots, err := client.ClusterSlots(ctx).Result()
	require.NoError(t, err, "CLUSTER SLOTS")
	want := map[string]int64{}
	for _, a := range c.addrs() {
		want[a] = 0
	}
	for i := range n {
		key := "msg:" + goodID(i)
		slot, err := client.ClusterKeySlot(ctx, key).Result()
		require.NoError(t, err, "CLUSTER KEYSLOT %s", key)
		owner := ""
		for _, r := range slots {
			if int64(r.Start) <= slot && slot <= int64(r.End) && len(r.Nodes) > 0 {
				owner = r.Nodes[0].Addr
			}
		}
		if _, ok := want[owner]; !ok {
			t.Fatalf("slot %d of %s is served by %q, not a node of this cluster %v", slot, key, owner, c.addrs())
		}
		want[owner]++
	}
	return want
}

func goodID(i int) string { return fmt.Sprintf("order-%03d", i) }
func failID(i int) string { return fmt.Sprintf("fail-%02d", i) }

var errGateway = errors.New("payment gateway said no")

// stackFixture is the stack in front of a business handler that records
// its effects, and the attempts of the messages it always fails.
type stackFixture struct {
	h        rabbitmw.Handler
	mu       sync.Mutex
	effects  map[string]int // message id -> effects applied
	attempts map[string]int // failing message id -> handler calls
}

func (f *stackFixture) business(ctx context.Context, d *amqp.Delivery) error {
	if strings.HasPrefix(d.MessageId, "fail-") {
		f.mu.Lock()
		f.attempts[d.MessageId]++
		f.mu.Unlock()
		return errGateway
	}
	select { // hold the claim while the other copies arrive
	case <-time.After(2 * time.Millisecond):
	case <-ctx.Done():
		return ctx.Err()
	}
	f.mu.Lock()
	f.effects[d.MessageId]++
	f.mu.Unlock()
	return nil
}

func (f *stackFixture) effectsOf(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.effects[id]
}

func (f *stackFixture) attemptsOf(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.attempts[id]
}

// settlement is one delivery's end, as a plain channel would see it.
type settlement struct {
	settled string // by the Recorder: acked, requeued, dead-lettered
	dec     rabbitmw.Decision
}

// maxDeliveries bounds the deliveries of one message: more means it loops.
const maxDeliveries = 100

// untilSettled delivers msg, and delivers it again after each requeue, as
// RabbitMQ would, until it leaves the queue (acked or dead-lettered). Each
// delivery runs h and is settled by rabbitmw.Settle, which waits out the
// delay the result asked for before it nacks. It returns every delivery's
// settlement, and an error if one could not be settled or the message
// never left the queue.
func untilSettled(h rabbitmw.Handler, msg amqp.Publishing) ([]settlement, error) {
	var all []settlement
	for i := range maxDeliveries {
		rec := rabbitmwtest.NewRecorder()
		d := rec.Deliver(msg)
		d.Redelivered = i > 0
		err := h.Handle(context.Background(), d)
		if serr := rabbitmw.Settle(context.Background(), d, err); serr != nil {
			return all, fmt.Errorf("delivery %d: %w", i+1, serr)
		}
		r := settlement{settled: rec.Settlement(d.DeliveryTag), dec: rabbitmw.Decide(err)}
		all = append(all, r)
		if r.settled != "requeued" {
			return all, nil
		}
	}
	return all, fmt.Errorf("still requeued after %d deliveries; the last said: %v", maxDeliveries, all[len(all)-1].dec.Err)
}
