package otelmw

import (
	amqp "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
)

// A HeaderCarrier is a [propagation.TextMapCarrier] over the headers of
// an AMQP message, for extracting a trace context from an amqp.Delivery
// and injecting one into an amqp.Publishing. Get reads a header whose
// value is a string or a []byte (some clients send header values as
// bytes); Set writes a string. A nil HeaderCarrier reads as empty; Set on
// one panics.
type HeaderCarrier amqp.Table

var _ propagation.TextMapCarrier = HeaderCarrier(nil)

// Get returns the value of the header key, or "" if it is absent or is
// neither a string nor a []byte.
func (c HeaderCarrier) Get(key string) string {
	switch v := c[key].(type) {
	case string:
		return v
	case []byte:
		return string(v)
	}
	return ""
}

// Set sets the header key to value.
func (c HeaderCarrier) Set(key, value string) { c[key] = value }

// Keys returns the names of the headers.
func (c HeaderCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}
