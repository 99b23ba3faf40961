package rabbitmwtest_test

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
)

// Settlement reports what a channel did with a delivery in the words of
// rabbitmw.Outcome, so far as a channel can tell them apart.
func TestSettlement(t *testing.T) {
	tests := []struct {
		name   string
		settle func(d *amqp.Delivery)
		want   string
	}{
		{"none", func(*amqp.Delivery) {}, "unsettled"},
		{"ack", func(d *amqp.Delivery) { d.Ack(false) }, "acked"},
		{"nack with requeue", func(d *amqp.Delivery) { d.Nack(false, true) }, "requeued"},
		{"reject with requeue", func(d *amqp.Delivery) { d.Reject(true) }, "requeued"},
		{"reject without requeue", func(d *amqp.Delivery) { d.Reject(false) }, "dead-lettered"},
		{"nack without requeue", func(d *amqp.Delivery) { d.Nack(false, false) }, "dead-lettered"},
		{"twice", func(d *amqp.Delivery) { d.Ack(false); d.Reject(false) }, "settled 2 times"},
	}
	for _, tt := range tests {
		rec := rabbitmwtest.NewRecorder()
		rec.Deliver(amqp.Publishing{}) // another delivery, whose calls must not count
		d := rec.Deliver(amqp.Publishing{})
		tt.settle(d)
		if got := rec.Settlement(d.DeliveryTag); got != tt.want {
			t.Errorf("%s: Settlement(%d) = %q; want %q", tt.name, d.DeliveryTag, got, tt.want)
		}
	}
}

func TestCallString(t *testing.T) {
	for _, tt := range []struct {
		c    rabbitmwtest.Call
		want string
	}{
		{rabbitmwtest.Call{Method: "ack", Tag: 1}, "ack(tag=1)"},
		{rabbitmwtest.Call{Method: "nack", Tag: 3, Requeue: true}, "nack(tag=3, requeue=true)"},
		{rabbitmwtest.Call{Method: "reject", Tag: 2}, "reject(tag=2, requeue=false)"},
	} {
		if got := tt.c.String(); got != tt.want {
			t.Errorf("%#v.String() = %q; want %q", tt.c, got, tt.want)
		}
	}
}
