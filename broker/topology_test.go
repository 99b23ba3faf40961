package broker

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
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
	missing := &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no queue 'q' in vhost '/'", Server: true, Recover: true}
	assert.ErrorIs(t, refusal("q", missing), ErrQueueNotFound)
}
