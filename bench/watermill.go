package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp "github.com/rabbitmq/amqp091-go"
)

// watermillName is Watermill's AMQP router with its Deduplicator (an
// in-process map), Retry and Recoverer, as its documentation composes them.
const watermillName = "watermill"

// watermillDedupWindow is how long its Deduplicator remembers a message,
// as rabbitmw's done marks are kept (a day).
const watermillDedupWindow = 24 * time.Hour

// watermillAckGrace is how long the Watermill contender waits, after its
// last handler returned, for the subscriber's last acks.
const watermillAckGrace = 500 * time.Millisecond

// consumeWatermill consumes queue with a Watermill router. A Watermill
// subscription handles one message at a time, so the router gets workers
// handlers on the queue, each its own consumer and channel with
// prefetch/workers (at least 1) unacked messages: prefetch in all, as for
// the other contenders. The end of each delivery is stamped when the
// router's handler returns, just before the subscriber acks it: Watermill
// acks in its own goroutine, with no hook after the ack.
func consumeWatermill(ctx context.Context, url, queue string, prefetch, workers int, cnt *counter) error {
	logger := watermill.NopLogger{}
	cfg := wamqp.NewDurableQueueConfig(url)
	cfg.Marshaler = idMarshaler{}
	cfg.TopologyBuilder = declared{} // bench declared the queue, with its dead-letter arguments
	cfg.Queue.GenerateName = func(string) string { return queue }
	cfg.Consume.Qos.PrefetchCount = max(1, prefetch/workers)
	sub, err := wamqp.NewSubscriber(cfg, logger)
	if err != nil {
		return err
	}
	defer sub.Close()
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, logger)
	if err != nil {
		return err
	}
	repo, err := middleware.NewMapExpiringKeyRepository(watermillDedupWindow)
	if err != nil {
		return err
	}
	dedup := &middleware.Deduplicator{
		KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil },
		Repository: repo,
	}
	retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Second, Multiplier: 2}
	router.AddMiddleware(countWatermill(cnt), retry.Middleware, middleware.Recoverer, dedup.Middleware)
	for i := range workers {
		router.AddConsumerHandler(fmt.Sprintf("bench-%d", i), queue, sub, func(m *message.Message) error {
			cnt.effect(m.UUID)
			return nil
		})
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- router.Run(rctx) }()
	select {
	case <-cnt.done:
		// The subscriber acks a message after its handler returned, in its
		// own goroutine, with no hook to wait for: give the last acks time
		// to be sent before the router closes the channel, which would
		// otherwise return their messages to the queue. The run's time
		// and CPU were taken at the count already.
		time.Sleep(watermillAckGrace)
	case <-ctx.Done():
	case err := <-errc:
		if err == nil {
			err = errors.New("the router stopped before every message was settled")
		}
		return err
	}
	router.Close()
	<-errc
	return ctx.Err()
}

// countWatermill is the outermost middleware: it counts each message
// handled without an error, which the subscriber then acks.
func countWatermill(cnt *counter) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			if err == nil {
				cnt.ackedAt(m.UUID)
				cnt.ack(1)
			}
			return out, err
		}
	}
}

// idMarshaler makes a Watermill message of a delivery, keyed by its AMQP
// message id, as bench publishes it (Watermill's own marshaler reads the
// id from a header of its own).
type idMarshaler struct{}

func (idMarshaler) Marshal(m *message.Message) (amqp.Publishing, error) {
	return amqp.Publishing{MessageId: m.UUID, Body: m.Payload, DeliveryMode: amqp.Persistent}, nil
}

func (idMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	m := message.NewMessage(d.MessageId, d.Body)
	if d.Redelivered {
		m.Metadata.Set(wamqp.MetadataRedeliveredKey, "true")
	}
	return m, nil
}

// declared is a TopologyBuilder for a queue that exists already.
type declared struct{}

func (declared) BuildTopology(*amqp.Channel, wamqp.BuildTopologyParams, wamqp.Config, watermill.LoggerAdapter) error {
	return nil
}

func (declared) ExchangeDeclare(*amqp.Channel, string, wamqp.Config) error { return nil }
