package deadletter

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw/broker"
)

// A replay takes the route and expiration of a message that RabbitMQ
// dead-lettered from the x-death record of its first dead-lettering, and
// leaves alone what the broker recorded and what is malformed.
func TestReplayHeadersFirstRoute(t *testing.T) {
	record := func(queue, reason, exchange string, keys []any, exp any) amqp.Table {
		r := amqp.Table{"queue": queue, "reason": reason, "exchange": exchange, "count": int64(1), "routing-keys": keys}
		if exp != nil {
			r["original-expiration"] = exp
		}
		return r
	}
	first := amqp.Table{"x-first-death-queue": "orders", "x-first-death-reason": "expired"}
	with := func(h amqp.Table, more amqp.Table) amqp.Table {
		out := amqp.Table{}
		for _, t := range []amqp.Table{first, h, more} {
			for k, v := range t {
				out[k] = v
			}
		}
		return out
	}
	type route struct{ Exchange, Key, Expiration any }
	cases := []struct {
		name string
		h    amqp.Table
		want route
	}{
		{"the first death's record", with(amqp.Table{"x-death": []any{
			record("orders.delay.1s", "expired", "", []any{"orders.delay.1s"}, nil),
			record("orders", "expired", "events", []any{"order.cancelled", "cc"}, "1500"),
		}}, nil), route{"events", "order.cancelled", "1500"}},
		{"recorded by the broker", with(amqp.Table{"x-death": []any{
			record("orders", "expired", "events", []any{"order.cancelled"}, "1500"),
		}}, amqp.Table{broker.HeaderOriginalExchange: "other", broker.HeaderOriginalRoutingKey: "k", broker.HeaderOriginalExpiration: "9"}),
			route{"other", "k", "9"}},
		{"an empty routing key, as to a fanout exchange", with(amqp.Table{"x-death": []any{
			record("orders", "rejected", "events", []any{""}, nil),
		}}, amqp.Table{"x-first-death-reason": "rejected"}), route{"events", "", nil}},
		{"no routing key", with(amqp.Table{"x-death": []any{
			record("orders", "expired", "events", []any{}, nil),
		}}, nil), route{}},
		{"malformed record", with(amqp.Table{"x-death": []any{"legacy", amqp.Table{"queue": "orders", "reason": "expired", "exchange": int32(1), "routing-keys": "k"}}}, nil), route{}},
		{"malformed x-death", with(amqp.Table{"x-death": "nope"}, nil), route{}},
		{"no x-death", amqp.Table{}, route{}},
	}
	for _, c := range cases {
		h := replayHeaders(c.h, "orders.dlq", time.Unix(0, 0), 5)
		assert.Equal(t, c.want, route{h[broker.HeaderOriginalExchange], h[broker.HeaderOriginalRoutingKey], h[broker.HeaderOriginalExpiration]}, c.name)
	}
}
