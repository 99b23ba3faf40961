package broker

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

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
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Consume(ctx, f.q, h, ConsumeOptions{Topology: f.top, Workers: 1}) }()
	defer func() {
		cancel()
		noErr(t, "Consume", <-done)
	}()

	headers := amqp.Table{"custom": "kept"}
	noErr(t, "Publish", b.Publish(testContext(t, 30*time.Second), "", f.q, amqp.Publishing{MessageId: "m1", Headers: headers}))
	equal(t, "caller's headers after Publish", len(headers), 1)
	eventually(t, 30*time.Second, "no dead-letter", func() bool { return f.length(f.q+".dlq") == 1 })
	dead := f.onlyDeadLetter()
	equal(t, "dead-letter's x-test-trace", dead.Headers["x-test-trace"], "trace-of-m1")

	mu.Lock()
	equal(t, "x-test-trace of each attempt", seen, []any{"trace-of-m1", "trace-of-m1"})
	mu.Unlock()
	log.mu.Lock()
	equal(t, "publish results", log.published, []error{nil})
	equal(t, "republish events", log.republish, []RepublishEvent{
		{Outcome: rabbitmw.Delay, Queue: f.q, To: f.q + ".delay.50ms", Delay: 50 * time.Millisecond},
		{Outcome: rabbitmw.DeadLetter, Queue: f.q, To: f.q + ".dlq", ErrorType: "error"},
	})
	log.mu.Unlock()

	f.be.drop(t, f.mem, f.process)
	eventually(t, 30*time.Second, "no reconnect event", func() bool {
		log.mu.Lock()
		defer log.mu.Unlock()
		for _, e := range log.reconnects {
			if e.Queue == f.q && errors.Is(e.Err, ErrConnectionLost) {
				return true
			}
		}
		return false
	})
}
