package brokertest

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// A memExchange is an exchange other than the default one. Its fields are
// guarded by Server.mu.
type memExchange struct {
	spec     transport.ExchangeSpec // as declared (Passive unset)
	bindings []memBinding
}

// A memBinding binds queue to an exchange.
type memBinding struct {
	queue *memQueue
	key   string
	args  amqp.Table
}

func exchangeRefusal(name string, code int, reason string) error {
	return &transport.ExchangeError{Exchange: name, Err: &amqp.Error{Code: code, Reason: reason, Server: true, Recover: true}}
}

func exchangeNotFound(name string) error {
	return exchangeRefusal(name, amqp.NotFound, "NOT_FOUND - no exchange '"+name+"' in vhost '/'")
}

// DeclareExchanges implements transport.Session.
func (c *memConn) DeclareExchanges(_ context.Context, specs []transport.ExchangeSpec) error {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return err
	}
	for _, s := range specs {
		x := m.exchanges[s.Name]
		switch {
		case s.Passive && x == nil:
			return exchangeNotFound(s.Name)
		case s.Passive:
		case x != nil:
			if err := equivalentExchange(x.spec, s); err != nil {
				return err
			}
		default:
			switch s.Kind {
			case "direct", "topic", "fanout", "headers":
			default:
				return exchangeRefusal(s.Name, amqp.CommandInvalid, "COMMAND_INVALID - invalid exchange type '"+s.Kind+"' (a brokertest server has direct, topic, fanout and headers)")
			}
			s.Args = rabbit.WireTable(s.Args)
			m.exchanges[s.Name] = &memExchange{spec: s}
		}
	}
	return nil
}

// equivalentExchange checks a declaration against the exchange's, as
// RabbitMQ does for a second one.
func equivalentExchange(cur, got transport.ExchangeSpec) error {
	arg, received, current := "", "", ""
	switch {
	case cur.Kind != got.Kind:
		arg, received, current = "type", got.Kind, cur.Kind
	case cur.Durable != got.Durable:
		arg, received, current = "durable", fmt.Sprint(got.Durable), fmt.Sprint(cur.Durable)
	case cur.AutoDelete != got.AutoDelete:
		arg, received, current = "auto_delete", fmt.Sprint(got.AutoDelete), fmt.Sprint(cur.AutoDelete)
	case cur.Internal != got.Internal:
		arg, received, current = "internal", fmt.Sprint(got.Internal), fmt.Sprint(cur.Internal)
	case !reflect.DeepEqual(cur.Args, rabbit.WireTable(got.Args)):
		arg, received, current = "arguments", fmt.Sprint(got.Args), fmt.Sprint(cur.Args)
	default:
		return nil
	}
	return exchangeRefusal(cur.Name, amqp.PreconditionFailed, "PRECONDITION_FAILED - inequivalent arg '"+arg+"' for exchange '"+cur.Name+
		"' in vhost '/': received '"+received+"' but current is '"+current+"'")
}

// bind binds q as b says. m.mu must be held.
func (m *Server) bind(q *memQueue, b transport.BindingSpec) error {
	x := m.exchanges[b.Exchange]
	if x == nil {
		return exchangeNotFound(b.Exchange)
	}
	args := rabbit.WireTable(b.Args)
	for _, old := range x.bindings {
		if old.queue == q && old.key == b.Key && reflect.DeepEqual(old.args, args) {
			return nil // binding again changes nothing
		}
	}
	x.bindings = append(x.bindings, memBinding{queue: q, key: b.Key, args: args})
	return nil
}

// unbindAll removes q's bindings. m.mu must be held.
func (m *Server) unbindAll(q *memQueue) {
	for _, x := range m.exchanges {
		kept := x.bindings[:0]
		for _, b := range x.bindings {
			if b.queue != q {
				kept = append(kept, b)
			}
		}
		clear(x.bindings[len(kept):])
		x.bindings = kept
	}
}

// targets returns the queues that a message published to exchange with
// routing key key and headers h reaches, each once, and whether the
// exchange exists. m.mu must be held.
func (m *Server) targets(exchange string, keys []string, h amqp.Table) ([]*memQueue, bool) {
	x := m.exchanges[exchange]
	if x == nil && exchange != "" {
		return nil, false
	}
	var qs []*memQueue
	add := func(q *memQueue) {
		if q != nil && !slices.Contains(qs, q) {
			qs = append(qs, q)
		}
	}
	for _, key := range keys {
		if x == nil {
			add(m.queues[key])
			continue
		}
		for _, b := range x.bindings {
			if b.matches(x.spec.Kind, key, h) {
				add(b.queue)
			}
		}
	}
	return qs, true
}

// matches reports whether b routes a message with routing key key and
// headers h, for an exchange of kind.
func (b memBinding) matches(kind, key string, h amqp.Table) bool {
	switch kind {
	case "fanout":
		return true
	case "topic":
		return topicMatch(strings.Split(b.key, "."), strings.Split(key, "."))
	case "headers":
		return headersMatch(b.args, h)
	}
	return b.key == key
}

// topicMatch matches the words of a routing key against those of a
// binding's pattern: "*" is one word, "#" zero or more.
func topicMatch(pattern, words []string) bool {
	if len(pattern) == 0 {
		return len(words) == 0
	}
	if pattern[0] == "#" {
		for i := 0; i <= len(words); i++ {
			if topicMatch(pattern[1:], words[i:]) {
				return true
			}
		}
		return false
	}
	if len(words) == 0 || (pattern[0] != "*" && pattern[0] != words[0]) {
		return false
	}
	return topicMatch(pattern[1:], words[1:])
}

// headersMatch matches a message's headers against a headers binding's
// arguments: all of them, or any with x-match "any". Arguments whose name
// starts with "x-" are not matched; an argument without a value (nil)
// matches a header of that name whatever its value.
func headersMatch(args, h amqp.Table) bool {
	anyOf := args["x-match"] == "any"
	matched, total := 0, 0
	for k, want := range args {
		if strings.HasPrefix(k, "x-") {
			continue
		}
		total++
		got, ok := h[k]
		if ok && (want == nil || reflect.DeepEqual(want, got)) {
			matched++
		}
	}
	if anyOf {
		return matched > 0
	}
	return matched == total
}
