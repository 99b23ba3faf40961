// Package deliverytest hands deliveries to handlers and layers in the
// module's tests, without a broker: each delivery settles on a
// [rabbitmwtest.Recorder], by [rabbitmw.Settle], and a Delay settles at
// once rather than after its delay, whose length the test reads with
// [rabbitmw.Decide].
package deliverytest

import (
	"context"
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
)

// New returns a delivery of a message with the given id and body, and the
// Recorder it settles on.
func New(id, body string) (*amqp.Delivery, *rabbitmwtest.Recorder) {
	rec := rabbitmwtest.NewRecorder()
	return rec.Deliver(amqp.Publishing{MessageId: id, Body: []byte(body)}), rec
}

// Settle settles d, delivered by rec, as err decides, and returns how rec
// saw it settled ("acked", "requeued", "dead-lettered"). A Delay is
// requeued at once. It fails t if Settle fails.
func Settle(t testing.TB, d *amqp.Delivery, rec *rabbitmwtest.Recorder, err error) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // Settle requeues a Delay at once on a done context
	if serr := rabbitmw.Settle(ctx, d, err); serr != nil && !errors.Is(serr, context.Canceled) {
		t.Fatalf("Settle: %v", serr)
	}
	return rec.Settlement(d.DeliveryTag)
}

// A Result is how one delivery ended.
type Result struct {
	Settled  string            // as the Recorder saw it: see Settle
	Decision rabbitmw.Decision // Decide of the handler's result
}

// Run hands h a delivery of msg, marked redelivered or not, settles it as
// Settle does, and returns the result.
func Run(t testing.TB, h rabbitmw.Handler, msg amqp.Publishing, redelivered bool) Result {
	t.Helper()
	rec := rabbitmwtest.NewRecorder()
	d := rec.Deliver(msg)
	d.Redelivered = redelivered
	err := h.Handle(context.Background(), d)
	return Result{Settled: Settle(t, d, rec, err), Decision: rabbitmw.Decide(err)}
}
