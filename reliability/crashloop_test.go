//go:build reliability

package reliability_test

// Scenario 10, a message that kills its consumer: among a stream of orders,
// one makes the consumer process SIGKILL itself (as an OOM kill or a
// segfault in cgo would), on a classic queue and on a quorum queue with a
// delivery limit (the README's setup). A supervisor restarts the consumer
// after each death. Each crash leaves the claims of the dead process in the
// store; once their lease has ended, the next delivery of each finds its
// attempt abandoned, and Retry counts it as a failed attempt, then tries
// the message again at once, one such retry at a time. The killer must
// reach the dead-letter queue after at most MaxAttempts crashes, with a
// reason that says its consumer died; every other order must be
// processed. The orders in flight beside the killer when it strikes are
// abandoned too (counted once, then tried again apart from it); one whose
// effect was applied before the crash, and not yet marked done, is applied
// again: the effect-before-done-mark gap, counted here and reported.
//
// The orders take 200 ms, so that every crash finds some in flight. Their
// leases end with the killer's, so they come back with it: tried again all
// at once rather than one at a time, they were in flight with it again at
// the next crash, and some went to the dead-letter queue with it.

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
)

const (
	crashLoopOrders   = 200
	crashLoopAttempts = 3 // the consumer's MaxAttempts
	crashLoopWorkers  = 4
	crashLoopLease    = 2 * time.Second
	crashLoopKiller   = "killer"
)

func TestCrashLoop(t *testing.T) {
	t.Run("classic", func(t *testing.T) { crashLoop(t, "crashloop", broker.Topology{}, "") })
	t.Run("quorum", func(t *testing.T) { crashLoop(t, "crashloopq", broker.Topology{Quorum: true, DeliveryLimit: 3}, "") })
}

// crashLoop runs the scenario on top; with pgURL, over the PostgreSQL
// inbox in that database, where no order may be applied twice.
func crashLoop(t *testing.T, scenario string, top broker.Topology, pgURL string) {
	r := newRun(t, scenario, tiers...)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	began := time.Now()
	if top.Quorum {
		// newRun declared a classic work queue: declare the run's queues
		// again, as a quorum work queue.
		require.NoError(t, r.b.Delete(ctx, r.queue, r.topo))
		r.topo.Quorum, r.topo.DeliveryLimit = top.Quorum, top.DeliveryLimit
		require.NoError(t, r.b.Declare(ctx, r.queue, r.topo))
	}
	opts := consumerOpts{
		mode:          "poison",
		workers:       crashLoopWorkers,
		lease:         crashLoopLease,
		timeout:       time.Second,
		busy:          250 * time.Millisecond,
		unavailable:   250 * time.Millisecond,
		maxAttempts:   crashLoopAttempts,
		backoffMin:    100 * time.Millisecond,
		backoffMax:    400 * time.Millisecond,
		work:          200 * time.Millisecond,
		quorum:        top.Quorum,
		deliveryLimit: top.DeliveryLimit,
	}
	if pgURL != "" {
		opts = r.usePostgres(pgURL, opts)
	}

	// The orders are published at a steady pace, below what the consumer
	// can do (4 workers, 200 ms each), so that the work queue stays short:
	// the killer's deliveries come round quickly, and each crash finds
	// orders in flight beside it. The killer comes early.
	var msgs []amqp.Publishing
	var ids []string
	for i := range crashLoopOrders {
		if i == crashLoopOrders/20 {
			msgs = append(msgs, amqp.Publishing{MessageId: crashLoopKiller, Body: order("kill", 0)})
		}
		id := fmt.Sprintf("order-%04d", i)
		ids = append(ids, id)
		msgs = append(msgs, amqp.Publishing{MessageId: id, Body: order("ok", 0)})
	}
	published := r.publishPaced(ctx, msgs, 60*time.Millisecond)

	// The supervisor: a consumer that dies is restarted at once. The run
	// ends when every order has its effect, the killer is in the
	// dead-letter queue, and the work and delay queues stay empty for 3 s.
	var crashed []string
	start := func() *proc {
		p := r.startConsumer(fmt.Sprintf("%s-%d", scenario, len(crashed)+1), opts)
		p.ours.Store(true) // it may die: that is the scenario
		return p
	}
	p := start()
	var (
		stableSince time.Time
		last        string
	)
wait:
	for {
		select {
		case <-p.exited:
			if !strings.Contains(fmt.Sprint(p.waitErr), "killed") {
				t.Fatalf("consumer %s exited by itself (%v); want it running, or killed by the killer order", p.name, p.waitErr)
			}
			crashed = append(crashed, p.name)
			t.Logf("crash %d: %s died (%v), %d orders applied; restarting", len(crashed), p.name, p.waitErr, r.count(ctx, "distinct"))
			if len(crashed) > crashLoopAttempts {
				t.Fatalf("the killer order killed its consumer %d times; want it dead-lettered after at most %d", len(crashed), crashLoopAttempts)
			}
			p = start()
			stableSince = time.Time{}
			continue
		default:
		}
		lens, err := r.queueLens(ctx)
		require.NoError(t, err)
		distinct, dlq := r.count(ctx, "distinct"), lens[len(lens)-1]
		state := fmt.Sprintf("%d orders applied, %d dead-lettered, queues %v, %d crashes", distinct, dlq, lens, len(crashed))
		busy := slices.ContainsFunc(lens[:len(lens)-1], func(n int) bool { return n > 0 })
		switch {
		case busy || distinct < crashLoopOrders || dlq < 1 || state != last:
			stableSince = time.Time{}
		case stableSince.IsZero():
			stableSince = time.Now()
		case time.Since(stableSince) >= 3*time.Second:
			break wait
		}
		last = state
		select {
		case <-ctx.Done():
			t.Fatalf("the run did not end: %s; want every order applied, the killer dead-lettered and empty queues", state)
		case <-time.After(100 * time.Millisecond):
		}
	}
	require.NoError(t, <-published)
	e := r.end(ctx, append(slices.Clone(ids), crashLoopKiller), p)
	v := e.v

	// The killer: in the dead-letter queue, alone, after at most
	// MaxAttempts crashes, with a reason that says so.
	killerCalls, err := r.counts(ctx, "attempts:", []string{crashLoopKiller})
	require.NoError(t, err)
	calls := killerCalls[crashLoopKiller]
	if len(crashed) == 0 || len(crashed) > crashLoopAttempts || calls != len(crashed) {
		t.Errorf("%d crashes, %d handler calls of the killer; want 1 to %d crashes, one per call", len(crashed), calls, crashLoopAttempts)
	}
	if len(e.dead) != 1 || !slices.Equal(v.deadLettered, []string{crashLoopKiller}) {
		t.Fatalf("dead-lettered %d messages (%v); want the killer alone", len(e.dead), v.deadLettered)
	}
	dead := e.dead[0]
	reason, _ := dead.Headers[broker.HeaderError].(string)
	if !strings.Contains(reason, "consumer died") {
		t.Errorf("the killer's %s = %q; want it to say that its consumer died while handling it", broker.HeaderError, reason)
	}
	if n, _ := dead.Headers[rabbitmw.HeaderAttempts].(int64); n != crashLoopAttempts {
		t.Errorf("the killer's %s = %v; want %d", rabbitmw.HeaderAttempts, dead.Headers[rabbitmw.HeaderAttempts], crashLoopAttempts)
	}

	// Every other order processed; a second effect only where a crash cut
	// its handler between the effect and the done mark.
	if len(v.lost) > 0 {
		t.Errorf("%d orders lost, first %v; want none", len(v.lost), first(v.lost))
	}
	abandoned, err := r.counts(ctx, "abandoned:", ids)
	require.NoError(t, err)
	if pgURL != "" && len(v.twice) > 0 {
		t.Errorf("%d orders applied twice over the PostgreSQL inbox, first %v; want none", len(v.twice), first(v.twice))
	}
	for _, id := range v.twice {
		if by := e.effects[id]; len(by) != 2 || !slices.Contains(crashed, by[0]) || abandoned[id] == 0 {
			t.Errorf("order %s applied by %v, abandoned %d times; want twice at most, first by a crashed consumer (%v), abandoned", id, by, abandoned[id], crashed)
		}
	}
	var hit, hitAgain int
	for _, n := range abandoned {
		if n > 0 {
			hit++
		}
		if n > 1 {
			hitAgain++
		}
	}
	t.Logf("%s: killer dead-lettered after %d crashes (%q); other orders: %d once, %d twice, %d lost; %d orders abandoned by a crash (%d of them more than once); took %v",
		scenario, len(crashed), reason, len(v.once), len(v.twice), len(v.lost), hit, hitAgain, time.Since(began).Round(time.Millisecond))
	kind := "classic queue"
	if top.Quorum {
		kind = fmt.Sprintf("quorum queue, delivery limit %d", top.DeliveryLimit)
	}
	if pgURL != "" {
		kind += ", PostgreSQL inbox"
	}
	twice := "twice: effect before done mark"
	if pgURL != "" {
		twice = "twice: none may be, effect and done mark commit together"
	}
	record(t, v.counted(row{
		Scenario:   "10 message that kills its consumer, " + kind,
		Messages:   len(msgs),
		Duplicates: 0,
		Faults:     fmt.Sprintf("1 order SIGKILLs its consumer, which is restarted; lease %v, MaxAttempts %d", crashLoopLease, crashLoopAttempts),
		Note: fmt.Sprintf("killer dead-lettered after %d crashes, reason says its consumer died; %d orders in flight at a crash, abandoned and tried again (%d more than once); %s",
			len(crashed), hit, hitAgain, twice),
	}))
}

// publishPaced publishes msgs in order, one every interval, each confirmed
// by the server. The returned channel receives the first error (nil if
// none) once all are done.
func (r *run) publishPaced(ctx context.Context, msgs []amqp.Publishing, interval time.Duration) <-chan error {
	done := make(chan error, 1)
	go func() { // ends after the last publish, or at the first error
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for _, m := range msgs {
			if err := r.b.Publish(ctx, "", r.queue, m); err != nil {
				done <- fmt.Errorf("publish %s: %w", m.MessageId, err)
				return
			}
			select {
			case <-tick.C:
			case <-ctx.Done():
				done <- ctx.Err()
				return
			}
		}
		done <- nil
	}()
	return done
}

// counts returns the counters prefix+id of ids that are set.
func (r *run) counts(ctx context.Context, prefix string, ids []string) (map[string]int, error) {
	got := map[string]int{}
	for chunk := range slices.Chunk(ids, 500) {
		keys := make([]string, len(chunk))
		for i, id := range chunk {
			keys[i] = r.prefix + prefix + id
		}
		vals, err := r.rdb.MGet(ctx, keys...).Result()
		if err != nil && err != redis.Nil {
			return nil, err
		}
		for i, v := range vals {
			if s, ok := v.(string); ok {
				n, _ := strconv.Atoi(s)
				got[chunk[i]] = n
			}
		}
	}
	return got, nil
}
