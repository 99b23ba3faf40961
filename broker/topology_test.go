package broker

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

func TestTopologyExchangesRefused(t *testing.T) {
	topic := Exchange{Name: "events", Kind: ExchangeTopic}
	cases := []struct {
		name string
		top  Topology
		want string
	}{
		{"empty exchange name", Topology{Exchanges: []Exchange{{Kind: ExchangeTopic}}}, "empty name"},
		{"unknown kind", Topology{Exchanges: []Exchange{{Name: "e", Kind: "tpoic"}}}, `kind "tpoic"`},
		{"no kind", Topology{Exchanges: []Exchange{{Name: "e"}}}, `kind ""`},
		{"twice", Topology{Exchanges: []Exchange{topic, topic}}, `"events" twice`},
		{"bind the default exchange", Topology{Bindings: []Binding{{Key: "q"}}}, "default exchange"},
		{"bindings with DeclareSupport", Topology{Declare: DeclareSupport, Bindings: []Binding{{Exchange: "events"}}}, "bind it there"},
		{"bindings with DeclareNone", Topology{Declare: DeclareNone, Bindings: []Binding{{Exchange: "events"}}}, "bind it there"},
		{"exchanges with DeclareNone", Topology{Declare: DeclareNone, Exchanges: []Exchange{topic}}, "DeclareSupport"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.top.resolve("q")
			require.Error(t, err)
			assert.Contains(t, err.Error(), c.want)
		})
	}
	_, err := Topology{Exchanges: []Exchange{{Name: "x", Kind: "x-consistent-hash"}}}.resolve("q")
	assert.NoError(t, err, "a plugin's kind")
}

// exchangeName returns an exchange name unique to t.
func exchangeName(t *testing.T, what string) string {
	return queueName(t) + "." + what
}

// Messages reach the work queue through a topic, a headers and a fanout
// exchange; one is retried through a delay queue (the handler sees the
// exchange it was published to again) and one dead-lettered.
func TestExchangesRouteToTheWorkQueue(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			events, tagged, all := exchangeName(t, "events"), exchangeName(t, "tagged"), exchangeName(t, "all")
			// Auto-delete: the exchanges go with the work queue's bindings
			// when the fixture deletes it.
			top := Topology{
				Exchanges: []Exchange{
					{Name: events, Kind: ExchangeTopic, AutoDelete: true},
					{Name: tagged, Kind: ExchangeHeaders, AutoDelete: true},
					{Name: all, Kind: ExchangeFanout, AutoDelete: true},
				},
				Bindings: []Binding{
					{Exchange: events, Key: "order.*"},
					{Exchange: events, Key: "refund.#"},
					{Exchange: tagged, Args: amqp.Table{"x-match": "any", "tenant": "acme", "urgent": true}},
					{Exchange: all},
				},
			}
			f := setup(t, be, top)
			ctx := testContext(t, 30*time.Second)
			publish := func(exchange, key, id string, h amqp.Table) error {
				return f.b.Publish(ctx, exchange, key, amqp.Publishing{MessageId: id, Headers: h, Body: []byte(id)})
			}
			require.NoError(t, publish(events, "order.created", "created", nil))
			require.NoError(t, publish(events, "order.retried", "retried", nil))
			require.NoError(t, publish(events, "refund.eu.full", "refund", nil))
			require.NoError(t, publish(tagged, "", "acme", amqp.Table{"tenant": "acme"}))
			require.NoError(t, publish(all, "anything", "fanned", nil))
			for _, miss := range []struct {
				exchange, key string
				h             amqp.Table
			}{
				{events, "order.created.twice", nil}, // "*" is one word
				{events, "user.created", nil},
				{tagged, "", amqp.Table{"tenant": "other"}},
			} {
				err := publish(miss.exchange, miss.key, "missed", miss.h)
				assert.ErrorIs(t, err, ErrUnroutable, "publish to %s with key %q, headers %v", miss.exchange, miss.key, miss.h)
			}

			var mu sync.Mutex
			seen := map[string][]string{} // id -> exchange of each delivery
			r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				mu.Lock()
				seen[d.MessageId] = append(seen[d.MessageId], d.Exchange)
				n := len(seen[d.MessageId])
				mu.Unlock()
				switch {
				case d.MessageId == "retried" && n == 1:
					return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
				case d.MessageId == "refund":
					return rabbitmw.Permanent(errBoom)
				}
				return nil
			}), ConsumeOptions{Workers: 2})
			handled := func() int {
				mu.Lock()
				defer mu.Unlock()
				n := 0
				for _, ex := range seen {
					n += len(ex)
				}
				return n
			}
			require.Eventually(t, func() bool { return handled() == 6 }, 20*time.Second, 10*time.Millisecond)
			require.NoError(t, r.stop(t))
			mu.Lock()
			assert.Equal(t, map[string][]string{
				"created": {events},
				"retried": {events, events}, // back from its delay queue, with its own exchange restored
				"refund":  {events},
				"acme":    {tagged},
				"fanned":  {all},
			}, seen)
			mu.Unlock()
			dead := f.onlyDeadLetter()
			assert.Equal(t, "refund", dead.MessageId)
			assert.Equal(t, 0, f.length(f.q))
		})
	}
}

// An exchange that exists with another kind is a fatal error that says how
// to fix it; DeclareSupport checks that the exchanges exist and declares
// none; a binding to a missing exchange names it.
func TestExchangeRefusals(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			events := exchangeName(t, "events")
			f := setup(t, be, Topology{
				Exchanges: []Exchange{{Name: events, Kind: ExchangeTopic, AutoDelete: true}},
				Bindings:  []Binding{{Exchange: events, Key: "order.*"}},
			})
			ctx := testContext(t, 30*time.Second)
			h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })

			other := f.top
			other.Exchanges = []Exchange{{Name: events, Kind: ExchangeDirect, AutoDelete: true}}
			err := f.b.Consume(ctx, f.q, h, ConsumeOptions{Topology: other})
			require.ErrorIs(t, err, ErrExchangeArguments)
			assert.Contains(t, err.Error(), events)
			assert.Contains(t, err.Error(), "Topology.Exchanges")

			missing := exchangeName(t, "missing")
			support := Topology{Declare: DeclareSupport, Delays: testTiers,
				Exchanges: []Exchange{{Name: events, Kind: ExchangeTopic}, {Name: missing, Kind: ExchangeFanout}}}
			err = f.b.Consume(ctx, f.q, h, ConsumeOptions{Topology: support})
			require.ErrorIs(t, err, ErrExchangeNotFound)
			assert.Contains(t, err.Error(), missing)
			assert.NoError(t, ctx.Err(), "Consume returned at once, not at the deadline")
			// The passive check declared nothing: the missing one is
			// missing still, and events kept its kind, whatever the
			// check said (topic, while the check gave no settings).
			err = f.b.Declare(ctx, f.q, Topology{Declare: DeclareSupport, Delays: testTiers,
				Exchanges: []Exchange{{Name: missing, Kind: ExchangeTopic}}})
			assert.ErrorIs(t, err, ErrExchangeNotFound)
			assert.NoError(t, f.b.Declare(ctx, f.q, Topology{Declare: DeclareSupport, Delays: testTiers,
				Exchanges: []Exchange{{Name: events, Kind: ExchangeFanout}}}), "a passive check ignores the kind")

			bound := f.top
			bound.Exchanges = nil
			bound.Bindings = append(bound.Bindings, Binding{Exchange: missing, Key: "k"})
			err = f.b.Declare(ctx, f.q, bound)
			require.ErrorIs(t, err, ErrExchangeNotFound)
			assert.Contains(t, err.Error(), missing)
			assert.Contains(t, err.Error(), "Topology.Exchanges")
			assert.False(t, errors.Is(err, ErrQueueNotFound), "the queue exists: %v", err)
		})
	}
}

// A publish to an internal exchange is refused; the exchange takes
// messages from another exchange only.
func TestInternalExchange(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			inner := exchangeName(t, "inner")
			f := setup(t, be, Topology{
				Exchanges: []Exchange{{Name: inner, Kind: ExchangeFanout, Internal: true, AutoDelete: true}},
				Bindings:  []Binding{{Exchange: inner}},
			})
			err := f.b.Publish(testContext(t, 20*time.Second), inner, "", amqp.Publishing{Body: []byte("x")})
			require.Error(t, err)
			assert.Contains(t, fmt.Sprint(err), "internal")
		})
	}
}

// An exchange of a plugin's kind that the server does not have (the
// plugin is not enabled) is refused with 503 COMMAND_INVALID, which closes
// the connection: a refusal that every reconnect meets again, so a fatal
// error that names the kind, not a reconnect until the deadline.
func TestRabbitMQExchangeOfAKindTheServerLacks(t *testing.T) {
	b := New(testenv.RabbitMQURL(t), Options{ReconnectMin: 10 * time.Millisecond, ReconnectMax: 50 * time.Millisecond})
	defer b.Close()
	q := queueName(t)
	top := Topology{Delays: testTiers, Exchanges: []Exchange{{Name: q + ".x", Kind: "x-no-such-plugin", AutoDelete: true}}}
	h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	for name, call := range map[string]func(context.Context) error{
		"Declare": func(ctx context.Context) error { return b.Declare(ctx, q, top) },
		"Consume": func(ctx context.Context) error { return b.Consume(ctx, q, h, ConsumeOptions{Topology: top}) },
	} {
		ctx := testContext(t, 5*time.Second)
		err := call(ctx)
		require.Error(t, err, name)
		assert.NoError(t, ctx.Err(), "%s returned at once, not at the deadline: %v", name, err)
		assert.Contains(t, err.Error(), "x-no-such-plugin", name)
		assert.Contains(t, err.Error(), "plugin", name)
	}
}

// A binding the server refuses for its arguments (a headers binding's
// x-match that is not all or any) is a fatal error about the binding,
// with the fix in Topology.Bindings: not ErrExchangeArguments, whose
// fix (give the exchange its settings, or delete it) would not help.
func TestRabbitMQBindingArgumentsRefused(t *testing.T) {
	b := New(testenv.RabbitMQURL(t), Options{})
	defer b.Close()
	q := queueName(t)
	tagged := q + ".tagged"
	top := Topology{Delays: testTiers,
		Exchanges: []Exchange{{Name: tagged, Kind: ExchangeHeaders, AutoDelete: true}},
		Bindings:  []Binding{{Exchange: tagged, Args: amqp.Table{"x-match": "bogus", "tenant": "acme"}}}}
	defer func() {
		assert.NoError(t, b.Delete(testContext(t, 20*time.Second), q, top))
		// Never bound, the auto-delete exchange stays: delete it.
		conn, err := amqp.Dial(testenv.RabbitMQURL(t))
		require.NoError(t, err)
		defer conn.Close()
		ch, err := conn.Channel()
		require.NoError(t, err)
		assert.NoError(t, ch.ExchangeDelete(tagged, false, false))
	}()
	ctx := testContext(t, 20*time.Second)
	err := b.Declare(ctx, q, top)
	require.Error(t, err)
	assert.NoError(t, ctx.Err(), "fatal at once: %v", err)
	assert.NotErrorIs(t, err, ErrExchangeArguments)
	assert.Contains(t, err.Error(), "Topology.Bindings")
	assert.Contains(t, err.Error(), "x-match")
	assert.Contains(t, err.Error(), tagged)
}

// A queue whose node is down (a classic queue's home node, stopped or
// killed) is refused with 404 NOT_FOUND, but it exists: the refusal is
// temporary, for Consume to wait out, not ErrQueueNotFound, which stops
// it for good.
func TestRefusalOfAQueueWhoseNodeIsDown(t *testing.T) {
	top, err := Topology{}.resolve("q")
	require.NoError(t, err)
	for _, reason := range []string{
		"NOT_FOUND - home node 'rabbit@b' of durable queue 'q.dlq' in vhost '/' is down or inaccessible",
		"NOT_FOUND - queue 'q.dlq' in vhost '/' process is stopped by supervisor",
		"NOT_FOUND - queue 'q.dlq' in vhost '/' has crashed and failed to restart",
	} {
		e404 := &amqp.Error{Code: amqp.NotFound, Reason: reason, Server: true, Recover: true}
		for what, err := range map[string]error{
			"topology": top.refusal(&queueError{Queue: "q.dlq", Err: e404}),
			"Len":      refusal("q.dlq", e404),
		} {
			assert.ErrorIs(t, err, ErrUnreachable, "%s: %s", what, reason)
			assert.NotErrorIs(t, err, ErrQueueNotFound, "%s: %s", what, reason)
			assert.True(t, retryable(err), "%s: %s", what, reason)
		}
	}
	down := &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - home node 'rabbit@b' of durable queue 'q.dlq' in vhost '/' is down or inaccessible", Server: true, Recover: true}
	assert.Contains(t, top.refusal(&queueError{Queue: "q.dlq", Err: down}).Error(), "QuorumSupport", "the fix, for a classic support queue")
	missing := &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no queue 'q' in vhost '/'", Server: true, Recover: true}
	assert.ErrorIs(t, refusal("q", missing), ErrQueueNotFound)
}

func TestTierName(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{time.Second, "1s"}, {5 * time.Second, "5s"}, {30 * time.Second, "30s"},
		{2 * time.Minute, "2m"}, {10 * time.Minute, "10m"}, {time.Hour, "1h"},
		{1500 * time.Millisecond, "1500ms"}, {90 * time.Second, "90s"},
		{3600 * time.Second, "1h"}, {50 * time.Millisecond, "50ms"}, {25 * time.Hour, "25h"},
	} {
		if got := tierName(c.d); got != c.want {
			t.Errorf("tierName(%v) = %q; want %q", c.d, got, c.want)
		}
	}
}

func TestTopologyResolve(t *testing.T) {
	top, err := Topology{}.resolve("orders")
	require.NoError(t, err, "resolve(defaults)")
	var names []string
	for _, s := range top.specs() {
		names = append(names, s.Name)
	}
	assert.Equal(t, []string{"orders", "orders.dlq",
		"orders.delay.1s", "orders.delay.5s", "orders.delay.30s", "orders.delay.2m", "orders.delay.10m", "orders.delay.1h"}, names, "declared queues")
	specs := top.specs()
	assert.Equal(t, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders.dlq"}, specs[0].Args, "work queue arguments")
	assert.Equal(t, amqp.Table(nil), specs[1].Args, "dead-letter queue arguments")
	assert.Equal(t, amqp.Table{"x-message-ttl": int64(5000), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders"}, specs[3].Args, "delay queue 5s arguments")

	top, err = Topology{Declare: DeclareSupport, Delays: []time.Duration{time.Minute, time.Second, time.Second}}.resolve("q")
	require.NoError(t, err, "resolve(quorum, support)")
	specs = top.specs()
	assert.Equal(t, queueSpec{Name: "q", Passive: true}, specs[0], "work queue spec with DeclareSupport")
	assert.Equal(t, 4, len(specs), "specs with a deduplicated ladder")
	assert.Equal(t, []string{"q.delay.1s", "q.delay.1m"}, []string{specs[2].Name, specs[3].Name}, "tiers sorted")
	top, _ = Topology{Quorum: true, DeliveryLimit: 5}.resolve("q")
	assert.Equal(t, amqp.Table{
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "q.dlq", "x-queue-type": "quorum", "x-delivery-limit": int64(5)}, top.specs()[0].Args, "quorum work queue arguments")
	for _, mode := range []DeclareMode{DeclareAll, DeclareSupport} {
		top, err = Topology{Declare: mode, QuorumSupport: true, Delays: []time.Duration{time.Second}}.resolve("q")
		require.NoError(t, err, "resolve(QuorumSupport, %v)", mode)
		specs = top.specs()
		assert.Equal(t, amqp.Table{"x-queue-type": "quorum"}, specs[1].Args, "dead-letter queue arguments with QuorumSupport, %v", mode)
		assert.Equal(t, amqp.Table{"x-message-ttl": int64(1000), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "q",
			"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}, specs[2].Args, "delay queue arguments with QuorumSupport, %v", mode)
	}
	assert.Equal(t, queueSpec{Name: "q", Passive: true}, specs[0], "work queue spec with DeclareSupport and QuorumSupport")
	top, _ = Topology{Declare: DeclareNone}.resolve("q")
	assert.Equal(t, 0, len(top.specs()), "specs with DeclareNone")
	assert.Equal(t, 8, len(top.names()), "names with DeclareNone")

	for _, bad := range []Topology{
		{Delays: []time.Duration{0}},
		{Delays: []time.Duration{-time.Second}},
		{Delays: []time.Duration{1500 * time.Microsecond}},
		{Delays: []time.Duration{50 * 24 * time.Hour}},
		{DeliveryLimit: 3},
		{Quorum: true, DeliveryLimit: -1},
		{Declare: DeclareMode(7)},
		{Quorum: true, Declare: DeclareSupport},
		{Quorum: true, DeliveryLimit: 3, Declare: DeclareSupport},
		{Quorum: true, Declare: DeclareNone},
		{QuorumSupport: true, Declare: DeclareNone},
	} {
		if _, err := bad.resolve("q"); err == nil {
			t.Errorf("resolve(%+v) = nil error; want one", bad)
		}
	}
	if _, err := (Topology{}).resolve(""); err == nil {
		t.Error("resolve of an empty queue name = nil error; want one")
	}
}

func TestTierFor(t *testing.T) {
	top, _ := Topology{Delays: []time.Duration{time.Second, 5 * time.Second, time.Minute}}.resolve("q")
	for _, c := range []struct {
		d    time.Duration
		want string
		over bool
	}{
		{time.Millisecond, "q.delay.1s", false},
		{time.Second, "q.delay.1s", false},
		{time.Second + 1, "q.delay.5s", false},
		{6 * time.Second, "q.delay.1m", false},
		{time.Minute, "q.delay.1m", false},
		{time.Hour, "q.delay.1m", true},
	} {
		tr, over := top.tierFor(c.d)
		if tr.queue != c.want || over != c.over {
			t.Errorf("tierFor(%v) = %q, %t; want %q, %t", c.d, tr.queue, over, c.want, c.over)
		}
	}
}

func TestRefusalText(t *testing.T) {
	top, _ := Topology{}.resolve("q")
	e406 := &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg", Server: true, Recover: true}
	err := top.refusal(&queueError{Queue: "q", Err: e406})
	require.ErrorIs(t, err, ErrQueueArguments, "refusal(406 on q)")
	assert.Contains(t, err.Error(), "DeclareSupport", "refusal(406 on q)")
	err = top.refusal(&queueError{Queue: "q.dlq", Err: e406})
	require.ErrorIs(t, err, ErrQueueArguments, "refusal(406 on q.dlq)")
	assert.Contains(t, err.Error(), `"q.dlq"`, "refusal(406 on q.dlq)")
	for _, qs := range []bool{false, true} {
		top, _ := Topology{QuorumSupport: qs}.resolve("q")
		e406 := &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q.dlq' in vhost '/': received none but current is the value 'quorum' of type 'longstr'", Server: true, Recover: true}
		err := top.refusal(&queueError{Queue: "q.dlq", Err: e406})
		require.ErrorIs(t, err, ErrQueueArguments, "refusal(406 x-queue-type on q.dlq), QuorumSupport %t", qs)
		assert.Contains(t, err.Error(), fmt.Sprintf("QuorumSupport is %t", qs), "refusal(406 x-queue-type on q.dlq)")
	}
	lost := lostError(&amqp.Error{Code: amqp.ConnectionForced, Server: true})
	if got := top.refusal(lost); got != lost {
		t.Errorf("refusal(lost) = %v; want it unchanged", got)
	}
}

// DefaultDelays hands out a copy: changing it changes no later call, nor
// the default ladder.
func TestDefaultDelaysIsACopy(t *testing.T) {
	d := DefaultDelays()
	want := slices.Clone(d)
	d[0] = time.Hour
	assert.Equal(t, want, DefaultDelays(), "DefaultDelays() after a caller changed its result")
	top, err := Topology{}.resolve("q")
	require.NoError(t, err, "resolve(defaults)")
	assert.Equal(t, time.Second, top.tiers[0].d, "the shortest default tier")
}

func TestTopologyQueues(t *testing.T) {
	q, err := Topology{Delays: []time.Duration{time.Minute, 1500 * time.Millisecond, time.Second, time.Second}}.Queues("orders")
	require.NoError(t, err, "Queues")
	assert.Equal(t, Queues{Work: "orders", DeadLetter: "orders.dlq", Delays: []string{"orders.delay.1s", "orders.delay.1500ms", "orders.delay.1m"}}, q, "Queues")
	q, err = Topology{}.Queues("orders")
	require.NoError(t, err, "Queues")
	assert.Equal(t, []string{"orders.delay.1s", "orders.delay.5s", "orders.delay.30s", "orders.delay.2m", "orders.delay.10m", "orders.delay.1h"}, q.Delays, "default delay queues")
	if _, err := (Topology{Delays: []time.Duration{-time.Second}}).Queues("orders"); err == nil {
		t.Error("Queues of an invalid Topology = nil error; want an error")
	}
}

// With QuorumSupport the dead-letter and delay queues are quorum queues:
// the server takes their arguments, a delay copy comes back to the work
// queue through an at-least-once tier, and DeclareSupport declares them
// alike. Queues that exist with the other type are refused, for good,
// with the fix in the text, in either direction.
func TestQuorumSupport(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			f := setup(t, be, Topology{Quorum: true, QuorumSupport: true})
			ctx := testContext(t, 20*time.Second)
			require.NoError(t, f.b.Publish(ctx, "", f.q+".delay.50ms", amqp.Publishing{MessageId: "m"}))
			require.Eventually(t, func() bool { return f.length(f.q) == 1 }, 10*time.Second, 10*time.Millisecond, "the delay copy back in the work queue")
			require.NoError(t, f.b.Declare(ctx, f.q, Topology{Declare: DeclareSupport, QuorumSupport: true, Delays: testTiers}), "DeclareSupport over it")

			err := f.b.Declare(ctx, f.q, Topology{Quorum: true, Delays: testTiers})
			require.ErrorIs(t, err, ErrQueueArguments, "the same queues without QuorumSupport")
			assert.Contains(t, err.Error(), "QuorumSupport is false")

			classic := setup(t, be, Topology{Quorum: true})
			err = classic.b.Consume(ctx, classic.q, rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }),
				ConsumeOptions{Topology: Topology{Quorum: true, QuorumSupport: true, Delays: testTiers}})
			require.ErrorIs(t, err, ErrQueueArguments, "Consume with QuorumSupport over classic support queues")
			assert.Contains(t, err.Error(), "QuorumSupport is true")
			require.NoError(t, ctx.Err(), "a fatal error, not waited out")
		})
	}
}
