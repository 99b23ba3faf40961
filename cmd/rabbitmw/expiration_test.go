package main

import (
	"context"
	"regexp"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
)

// dlq show prints the per-message TTL a dead letter was published with,
// which the dead-letter queue does not apply: from the broker's header, or
// from the x-death record of a message the server dead-lettered.
func TestDLQShowOriginalExpiration(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	pub := func(id string, h amqp.Table) {
		require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: id, Body: []byte(id), Headers: h}))
	}
	pub("ours", amqp.Table{broker.HeaderOriginalQueue: q, broker.HeaderOriginalExpiration: "4000"})
	pub("server", amqp.Table{"x-death": []any{amqp.Table{
		"queue": q, "reason": "expired", "count": int64(1), "original-expiration": "1500",
	}}})
	pub("none", amqp.Table{broker.HeaderOriginalQueue: q})
	cases := []struct {
		id   string
		want string // "" for no such line
	}{
		{"ours", "4000 ms"},
		{"server", "1500 ms"},
		{"none", ""},
	}
	line := regexp.MustCompile(`(?m)^original expiration\s+(.*)$`)
	for _, c := range cases {
		out, stderr, code := cli(t, url, nil, "dlq", "show", "-q", q, c.id)
		expectCode(t, "dlq show "+c.id, code, exitOK, stderr)
		m := line.FindStringSubmatch(out)
		if c.want == "" {
			assert.Nil(t, m, "dlq show %s:\n%s", c.id, out)
			continue
		}
		if assert.NotNil(t, m, "dlq show %s lacks the original expiration:\n%s", c.id, out) {
			assert.Contains(t, m[1], c.want, c.id)
		}
	}
}
