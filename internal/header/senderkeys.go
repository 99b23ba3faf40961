package header

import "fmt"

// senderKeys are the headers by whose strings RabbitMQ routes a message
// besides its routing key (sender-selected distribution).
var senderKeys = [...]string{"CC", "BCC"}

// CheckSenderKeys returns why a CC or BCC header of h, a message's
// headers (an amqp.Table), would not route the message as written, or
// nil. RabbitMQ takes an array of strings: it refuses a header of another
// type by closing the channel (failing the publishes in flight on it),
// and skips an element that is not a string, so that the message misses
// a queue without a word. A message's own publisher, and the outbox that
// stores it for one, refuse both before anything is sent or written.
func CheckSenderKeys(h map[string]any) error {
	for _, name := range senderKeys {
		v, ok := h[name]
		if !ok {
			continue
		}
		keys, ok := v.([]any)
		if !ok {
			return fmt.Errorf("%q is %s, not an array of strings ([]any of string), which RabbitMQ refuses by closing the channel", name, typeOf(v))
		}
		for i, k := range keys {
			if _, ok := k.(string); !ok {
				return fmt.Errorf("%q[%d] is %s, not a string: RabbitMQ would skip it, and route the message by the other keys alone", name, i, typeOf(k))
			}
		}
	}
	return nil
}

// typeOf names the Go type of a header value, for an error.
func typeOf(v any) string {
	if v == nil {
		return "nil"
	}
	return fmt.Sprintf("a %T", v)
}
