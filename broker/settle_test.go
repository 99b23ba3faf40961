package broker

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw"
)

// asPublished gives a delivery back the fields that its copies changed,
// from the headers they keep them in, and leaves alone what is malformed
// or carried by the delivery itself.
func TestAsPublished(t *testing.T) {
	first := amqp.Delivery{
		Exchange: "events", RoutingKey: "order.created", UserId: "alice", Expiration: "4000",
		DeliveryMode: amqp.Transient, MessageId: "m", Headers: amqp.Table{"k": "v"},
	}
	copied := republishing(&first, delayHeaders(&first, rabbitmw.Decision{Outcome: rabbitmw.Delay}, "orders", time.Time{}))
	hop := amqp.Delivery{ // the copy, back from the delay queue
		Exchange: "", RoutingKey: "orders", Headers: copied.Headers, UserId: copied.UserId,
		Expiration: copied.Expiration, DeliveryMode: copied.DeliveryMode, MessageId: copied.MessageId,
	}
	view := func(d amqp.Delivery) []any {
		return []any{d.Exchange, d.RoutingKey, d.UserId, d.Expiration, d.DeliveryMode}
	}
	cases := []struct {
		name string
		d    amqp.Delivery
		want []any
	}{
		{"first delivery", first, view(first)},
		{"back from a delay queue", hop, view(first)},
		{"no headers", amqp.Delivery{RoutingKey: "orders", DeliveryMode: 2}, []any{"", "orders", "", "", uint8(2)}},
		{"malformed headers", amqp.Delivery{RoutingKey: "orders", DeliveryMode: 2, Headers: amqp.Table{
			HeaderOriginalExchange: []byte("events"), HeaderOriginalRoutingKey: "order.created",
			HeaderUserID: int32(1), HeaderOriginalExpiration: int64(4000), HeaderOriginalDeliveryMode: int64(7),
		}}, []any{"", "orders", "", "", uint8(2)}},
		{"another queue's copy, forwarded by a producer with its headers", amqp.Delivery{
			Exchange: "billing", RoutingKey: "invoice.paid", DeliveryMode: 2, Headers: copied.Headers,
		}, []any{"billing", "invoice.paid", "", "", uint8(2)}},
		{"properties the delivery carries", amqp.Delivery{RoutingKey: "orders", UserId: "bob", Expiration: "9", DeliveryMode: 1, Headers: amqp.Table{
			HeaderUserID: "alice", HeaderOriginalExpiration: "4000", HeaderOriginalDeliveryMode: int64(0),
		}}, []any{"", "orders", "bob", "9", uint8(1)}},
	}
	for _, c := range cases {
		d := c.d
		asPublished(&d, "orders")
		assert.Equal(t, c.want, view(d), c.name)
	}
}
