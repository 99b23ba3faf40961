package broker

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// observerLog records an Observer's events.
type observerLog struct {
	mu         sync.Mutex
	published  []error
	republish  []RepublishEvent
	reconnects []ReconnectEvent
}

func (l *observerLog) observer() Observer {
	return Observer{
		Publish: func(ctx context.Context, exchange, key string, msg *amqp.Publishing) func(error) {
			msg.Headers["x-test-trace"] = "trace-of-" + msg.MessageId
			return func(err error) {
				l.mu.Lock()
				defer l.mu.Unlock()
				l.published = append(l.published, err)
			}
		},
		Republish: func(ctx context.Context, e RepublishEvent) {
			l.mu.Lock()
			defer l.mu.Unlock()
			e.Delivery = nil
			l.republish = append(l.republish, e)
		},
		Reconnect: func(e ReconnectEvent) {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.reconnects = append(l.reconnects, e)
		},
	}
}

// observed returns a Broker with obs on f's server, named like f's so that
// f.be.drop closes its connections too.
func (f *fixture) observed(t *testing.T, obs Observer) *Broker {
	opts := Options{
		Logger:       slog.New(f.logs),
		ReconnectMin: 20 * time.Millisecond,
		ReconnectMax: 500 * time.Millisecond,
		Host:         "test-host",
		Process:      f.process,
		Observer:     obs,
	}
	var b *Broker
	if f.mem != nil {
		b = New(f.mem.URL(), opts)
	} else {
		b = New(testenv.RabbitMQURL(t), opts)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// The Observer sees each publish (and may add headers, which every
// attempt and the dead-lettered copy keep), each copy that settles a
// delivery, and each lost connection.
func testObserver(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	var log observerLog
	b := f.observed(t, log.observer())

	var mu sync.Mutex
	var seen []any
	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, d.Headers["x-test-trace"])
		if len(seen) == 1 {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		return rabbitmw.Permanent(errBoom)
	})
	// The Observer hears of the dead-letter copy once its confirm came,
	// after the copy is in the dead-letter queue: the events are read
	// once the delivery is settled.
	deadLettered := make(chan struct{})
	closeOnce := sync.OnceFunc(func() { close(deadLettered) })
	onSettle := func(_ *amqp.Delivery, o rabbitmw.Outcome, _ error) {
		if o == rabbitmw.DeadLetter {
			closeOnce() // again if the connection's drop below loses its ack
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(ctx, f.q, h, ConsumeOptions{Topology: f.top, Workers: 1, OnSettle: onSettle})
	}()
	defer func() {
		cancel()
		require.NoError(t, <-done, "Consume")
	}()

	headers := amqp.Table{"custom": "kept"}
	require.NoError(t, b.Publish(testContext(t, 30*time.Second), "", f.q, amqp.Publishing{MessageId: "m1", Headers: headers}), "Publish")
	assert.Equal(t, 1, len(headers), "caller's headers after Publish")
	select {
	case <-deadLettered:
	case <-time.After(30 * time.Second):
		t.Fatal("m1 not dead-lettered within 30 s")
	}
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 30*time.Second, 10*time.Millisecond, "no dead-letter")
	dead := f.onlyDeadLetter()
	assert.Equal(t, "trace-of-m1", dead.Headers["x-test-trace"], "dead-letter's x-test-trace")

	mu.Lock()
	assert.Equal(t, []any{"trace-of-m1", "trace-of-m1"}, seen, "x-test-trace of each attempt")
	mu.Unlock()
	log.mu.Lock()
	assert.Equal(t, []error{nil}, log.published, "publish results")
	assert.Equal(t, []RepublishEvent{
		{Outcome: rabbitmw.Delay, Queue: f.q, To: f.q + ".delay.50ms", Delay: 50 * time.Millisecond},
		{Outcome: rabbitmw.DeadLetter, Queue: f.q, To: f.q + ".dlq", ErrorType: "error"},
	}, log.republish, "republish events")
	log.mu.Unlock()

	f.be.drop(t, f.mem, f.process)
	require.Eventually(t, func() bool {
		log.mu.Lock()
		defer log.mu.Unlock()
		for _, e := range log.reconnects {
			if e.Queue == f.q && errors.Is(e.Err, ErrConnectionLost) {
				return true
			}
		}
		return false
	}, 30*time.Second, 10*time.Millisecond, "no reconnect event")
}
