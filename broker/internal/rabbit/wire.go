// Package rabbit holds what RabbitMQ 3.10 does to a message's headers:
// the conversions of their values on the wire (WireTable), and the records
// it adds when it dead-letters the message (AddDeath, DeadLetterCycle).
// The in-memory server of package brokertest applies them, and the tests
// of package broker check against them.
package rabbit

import (
	"bytes"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// WireTable deep-copies t, converting values as the wire does.
func WireTable(t amqp.Table) amqp.Table {
	if t == nil {
		return nil
	}
	c := make(amqp.Table, len(t))
	for k, v := range t {
		c[k] = wireValue(v)
	}
	return c
}

func wireValue(v any) any {
	switch x := v.(type) {
	case amqp.Table:
		return WireTable(x)
	case []any:
		c := make([]any, len(x))
		for i, e := range x {
			c[i] = wireValue(e)
		}
		return c
	case []byte:
		return bytes.Clone(x)
	case int:
		return int32(x) // amqp091 sends an int as a 32-bit integer
	case time.Time:
		return time.Unix(x.Unix(), 0)
	}
	return v
}
