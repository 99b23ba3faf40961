//go:build reliability

package reliability_test

// The harness of the fault-injection scenarios: a run owns a queue (with
// its dead-letter and delay queues) and a Redis key prefix, both unique,
// both removed when its test ends; it publishes, starts consumers, waits
// until every message has ended, and checks every message id.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/reliability/internal/stats"
)

// A run is one scenario's queues, keys and processes.
type run struct {
	t         *testing.T
	scenario  string
	amqpURL   string
	redisAddr string // the main Redis: effects, and the store by default
	bin       string // the consumer
	queue     string
	prefix    string // of every Redis key of the run
	delays    []time.Duration
	topo      broker.Topology
	b         *broker.Broker // publishes and inspects
	rdb       *redis.Client  // reads the effects
	logDir    string
	pg        *pgEffects // with the PostgreSQL inbox: where effects are counted

	mu    sync.Mutex
	procs []*proc
}

// tiers are the delay queues of most scenarios' runs.
var tiers = []time.Duration{250 * time.Millisecond, time.Second, 2 * time.Second}

// newRun makes a run for t with a unique queue, whose delay queues are
// delays, and a unique Redis key prefix. It skips t (fails it under CI)
// when RabbitMQ or Redis is missing.
func newRun(t *testing.T, scenario string, delays ...time.Duration) *run {
	t.Helper()
	return newRunWith(t, scenario, broker.Topology{Delays: delays})
}

// newRunWith is newRun with a topology of its own: the consumers run with
// its queue type and delivery limit too.
func newRunWith(t *testing.T, scenario string, topo broker.Topology) *run {
	t.Helper()
	return newRunOn(t, scenario, topo, testenv.RabbitMQURL(t))
}

// newRunOn is newRunWith on the RabbitMQ nodes at urls: the consumers and
// the run's own Broker are given them all.
func newRunOn(t *testing.T, scenario string, topo broker.Topology, urls ...string) *run {
	t.Helper()
	stamp := strconv.FormatInt(time.Now().UnixNano(), 36)
	r := &run{
		t:         t,
		scenario:  scenario,
		amqpURL:   strings.Join(urls, ","),
		redisAddr: testenv.RedisAddr(t),
		queue:     "rabbitmw-reliability-" + scenario + "-" + stamp,
		prefix:    "rabbitmw-reliability:" + scenario + ":" + stamp + ":",
		delays:    topo.Delays,
		topo:      topo,
		logDir:    t.TempDir(),
	}
	r.bin = consumerBinary(t)
	r.rdb = redis.NewClient(&redis.Options{Addr: r.redisAddr})
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		iter := r.rdb.Scan(ctx, 0, r.prefix+"*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			keys = append(keys, iter.Val())
		}
		for k := range slices.Chunk(keys, 500) {
			r.rdb.Del(ctx, k...)
		}
		r.rdb.Close()
	})
	r.b = broker.NewCluster(broker.Addresses(urls), broker.Options{ReconnectMin: 50 * time.Millisecond, ReconnectMax: time.Second})
	if len(urls) == 1 {
		r.b = broker.New(urls[0], broker.Options{ReconnectMin: 50 * time.Millisecond, ReconnectMax: time.Second})
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		assert.NoError(t, r.b.Delete(ctx, r.queue, r.topo), "deleting the queues of %s", r.queue)
		r.b.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, r.b.Declare(ctx, r.queue, r.topo), "declaring %s", r.queue)
	// Cleanups run last registered first: this one after the processes
	// were killed (they are started later), and before the log directory
	// is removed (made earlier).
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		for _, p := range r.procs {
			t.Logf("--- log of consumer %s (exit: %v) ---\n%s", p.name, p.waitErr, p.tail(30))
		}
	})
	t.Logf("queue %s, Redis prefix %q", r.queue, r.prefix)
	return r
}

func (r *run) delaysFlag() string {
	var s []string
	for _, d := range r.delays {
		s = append(s, d.String())
	}
	return strings.Join(s, ",")
}

func (r *run) delayQueues() []string {
	qs, err := r.topo.Queues(r.queue)
	require.NoError(r.t, err, "the queues of %s", r.queue)
	return qs.Delays
}

// seed returns the seed of a scenario's random choices: RELIABILITY_SEED,
// or the time. It is logged, so that a failure can be replayed.
func seed(t *testing.T) uint64 {
	t.Helper()
	s := uint64(time.Now().UnixNano())
	if v := os.Getenv("RELIABILITY_SEED"); v != "" {
		var err error
		s, err = strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "RELIABILITY_SEED=%q", v)
	}
	t.Logf("seed %d (RELIABILITY_SEED=%d replays it)", s, s)
	return s
}

// workload returns n messages, dups of which repeat the id of an earlier
// one, and the distinct ids. Each repeat comes after its original, at a
// random distance: some right behind it, some much later.
func workload(rng *rand.Rand, n, dups int) (msgs []amqp.Publishing, ids []string) {
	distinct := n - dups
	type entry struct {
		id  string
		pos float64
	}
	entries := make([]entry, 0, n)
	for i := range distinct {
		id := fmt.Sprintf("m-%05d", i)
		ids = append(ids, id)
		entries = append(entries, entry{id, float64(i)})
	}
	for range dups {
		i := rng.IntN(distinct)
		gap := 0.5 // right behind its original
		if rng.IntN(2) == 0 {
			gap = rng.Float64() * float64(distinct-i)
		}
		entries = append(entries, entry{ids[i], float64(i) + gap})
	}
	slices.SortStableFunc(entries, func(a, b entry) int {
		switch {
		case a.pos < b.pos:
			return -1
		case a.pos > b.pos:
			return 1
		}
		return 0
	})
	for _, e := range entries {
		msgs = append(msgs, amqp.Publishing{MessageId: e.id, Body: []byte(e.id)})
	}
	return msgs, ids
}

// publishAsync publishes msgs, roughly in order, from parallel
// goroutines, each publish confirmed by the server. The returned channel
// receives the first error (nil if none) once all are done.
func (r *run) publishAsync(ctx context.Context, msgs []amqp.Publishing, parallel int) <-chan error {
	done := make(chan error, 1)
	go func() { // ends when every publish has returned
		work := make(chan amqp.Publishing)
		var wg sync.WaitGroup
		var once sync.Once
		var first error
		for range parallel {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for m := range work {
					if err := r.b.Publish(ctx, "", r.queue, m); err != nil {
						once.Do(func() { first = fmt.Errorf("publish %s: %w", m.MessageId, err) })
					}
				}
			}()
		}
		for _, m := range msgs {
			work <- m
		}
		close(work)
		wg.Wait()
		done <- first
	}()
	return done
}

// count returns the counter name of the run's effects (total, distinct).
func (r *run) count(ctx context.Context, name string) int64 {
	if r.pg != nil {
		return r.pg.count(ctx, r.t, name)
	}
	n, err := r.rdb.Get(ctx, r.prefix+name).Int64()
	if err != nil && !errors.Is(err, redis.Nil) {
		r.t.Logf("GET %s: %v", r.prefix+name, err)
	}
	return n
}

// waitCount waits until counter name reaches at least n.
func (r *run) waitCount(ctx context.Context, name string, n int64) error {
	for {
		if r.count(ctx, name) >= n {
			return nil
		}
		if err := r.procsAlive(); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for %s >= %d (now %d): %w", name, n, r.count(context.Background(), name), ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// procsAlive returns an error if a consumer ended without being told to.
func (r *run) procsAlive() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	for _, p := range r.procs {
		errs = append(errs, p.unexpectedExit())
	}
	return errors.Join(errs...)
}

// queueLens returns the ready messages in the work queue, each delay queue
// and the dead-letter queue, in that order.
func (r *run) queueLens(ctx context.Context) ([]int, error) {
	names := append([]string{r.queue}, r.delayQueues()...)
	names = append(names, r.queue+".dlq")
	lens := make([]int, len(names))
	for i, q := range names {
		n, err := r.b.Len(ctx, q)
		if err != nil {
			return nil, err
		}
		lens[i] = n
	}
	return lens, nil
}

// awaitQuiet waits until want messages have ended (had their effect, or
// been dead-lettered) and the work and delay queues are empty and stay so,
// with no effect applied and nothing dead-lettered, for window: longer
// than the longest delay tier, so that a message on its way through a
// delay queue, or held by a handler, shows up meanwhile.
func (r *run) awaitQuiet(ctx context.Context, want int, window time.Duration) error {
	var (
		stableSince time.Time
		last        string
	)
	for {
		if err := r.procsAlive(); err != nil {
			return err
		}
		lens, err := r.queueLens(ctx)
		if err != nil {
			return fmt.Errorf("awaiting the end: %w", err)
		}
		distinct, total := r.count(ctx, "distinct"), r.count(ctx, "total")
		dlq := lens[len(lens)-1]
		state := fmt.Sprintf("%d messages with an effect (%d effects), %d dead-lettered, queues %v", distinct, total, dlq, lens)
		busy := slices.ContainsFunc(lens[:len(lens)-1], func(n int) bool { return n > 0 })
		switch {
		case busy || int(distinct)+dlq < want || state != last:
			stableSince = time.Time{}
		case stableSince.IsZero():
			stableSince = time.Now()
		case time.Since(stableSince) >= window:
			return nil
		}
		last = state
		select {
		case <-ctx.Done():
			return fmt.Errorf("the run did not end: %s; want %d ended and empty queues for %v: %w", state, want, window, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// finish checks that the work and delay queues are empty, after the
// consumers were stopped (so that no message is held unacknowledged by
// one), and takes every message out of the dead-letter queue.
func (r *run) finish(ctx context.Context) (dead []*amqp.Delivery, err error) {
	lens, err := r.queueLens(ctx)
	if err != nil {
		return nil, err
	}
	if left := lens[:len(lens)-1]; slices.ContainsFunc(left, func(n int) bool { return n > 0 }) {
		err = fmt.Errorf("messages left in the work and delay queues %v after the consumers stopped", left)
	}
	dead, derr := r.drainDLQ(ctx)
	return dead, errors.Join(err, derr)
}

// drainDLQ takes every message out of the dead-letter queue.
func (r *run) drainDLQ(ctx context.Context) (dead []*amqp.Delivery, err error) {
	for {
		d, ok, err := r.b.Get(ctx, r.queue+".dlq")
		if err != nil || !ok {
			return dead, err
		}
		dead = append(dead, d)
		if err := d.Ack(false); err != nil {
			return dead, err
		}
	}
}

// An ending is what a run came to, once its consumers were stopped.
type ending struct {
	stats   []stats.Consumer    // each consumer's, in the order given to end
	dead    []*amqp.Delivery    // taken out of the dead-letter queue
	effects map[string][]string // by message key: who applied it, in order
	v       verdict             // of each key given to end
}

// end stops procs, the run's consumers (its queues should be quiet by
// then), checks that the work and delay queues are empty, empties the
// dead-letter queue, reads the effect log and judges each of keys; it
// checks the consumers' logs too. A step that fails fails r.t.
func (r *run) end(ctx context.Context, keys []string, procs ...*proc) ending {
	r.t.Helper()
	var e ending
	for _, p := range procs {
		st, err := p.stop(30 * time.Second)
		assert.NoError(r.t, err)
		e.stats = append(e.stats, st)
	}
	var err error
	e.dead, err = r.finish(ctx)
	assert.NoError(r.t, err)
	e.effects, err = r.effectLog(ctx, keys)
	require.NoError(r.t, err)
	e.v = judge(keys, e.effects, deadKeys(e.dead))
	r.checkLogs()
	return e
}

// wantEachOnce fails t unless every key had its effect exactly once and
// nothing was dead-lettered.
func (e ending) wantEachOnce(t *testing.T) {
	t.Helper()
	if v := e.v; len(v.lost) > 0 || len(v.twice) > 0 || len(e.dead) > 0 {
		t.Errorf("%d lost (first %v), %d applied twice or more (first %v), %d dead-lettered; want none",
			len(v.lost), first(v.lost), len(v.twice), first(v.twice), len(e.dead))
	}
}

// wantOrders fails t unless no key was lost or applied twice, each of
// effectIDs had its effect once and each of deadIDs, orders refused, was
// dead-lettered.
func (e ending) wantOrders(t *testing.T, effectIDs, deadIDs []string) {
	t.Helper()
	v := e.v
	dead := map[string]bool{}
	for _, id := range v.deadLettered {
		dead[id] = true
	}
	once := map[string]bool{}
	for _, id := range v.once {
		once[id] = true
	}
	var notDead, noEffect []string
	for _, id := range deadIDs {
		if !dead[id] {
			notDead = append(notDead, id)
		}
	}
	for _, id := range effectIDs {
		if !once[id] {
			noEffect = append(noEffect, id)
		}
	}
	if len(v.lost) > 0 || len(v.twice) > 0 || len(notDead) > 0 || len(noEffect) > 0 {
		t.Errorf("%d lost (first %v), %d applied twice (first %v), %d refused orders not dead-lettered (first %v), %d orders without exactly one effect (first %v); want none",
			len(v.lost), first(v.lost), len(v.twice), first(v.twice), len(notDead), first(notDead), len(noEffect), first(noEffect))
	}
}

// effectLog returns, for each message key, the consumers that applied its
// effect, in order, from the run's effect log; and checks the log against
// the per-message counters of the keys in ids.
func (r *run) effectLog(ctx context.Context, ids []string) (map[string][]string, error) {
	if r.pg != nil {
		return r.pg.log(ctx)
	}
	entries, err := r.rdb.LRange(ctx, r.prefix+"log", 0, -1).Result()
	if err != nil {
		return nil, err
	}
	by := map[string][]string{}
	for _, e := range entries {
		name, key, ok := strings.Cut(e, " ")
		if !ok {
			return nil, fmt.Errorf("malformed effect log entry %q", e)
		}
		by[key] = append(by[key], name)
	}
	if total := r.count(ctx, "total"); total != int64(len(entries)) {
		return nil, fmt.Errorf("effect log has %d entries; the total counter says %d", len(entries), total)
	}
	for chunk := range slices.Chunk(ids, 500) {
		keys := make([]string, len(chunk))
		for i, id := range chunk {
			keys[i] = r.prefix + "effect:" + id
		}
		vals, err := r.rdb.MGet(ctx, keys...).Result()
		if err != nil {
			return nil, err
		}
		for i, v := range vals {
			n := 0
			if s, ok := v.(string); ok {
				n, _ = strconv.Atoi(s)
			}
			if n != len(by[chunk[i]]) {
				return nil, fmt.Errorf("message %s: counter says %d effects, the log %d", chunk[i], n, len(by[chunk[i]]))
			}
		}
	}
	return by, nil
}

// verdict is what every message id came to.
type verdict struct {
	once, twice, lost, deadLettered []string // twice: two effects or more
}

// judge classifies each id by its effects and whether it was
// dead-lettered (dead: by key).
func judge(ids []string, effects map[string][]string, dead map[string]bool) verdict {
	var v verdict
	for _, id := range ids {
		switch n := len(effects[id]); {
		case n == 1:
			v.once = append(v.once, id)
		case n >= 2:
			v.twice = append(v.twice, id)
		case dead[id]:
			v.deadLettered = append(v.deadLettered, id)
		default:
			v.lost = append(v.lost, id)
		}
	}
	return v
}

// first returns up to 5 of s, for a failure message.
func first(s []string) []string { return s[:min(len(s), 5)] }

// checkLogs fails t for each data race or unrecovered panic that a
// consumer of the run reported.
func (r *run) checkLogs() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, p := range r.procs {
		for _, l := range p.logProblems() {
			r.t.Errorf("consumer %s: %s", p.name, l)
		}
	}
}

// closeAllConnections makes RabbitMQ close every client connection, as a
// broker restart or a network failure would (other clients' too).
func closeAllConnections(ctx context.Context) error {
	ctl, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, ctl, "close_all_connections", "rabbitmw reliability suite: connection loss").CombinedOutput()
	if err != nil {
		return fmt.Errorf("rabbitmqctl close_all_connections: %v\n%s", err, out)
	}
	return nil
}

// requireCtl skips t (fails it under CI) without rabbitmqctl.
func requireCtl(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		testenv.Missing(t, "rabbitmqctl", "install RabbitMQ's CLI tools ("+err.Error()+")")
	}
}

// deadKeys returns the idempotency keys of dead-lettered messages.
func deadKeys(dead []*amqp.Delivery) map[string]bool {
	keys := map[string]bool{}
	for _, d := range dead {
		if k, err := middleware.Key(d); err == nil {
			keys[k] = true
		}
	}
	return keys
}

// effectOrder returns the consumer of each entry of the effect log, in
// order.
func (r *run) effectOrder(ctx context.Context) ([]string, error) {
	entries, err := r.rdb.LRange(ctx, r.prefix+"log", 0, -1).Result()
	if err != nil {
		return nil, err
	}
	names := make([]string, len(entries))
	for i, e := range entries {
		names[i], _, _ = strings.Cut(e, " ")
	}
	return names, nil
}
