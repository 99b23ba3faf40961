//go:build reliability

package reliability_test

// Scenario 5, lease loss: consumer A reaches the store through a proxy;
// its handler is slower than its lease (2.5 s against 1.5 s), so the lease
// must be renewed while it runs. Once A has claimed the messages, the
// proxy is cut (a partition: nothing gets through, nothing is refused),
// and a second copy of each message goes to consumer B, which reaches the
// store directly. A's renewals fail; before its lease ends, Dedup cancels
// its handler's context, and the handler, which honours it, returns
// without its effect; A marks nothing done. B finds the messages busy until
// A's lease has ended, then abandoned (a failed attempt, which Retry counts
// and tries again at once, one message at a time), claims them, renews its
// own lease past the 1.5 s (its handler is as slow), and applies each
// effect: once.
//
// The limit, shown by a handler that ignores its context: a lease bounds,
// it does not fence. A's handler then applies its effect after the lease
// has ended, and the message is processed again by whoever claims it next
// (B, or A itself once its link is back): twice.

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

const (
	leaseLossIDs   = 3
	leaseLossLease = 1500 * time.Millisecond
	leaseLossHold  = 2500 * time.Millisecond
)

// leaseLossOpts are the options that the consumers of the lease-loss
// scenarios share, over Redis and over PostgreSQL: a worker and a prefetch
// slot for each message, a lease shorter than A's handler holds it.
func leaseLossOpts() consumerOpts {
	return consumerOpts{
		workers:     leaseLossIDs,
		prefetch:    leaseLossIDs,
		lease:       leaseLossLease,
		timeout:     30 * time.Second,
		busy:        200 * time.Millisecond,
		unavailable: 300 * time.Millisecond,
	}
}

// leaseLossResult is what each message came to: who applied its effect,
// in order, and what A's handler recorded.
type leaseLossResult struct {
	r       *run
	ids     []string
	effects map[string][]string
	aEvents map[string][]string // id -> A's events for it ("start", "cancelled <cause>", ...)
}

// leaseLoss runs the scenario with A's handler in mode (slow: honours its
// context; stubborn: ignores it) and A's store client honouring context
// deadlines or not.
func leaseLoss(t *testing.T, name, mode string, ctxTimeouts bool) *leaseLossResult {
	t.Helper()
	r := newRun(t, name, tiers...)
	px := startProxy(t, r.redisAddr)
	base := leaseLossOpts()
	base.hold = leaseLossHold
	optsA := base
	optsA.mode = mode
	optsA.storeAddr = px.addr
	optsA.storeContextTimeouts = ctxTimeouts
	optsB := base
	optsB.mode = "slow"
	optsB.storeContextTimeouts = true

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res := &leaseLossResult{r: r}
	for i := range leaseLossIDs {
		res.ids = append(res.ids, fmt.Sprintf("lease-%d", i))
	}

	a := r.startConsumer("A", optsA)
	r.publishIDs(ctx, res.ids)
	// A has claimed every message: its handlers have started.
	if err := r.waitEvents(ctx, func(ev map[string][]string) bool {
		return everyHas(ev, res.ids, "start A")
	}); err != nil {
		t.Fatal(err)
	}
	px.partition()
	cutAt := time.Now()
	// A second copy of each message (a resend, or a redelivery), for B.
	r.publishIDs(ctx, res.ids)
	b := r.startConsumer("B", optsB)

	// Every message has its effect, and every handler of A has returned:
	// cancelled, or with its effect applied.
	if err := r.waitEvents(ctx, func(ev map[string][]string) bool {
		return r.count(ctx, "distinct") >= leaseLossIDs && everyHas(ev, res.ids, "cancelled A", "ignored A", "applied A")
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("A's handlers all returned, and every message has an effect, %v after the partition", time.Since(cutAt).Round(time.Millisecond))
	px.heal()
	require.NoError(t, r.awaitQuiet(ctx, leaseLossIDs, 3*time.Second))
	e := r.end(ctx, res.ids, a, b)
	t.Logf("consumers: %+v", e.stats)
	if len(e.dead) > 0 {
		t.Errorf("%d messages dead-lettered; want none", len(e.dead))
	}
	res.effects = e.effects
	ev, err := r.events(ctx)
	require.NoError(t, err)
	res.aEvents = map[string][]string{}
	for id, es := range ev {
		for _, e := range es {
			if f := strings.SplitN(e, " ", 3); len(f) >= 2 && f[1] == "A" {
				res.aEvents[id] = append(res.aEvents[id], strings.Join(append(f[:1:1], f[2:]...), " "))
			}
		}
	}
	return res
}

// waitEvents waits until done holds for the events of the run, by id.
func (r *run) waitEvents(ctx context.Context, done func(map[string][]string) bool) error {
	for {
		ev, err := r.events(ctx)
		if err != nil {
			return err
		}
		if done(ev) {
			return nil
		}
		if err := r.procsAlive(); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the handlers: %w; events so far: %v", ctx.Err(), ev)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// events returns, by message key, what the slow handlers recorded ("start
// A", "cancelled A <cause>", "ignored A <cause>"), and each effect as
// "applied <consumer>".
func (r *run) events(ctx context.Context) (map[string][]string, error) {
	entries, err := r.rdb.LRange(ctx, r.prefix+"events", 0, -1).Result()
	if err != nil {
		return nil, err
	}
	ev := map[string][]string{}
	for _, e := range entries {
		f := strings.SplitN(e, " ", 4) // what, consumer, key, cause
		if len(f) < 3 {
			return nil, fmt.Errorf("malformed event %q", e)
		}
		ev[f[2]] = append(ev[f[2]], strings.Join(append(f[:2:2], f[3:]...), " "))
	}
	log, err := r.rdb.LRange(ctx, r.prefix+"log", 0, -1).Result()
	if err != nil {
		return nil, err
	}
	for _, e := range log {
		name, key, _ := strings.Cut(e, " ")
		ev[key] = append(ev[key], "applied "+name)
	}
	return ev, nil
}

func hasEvent(events []string, prefix string) bool {
	return slices.ContainsFunc(events, func(e string) bool { return strings.HasPrefix(e, prefix) })
}

// everyHas reports whether the events of each of ids, in ev, include one
// that starts with one of prefixes.
func everyHas(ev map[string][]string, ids []string, prefixes ...string) bool {
	return !slices.ContainsFunc(ids, func(id string) bool {
		return !slices.ContainsFunc(prefixes, func(p string) bool { return hasEvent(ev[id], p) })
	})
}

// publishIDs publishes a message for each of ids, with the id as its
// body, each confirmed by the server before the next.
func (r *run) publishIDs(ctx context.Context, ids []string) {
	r.t.Helper()
	for _, id := range ids {
		require.NoError(r.t, r.b.Publish(ctx, "", r.queue, amqp.Publishing{MessageId: id, Body: []byte(id)}), "publish %s", id)
	}
}

func TestLeaseLoss(t *testing.T) {
	t.Run("HandlerHonoursContext", func(t *testing.T) {
		res := leaseLoss(t, "leaseloss", "slow", true)
		v := judge(res.ids, res.effects, nil)
		for _, id := range res.ids {
			if by := res.effects[id]; !slices.Equal(by, []string{"B"}) {
				t.Errorf("message %s applied by %v; want once, by B", id, by)
			}
			cancelled := slices.IndexFunc(res.aEvents[id], func(e string) bool { return strings.HasPrefix(e, "cancelled") })
			if cancelled < 0 {
				t.Errorf("A's handler of %s: events %v; want its context cancelled", id, res.aEvents[id])
			} else if c := res.aEvents[id][cancelled]; !strings.Contains(c, "could not be renewed") {
				t.Errorf("A's handler of %s cancelled with %q; want the cause to say the lease could not be renewed", id, c)
			}
		}
		t.Logf("A's handlers: %v", res.aEvents)
		record(t, v.counted(row{
			Scenario:   "5 lease loss",
			Messages:   2 * leaseLossIDs,
			Duplicates: leaseLossIDs,
			Faults:     fmt.Sprintf("A's store link partitioned after its claims; handler %v, lease %v", leaseLossHold, leaseLossLease),
			Note:       "A's context cancelled before its lease ended, A marked nothing; B applied each effect",
		}))
	})

	// The documented limit: the same, with a handler that ignores its
	// context. Its effect lands after its lease has ended, and the next
	// claimer's too.
	t.Run("HandlerIgnoresContext", func(t *testing.T) {
		res := leaseLoss(t, "leaselimit", "stubborn", true)
		v := judge(res.ids, res.effects, nil)
		for _, id := range res.ids {
			if by := res.effects[id]; len(by) != 2 || by[0] != "A" {
				t.Errorf("message %s applied by %v; want twice, by A (after its lease ended), then by the next claimer: the documented limit", id, by)
			}
			if !hasEvent(res.aEvents[id], "ignored") {
				t.Errorf("A's handler of %s: events %v; want it to have ignored a cancelled context", id, res.aEvents[id])
			}
		}
		record(t, v.counted(row{
			Scenario:   "5 lease loss, handler ignores ctx",
			Messages:   2 * leaseLossIDs,
			Duplicates: leaseLossIDs,
			Faults:     "as above",
			Note:       "the documented limit: a lease bounds, it does not fence",
		}))
	})
}

// The same partition, with A's store on a Redis client as redisstore.New's
// documentation and the README build it: redis.Options without
// ContextTimeoutEnabled, so that go-redis does not bound a call by its
// context's deadline, only by ReadTimeout (3 s) and its retries. A
// renewal that the partition swallows then outlasts the lease. Dedup must
// not wait for it: it cancels the handler on the clock when the lease may
// end before the renewal returns. (This test found the bug when Dedup
// decided only once the call returned, after the lease had ended and B
// had claimed the message, so both applied the effect.)
func TestLeaseLossDefaultRedisClient(t *testing.T) {
	res := leaseLoss(t, "leasedefault", "slow", false)
	v := judge(res.ids, res.effects, nil)
	for _, id := range res.ids {
		if by := res.effects[id]; !slices.Equal(by, []string{"B"}) {
			t.Errorf("message %s applied by %v; want once, by B: A's handler, slower than its lease and honouring its context, must be cancelled before the lease ends (A's events: %v)", id, by, res.aEvents[id])
		}
	}
	record(t, v.counted(row{
		Scenario:   "5 lease loss, default go-redis client",
		Messages:   2 * leaseLossIDs,
		Duplicates: leaseLossIDs,
		Faults:     "as above; A's client without ContextTimeoutEnabled",
		Note:       "A's renewal blocked past its lease; A cancelled on the clock, before the lease ended; B applied each effect",
	}))
}
