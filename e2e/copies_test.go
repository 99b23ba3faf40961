package e2e_test

// What every copy of a message carries. The broker copies a message when
// it delays it (to a delay queue), dead-letters it (to the dead-letter
// queue), replays it (back to its work queue) and imports it (into a
// dead-letter queue); RabbitMQ copies it when a Settler rejects it (the
// work queue's dead-letter exchange). RabbitMQ's own dead-lettering is the
// reference: it keeps every property but removes Expiration, so that
// nothing expires out of a dead-letter queue, and keeps the original in
// its x-death record (original-expiration). The broker's copies do the
// same, and keep each property they cannot carry in a header of its own.
// The handler sees the message as it was first delivered, on every
// attempt and after a replay.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A copyBackend is a server the copy tests run on.
type copyBackend struct {
	name string
	open func(t *testing.T) *broker.Broker
}

var copyBackends = []copyBackend{
	{"memory", func(t *testing.T) *broker.Broker {
		m := brokertest.NewServer()
		t.Cleanup(m.Close)
		b := broker.New(m.URL(), broker.Options{})
		t.Cleanup(func() { b.Close() })
		return b
	}},
	{"rabbitmq", func(t *testing.T) *broker.Broker {
		b := broker.New(testenv.RabbitMQURL(t), broker.Options{})
		t.Cleanup(func() { b.Close() })
		return b
	}},
}

// props are the properties of a delivery that a copy may change.
type props struct {
	ContentType, ContentEncoding string
	DeliveryMode, Priority       uint8
	CorrelationID, ReplyTo       string
	Expiration, MessageID        string
	Timestamp                    time.Time
	Type, UserID, AppID          string
	Exchange, RoutingKey         string
	Body                         string
	Custom                       any // the header "custom"
}

func propsOf(d *amqp.Delivery) props {
	return props{
		ContentType: d.ContentType, ContentEncoding: d.ContentEncoding,
		DeliveryMode: d.DeliveryMode, Priority: d.Priority,
		CorrelationID: d.CorrelationId, ReplyTo: d.ReplyTo,
		Expiration: d.Expiration, MessageID: d.MessageId,
		Timestamp: d.Timestamp.UTC(), Type: d.Type, UserID: d.UserId, AppID: d.AppId,
		Exchange: d.Exchange, RoutingKey: d.RoutingKey,
		Body: string(d.Body), Custom: d.Headers["custom"],
	}
}

// fullMessage has every property set; its UserId is the server's user,
// "guest", the only one a publish may carry.
func fullMessage(id string, ts time.Time) amqp.Publishing {
	return amqp.Publishing{
		ContentType: "application/json", ContentEncoding: "identity",
		DeliveryMode: amqp.Transient, Priority: 3,
		CorrelationId: "corr-" + id, ReplyTo: "replies",
		Expiration: "600000", MessageId: id, Timestamp: ts,
		Type: "order.created", UserId: "guest", AppId: "shop",
		Headers: amqp.Table{"custom": "kept"},
		Body:    []byte(`{"id":"` + id + `"}`),
	}
}

var errCopyTest = errors.New("test: handler failed")

// onCopyBackends runs f on a Broker of each copyBackend.
func onCopyBackends(t *testing.T, f func(t *testing.T, b *broker.Broker)) {
	for _, be := range copyBackends {
		t.Run(be.name, func(t *testing.T) { f(t, be.open(t)) })
	}
}

// declared declares top for a work queue named prefix and a random
// suffix, deletes it at the end of t, and returns its name and the
// suffix.
func declared(t *testing.T, b *broker.Broker, prefix string, top func(suffix string) broker.Topology) (queue, suffix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var r [4]byte
	_, _ = rand.Read(r[:])
	suffix = hex.EncodeToString(r[:])
	queue = prefix + suffix
	tp := top(suffix)
	require.NoError(t, b.Declare(ctx, queue, tp))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		assert.NoError(t, b.Delete(ctx, queue, tp))
	})
	return queue, suffix
}

func TestCopiesCarryEveryProperty(t *testing.T) { onCopyBackends(t, testCopies) }

func testCopies(t *testing.T, b *broker.Broker) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	top := broker.Topology{Delays: []time.Duration{100 * time.Millisecond, time.Hour}}
	q, _ := declared(t, b, "rabbitmw-test-copies-", func(string) broker.Topology { return top })
	ts := time.Unix(time.Now().Unix(), 0).UTC()
	publish := func(id string) {
		t.Helper()
		require.NoError(t, b.Publish(ctx, "", q, fullMessage(id, ts)))
	}
	take := func(queue string) *amqp.Delivery {
		t.Helper()
		return takeFrom(ctx, t, b, queue)
	}
	got := map[string]*amqp.Delivery{}

	// RabbitMQ's own dead-lettering: a Settler rejects the message.
	got["first delivery"] = settleDirect(t, b, q, "settler", ts)
	got["rabbitmq dead-letter"] = take(q + ".dlq")

	// The broker's copies: a delay copy (left in the one-hour queue), and
	// a message retried once and then dead-lettered.
	var mu sync.Mutex
	views := map[string][]amqp.Delivery{}
	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		views[d.MessageId] = append(views[d.MessageId], *d)
		n := len(views[d.MessageId])
		mu.Unlock()
		switch {
		case d.MessageId == "delayed":
			return rabbitmw.RetryAfter(errCopyTest, time.Hour)
		case d.MessageId == "failing" && n == 1:
			return rabbitmw.RetryAfter(errCopyTest, 100*time.Millisecond)
		case d.MessageId == "failing":
			return rabbitmw.Permanent(errCopyTest)
		}
		return nil
	})
	stop := consumeIn(t, b, q, top, h)
	publish("delayed")
	publish("failing")
	dlq := take(q + ".dlq")
	got["dead-letter copy"] = dlq
	got["delay copy"] = take(q + ".delay.1h")
	stop()
	mu.Lock()
	require.Len(t, views["failing"], 2)
	got["handler, attempt 1"] = &views["failing"][0]
	got["handler, attempt 2"] = &views["failing"][1]
	mu.Unlock()

	// Replay and import start from the dead-letter copy: put it back.
	m, err := deadletter.ExportMessage(q+".dlq", dlq)
	require.NoError(t, err)
	var line bytes.Buffer
	require.NoError(t, json.NewEncoder(&line).Encode(m))
	export := line.String()
	_, err = deadletter.New(b).Import(ctx, q, bytes.NewBufferString(export), deadletter.ImportOptions{})
	require.NoError(t, err)
	got["import"] = take(q + ".dlq")

	// An export made before copies dropped Expiration, or by another
	// tool: the record carries the properties as they were published.
	old, err := deadletter.ExportMessage(q+".dlq", delivery(fullMessage("old-export", ts)))
	require.NoError(t, err)
	line.Reset()
	require.NoError(t, json.NewEncoder(&line).Encode(old))
	_, err = deadletter.New(b).Import(ctx, q, &line, deadletter.ImportOptions{})
	require.NoError(t, err)
	got["import of a record with every property"] = take(q + ".dlq")

	_, err = deadletter.New(b).Import(ctx, q, bytes.NewBufferString(export), deadletter.ImportOptions{})
	require.NoError(t, err)
	res, err := deadletter.New(b).Replay(ctx, q, deadletter.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, 1, res.Replayed)
	replayed := take(q)
	got["replay"] = replayed
	// And the handler's view of the replayed message.
	_, err = deadletter.New(b).Import(ctx, q, bytes.NewBufferString(export), deadletter.ImportOptions{})
	require.NoError(t, err)
	_, err = deadletter.New(b).Replay(ctx, q, deadletter.ReplayOptions{})
	require.NoError(t, err)
	stop = consumeIn(t, b, q, top, h)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(views["failing"]) == 3
	}, 20*time.Second, 20*time.Millisecond, "the replayed message was not handled")
	stop()
	mu.Lock()
	got["handler, after a replay"] = &views["failing"][2]
	mu.Unlock()

	// RabbitMQ's dead-letter, replayed: its route and expiration come from
	// its x-death record.
	m, err = deadletter.ExportMessage(q+".dlq", got["rabbitmq dead-letter"])
	require.NoError(t, err)
	line.Reset()
	require.NoError(t, json.NewEncoder(&line).Encode(m))
	_, err = deadletter.New(b).Import(ctx, q, &line, deadletter.ImportOptions{})
	require.NoError(t, err)
	res, err = deadletter.New(b).Replay(ctx, q, deadletter.ReplayOptions{Filter: deadletter.Filter{IDs: []string{"settler"}}, To: q})
	require.NoError(t, err)
	require.Equal(t, 1, res.Replayed)
	stop = consumeIn(t, b, q, top, h)
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(views["settler"]) == 1
	}, 20*time.Second, 20*time.Millisecond, "the replayed dead-letter of RabbitMQ was not handled")
	stop()
	mu.Lock()
	got["handler, after a replay of RabbitMQ's dead-letter"] = &views["settler"][0]
	mu.Unlock()

	// What each must carry. published is the message as first delivered;
	// copy is what the broker's copies carry on the wire: every property
	// but DeliveryMode (persistent), Expiration and UserId, each kept in a
	// header.
	published := func(id string) props {
		return props{
			ContentType: "application/json", ContentEncoding: "identity",
			DeliveryMode: amqp.Transient, Priority: 3,
			CorrelationID: "corr-" + id, ReplyTo: "replies",
			Expiration: "600000", MessageID: id, Timestamp: ts,
			Type: "order.created", UserID: "guest", AppID: "shop",
			Exchange: "", RoutingKey: q,
			Body: `{"id":"` + id + `"}`, Custom: "kept",
		}
	}
	copyOf := func(id, to string) props {
		p := published(id)
		p.DeliveryMode, p.Expiration, p.UserID = amqp.Persistent, "", ""
		p.RoutingKey = to
		return p
	}
	kept := amqp.Table{
		broker.HeaderOriginalExpiration:   "600000",
		broker.HeaderOriginalDeliveryMode: int64(amqp.Transient),
		broker.HeaderUserID:               "guest",
		broker.HeaderOriginalExchange:     "",
		broker.HeaderOriginalRoutingKey:   q,
	}
	rabbit := published("settler")
	rabbit.Expiration, rabbit.RoutingKey = "", q+".dlq"
	cases := []struct {
		kind    string
		want    props
		headers amqp.Table // nil: none of kept's
	}{
		{"first delivery", published("settler"), nil},
		{"rabbitmq dead-letter", rabbit, nil},
		{"delay copy", copyOf("delayed", q+".delay.1h"), kept},
		{"dead-letter copy", copyOf("failing", q+".dlq"), kept},
		{"import", copyOf("failing", q+".dlq"), kept},
		{"import of a record with every property", copyOf("old-export", q+".dlq"), amqp.Table{
			broker.HeaderOriginalExpiration:   "600000",
			broker.HeaderOriginalDeliveryMode: int64(amqp.Transient),
			broker.HeaderUserID:               "guest",
		}},
		{"replay", copyOf("failing", q), kept},
		{"handler, attempt 1", published("failing"), nil},
		{"handler, attempt 2", published("failing"), kept},
		{"handler, after a replay", published("failing"), kept},
		{"handler, after a replay of RabbitMQ's dead-letter", published("settler"), kept},
	}
	for _, c := range cases {
		d := got[c.kind]
		if !assert.NotNil(t, d, c.kind) {
			continue
		}
		assert.Equal(t, c.want, propsOf(d), c.kind)
		for _, k := range []string{broker.HeaderOriginalExpiration, broker.HeaderOriginalDeliveryMode, broker.HeaderUserID, broker.HeaderOriginalExchange, broker.HeaderOriginalRoutingKey} {
			want, ok := c.headers[k]
			v, has := d.Headers[k]
			if !ok {
				assert.False(t, has, "%s: header %s = %#v; want none", c.kind, k, v)
				continue
			}
			assert.Equal(t, want, v, "%s: header %s", c.kind, k)
		}
	}
	// The reference keeps the expiration in its x-death record.
	deaths, _ := got["rabbitmq dead-letter"].Headers["x-death"].([]any)
	require.Len(t, deaths, 1)
	death, _ := deaths[0].(amqp.Table)
	assert.Equal(t, "600000", death["original-expiration"], "x-death original-expiration of RabbitMQ's dead-letter")
}

// settleDirect takes message id from queue and rejects it through a
// Settler, as a consumer on a plain amqp091 channel does with a permanent
// failure: RabbitMQ dead-letters it. It returns the delivery.
func settleDirect(t *testing.T, b *broker.Broker, queue, id string, ts time.Time) *amqp.Delivery {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.Publish(ctx, "", queue, fullMessage(id, ts)))
	d, ok, err := b.Get(ctx, queue)
	require.NoError(t, err)
	require.True(t, ok)
	s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
	defer s.Close()
	require.NoError(t, s.Settle(ctx, d, rabbitmw.Permanent(errCopyTest)))
	return d
}

// consumeIn runs Consume on queue until the returned stop is called.
func consumeIn(t *testing.T, b *broker.Broker, queue string, top broker.Topology, h rabbitmw.Handler) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Consume(ctx, queue, h, broker.ConsumeOptions{Topology: top}) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			assert.NoError(t, <-done, "Consume")
		})
	}
	t.Cleanup(stop)
	return stop
}

// delivery is msg as a consumer would receive it from the default
// exchange.
func delivery(msg amqp.Publishing) *amqp.Delivery {
	return &amqp.Delivery{
		Headers: msg.Headers, ContentType: msg.ContentType, ContentEncoding: msg.ContentEncoding,
		DeliveryMode: msg.DeliveryMode, Priority: msg.Priority, CorrelationId: msg.CorrelationId,
		ReplyTo: msg.ReplyTo, Expiration: msg.Expiration, MessageId: msg.MessageId,
		Timestamp: msg.Timestamp, Type: msg.Type, UserId: msg.UserId, AppId: msg.AppId, Body: msg.Body,
	}
}
