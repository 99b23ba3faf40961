package rabbitmwtest_test

import (
	"context"
	"errors"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
)

// A Recorder shows how a handler's result settles its delivery, without a
// broker.
func ExampleRecorder() {
	h := rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		if len(d.Body) == 0 {
			return rabbitmw.Permanent(errors.New("empty order"))
		}
		return nil
	})
	rec := rabbitmwtest.NewRecorder()
	for _, body := range []string{`{"id":1}`, ``} {
		d := rec.Deliver(amqp.Publishing{Body: []byte(body)})
		rabbitmw.Settle(context.Background(), d, h.Handle(context.Background(), d))
		fmt.Println(rec.Settlement(d.DeliveryTag))
	}
	fmt.Println(rec.Calls())
	// Output:
	// acked
	// dead-lettered
	// [ack(tag=1) reject(tag=2, requeue=false)]
}
