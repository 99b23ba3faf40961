package brokertest

import (
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
)

func TestTopicMatch(t *testing.T) {
	cases := []struct {
		pattern, key string
		want         bool
	}{
		{"order.*", "order.created", true},
		{"order.*", "order", false},
		{"order.*", "order.created.eu", false},
		{"order.#", "order", true},
		{"order.#", "order.created.eu", true},
		{"#", "", true},
		{"#", "a.b.c", true},
		{"*.created", "order.created", true},
		{"*.created", "created", false},
		{"#.eu", "order.created.eu", true},
		{"#.eu", "eu", true},
		{"order.#.eu", "order.eu", true},
		{"order.#.eu", "order.x.y.eu", true},
		{"order.#.eu", "order.x.y.us", false},
		{"order.created", "order.created", true},
		{"order.created", "order.Created", false},
		{"", "", true},
		{"", "a", false},
	}
	for _, c := range cases {
		got := topicMatch(strings.Split(c.pattern, "."), strings.Split(c.key, "."))
		if got != c.want {
			t.Errorf("topicMatch(%q, %q) = %v; want %v", c.pattern, c.key, got, c.want)
		}
	}
}

func TestHeadersMatch(t *testing.T) {
	cases := []struct {
		name    string
		args, h amqp.Table
		want    bool
	}{
		{"all match", amqp.Table{"a": "1", "b": int32(2)}, amqp.Table{"a": "1", "b": int32(2), "c": "x"}, true},
		{"all, one differs", amqp.Table{"a": "1", "b": int32(2)}, amqp.Table{"a": "1", "b": int32(3)}, false},
		{"all, one missing", amqp.Table{"x-match": "all", "a": "1", "b": "2"}, amqp.Table{"a": "1"}, false},
		{"any, one matches", amqp.Table{"x-match": "any", "a": "1", "b": "2"}, amqp.Table{"b": "2"}, true},
		{"any, none", amqp.Table{"x-match": "any", "a": "1"}, amqp.Table{"a": "2"}, false},
		{"no value: present", amqp.Table{"a": nil}, amqp.Table{"a": "anything"}, true},
		{"x- arguments are not matched", amqp.Table{"x-match": "all", "x-other": "1"}, amqp.Table{}, true},
	}
	for _, c := range cases {
		assert.Equal(t, c.want, headersMatch(c.args, c.h), c.name)
	}
}
