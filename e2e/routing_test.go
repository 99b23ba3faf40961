package e2e_test

// A handler that branches on the routing key (several event types on one
// queue) must see the key the message was published with on every
// attempt, although each retry comes back from a delay queue through the
// default exchange, and after a replay from the dead-letter queue.

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/otelmw"
)

// route is where a delivery says it came from.
type route struct {
	Exchange, RoutingKey, UserID string
}

// routeLog records the routing_key attribute of the Log layer's records.
type routeLog struct {
	mu   sync.Mutex
	keys []string
}

func (l *routeLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *routeLog) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *routeLog) WithGroup(string) slog.Handler            { return l }
func (l *routeLog) Handle(_ context.Context, r slog.Record) error {
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "routing_key" {
			l.mu.Lock()
			l.keys = append(l.keys, a.Value.String())
			l.mu.Unlock()
		}
		return true
	})
	return nil
}

func TestRetriesSeeTheOriginalExchangeAndRoutingKey(t *testing.T) {
	onCopyBackends(t, testRetriesSeeTheOriginalRoute)
}

// eventsTopology is a work queue bound with "order.*" to a topic exchange,
// the exchange of the issue, "events", with a name of its own (the server
// is shared) that goes with the queue's binding.
func eventsTopology(suffix string) broker.Topology {
	return broker.Topology{
		Delays:    []time.Duration{50 * time.Millisecond},
		Exchanges: []broker.Exchange{{Name: "rabbitmw-test-events-" + suffix, Kind: broker.ExchangeTopic, Transient: true, AutoDelete: true}},
		Bindings:  []broker.Binding{{Exchange: "rabbitmw-test-events-" + suffix, Key: "order.*"}},
	}
}

func testRetriesSeeTheOriginalRoute(t *testing.T, b *broker.Broker) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q, suffix := declared(t, b, "rabbitmw-test-orders-", eventsTopology)
	top, exchange := eventsTopology(suffix), "rabbitmw-test-events-"+suffix

	var mu sync.Mutex
	var seen []route
	logs := &routeLog{}
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	tel := otelmw.New(otelmw.Options{TracerProvider: tp, Queue: q})
	chain := rabbitmw.Chain(
		tel.Middleware(),
		middleware.Log(slog.New(logs)),
		middleware.Retry(nil, middleware.RetryOptions{
			CountByHeader: true, MaxAttempts: 3,
			Backoff: func(int) time.Duration { return 50 * time.Millisecond },
		}),
	)
	h := chain(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, route{d.Exchange, d.RoutingKey, d.UserId})
		if len(seen) <= 3 {
			return errCopyTest
		}
		return nil
	}))
	stop := consumeIn(t, b, q, top, h)
	require.NoError(t, b.Publish(ctx, exchange, "order.created", amqp.Publishing{MessageId: "o1", UserId: "guest", Body: []byte("x")}))
	dead := deadLettered(ctx, t, b, q)
	// The fault headers name the original.
	assert.Equal(t, exchange, dead.Headers[broker.HeaderOriginalExchange])
	assert.Equal(t, "order.created", dead.Headers[broker.HeaderOriginalRoutingKey])

	res, err := deadletter.New(b).Replay(ctx, q, deadletter.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, 1, res.Replayed)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == 4
	}, 20*time.Second, 20*time.Millisecond, "the replayed message was not handled")
	stop()

	want := route{exchange, "order.created", "guest"}
	for i, got := range seen {
		assert.Equal(t, want, got, "delivery %d (3 attempts, then a replay)", i+1)
	}
	logs.mu.Lock()
	assert.Equal(t, []string{"order.created", "order.created", "order.created", "order.created"}, logs.keys, "Log's routing_key")
	logs.mu.Unlock()
	ended := spans.Ended()
	require.Len(t, ended, 4)
	for i, s := range ended {
		attrs := attribute.NewSet(s.Attributes()...)
		v, _ := attrs.Value(semconv.MessagingRabbitMQDestinationRoutingKeyKey)
		assert.Equal(t, "order.created", v.AsString(), "span %d routing key", i+1)
		assert.Equal(t, "process "+exchange+":order.created:"+q, s.Name(), "span %d", i+1)
	}
}

// A message that RabbitMQ itself dead-lettered (it expired in the work
// queue) carries its route only in its x-death record; replayed, it is
// handled with that route and its expiration, as first published.
func TestReplayOfAServerDeadLetterSeesItsRoute(t *testing.T) {
	onCopyBackends(t, func(t *testing.T, b *broker.Broker) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		q, suffix := declared(t, b, "rabbitmw-test-orders-", eventsTopology)
		top, exchange := eventsTopology(suffix), "rabbitmw-test-events-"+suffix
		require.NoError(t, b.Publish(ctx, exchange, "order.cancelled", amqp.Publishing{MessageId: "o2", Expiration: "1", Body: []byte("x")}))
		require.Eventually(t, func() bool {
			n, err := b.Len(ctx, q+".dlq")
			require.NoError(t, err)
			return n == 1
		}, 20*time.Second, 20*time.Millisecond, "the message did not expire into the dead-letter queue")
		res, err := deadletter.New(b).Replay(ctx, q, deadletter.ReplayOptions{To: q})
		require.NoError(t, err)
		require.Equal(t, 1, res.Replayed)
		seen := make(chan amqp.Delivery, 1)
		stop := consumeIn(t, b, q, top, rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			seen <- *d
			return nil
		}))
		var d amqp.Delivery
		select {
		case d = <-seen:
		case <-ctx.Done():
			t.Fatal("the replayed message was not handled")
		}
		stop()
		assert.Equal(t, []string{exchange, "order.cancelled", "1"}, []string{d.Exchange, d.RoutingKey, d.Expiration})
		assert.Equal(t, 0, len(seen), "handled once")
	})
}

func TestRetriesOfAForwardedMessageSeeItsOwnRoute(t *testing.T) {
	onCopyBackends(t, testRetriesOfAForwardedMessage)
}

// A message that an exchange routed carries, as a producer forwarded it
// whole, the headers of another message's copy: its route, UserId,
// Expiration, DeliveryMode and CC. The first delivery shows its own (see
// asPublished), and so must every later one, from a delay queue or a
// replay: the copies record what the handler saw, not the stale headers.
func testRetriesOfAForwardedMessage(t *testing.T, b *broker.Broker) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	q, suffix := declared(t, b, "rabbitmw-test-forwarded-", eventsTopology)
	top, exchange := eventsTopology(suffix), "rabbitmw-test-events-"+suffix

	type view struct {
		route
		Expiration   string
		DeliveryMode uint8
		CC           any
	}
	var mu sync.Mutex
	var seen []view
	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, view{route{d.Exchange, d.RoutingKey, d.UserId}, d.Expiration, d.DeliveryMode, d.Headers["CC"]})
		switch len(seen) {
		case 1:
			return rabbitmw.RetryAfter(errCopyTest, 50*time.Millisecond)
		case 2:
			return rabbitmw.Permanent(errCopyTest)
		}
		return nil
	})
	stop := consumeIn(t, b, q, top, h)
	forwarded := amqp.Table{
		broker.HeaderOriginalExchange:     "",
		broker.HeaderOriginalRoutingKey:   "another-queue",
		broker.HeaderUserID:               "admin",
		broker.HeaderOriginalExpiration:   "1000",
		broker.HeaderOriginalDeliveryMode: int64(amqp.Transient),
		broker.HeaderOriginalCC:           []any{"another-queue"},
	}
	require.NoError(t, b.Publish(ctx, exchange, "order.created", amqp.Publishing{
		MessageId: "f1", UserId: "guest", DeliveryMode: amqp.Persistent, Headers: forwarded, Body: []byte("x"),
	}))
	dead := deadLettered(ctx, t, b, q)
	assert.Equal(t, exchange, dead.Headers[broker.HeaderOriginalExchange], "dead-letter copy: original exchange")
	assert.Equal(t, "order.created", dead.Headers[broker.HeaderOriginalRoutingKey], "dead-letter copy: original routing key")
	assert.Equal(t, "guest", dead.Headers[broker.HeaderUserID], "dead-letter copy: user id")
	for _, k := range []string{broker.HeaderOriginalExpiration, broker.HeaderOriginalDeliveryMode, broker.HeaderOriginalCC} {
		assert.NotContains(t, dead.Headers, k, "dead-letter copy of a persistent message without an expiration or CC")
	}

	res, err := deadletter.New(b).Replay(ctx, q, deadletter.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, 1, res.Replayed)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen) == 3
	}, 20*time.Second, 20*time.Millisecond, "the replayed message was not handled")
	stop()

	want := view{route{exchange, "order.created", "guest"}, "", amqp.Persistent, nil}
	for i, got := range seen {
		assert.Equal(t, want, got, "delivery %d (a delay, a dead-letter, then a replay)", i+1)
	}
}

// deadLettered waits for the one message in queue's dead-letter queue and
// returns it, left there.
func deadLettered(ctx context.Context, t *testing.T, b *broker.Broker, queue string) *amqp.Delivery {
	t.Helper()
	var dead *amqp.Delivery
	require.Eventually(t, func() bool {
		dls, err := deadletter.New(b).List(ctx, queue, deadletter.ListOptions{})
		require.NoError(t, err)
		if len(dls) == 1 {
			dead = dls[0].Delivery
		}
		return dead != nil
	}, 20*time.Second, 20*time.Millisecond, "the message was not dead-lettered")
	return dead
}
