package rabbitmw

import (
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/internal/header"
)

// HeaderAttempts names the message header that carries the number of failed
// attempts of a message when the broker package republishes it (to a delay
// queue or to the dead-letter queue). [middleware.Retry] reads it as a floor
// for its own count, so the limit holds even when the store that counts
// attempts was wiped or cannot be reached.
const HeaderAttempts = "x-rabbitmw-attempts"

// maxAttempts bounds what PriorAttempts reports, so a corrupt header cannot
// overflow arithmetic downstream.
const maxAttempts = 1 << 30

// PriorAttempts returns the number of failed attempts recorded in d's
// [HeaderAttempts] header: 0 when d is nil, the header is absent, or its
// value is not a whole number. Any AMQP integer or float type is accepted,
// and so is a decimal string (a header set by hand); negative values read as
// 0 and values above 2^30 as 2^30.
//
// The header counts failures that a layer such as Retry recorded; it does
// not count redeliveries after a crash or a lost connection, which is why
// x-delivery-count (set by quorum queues) is not read here.
func PriorAttempts(d *amqp.Delivery) int {
	if d == nil {
		return 0
	}
	v, ok := d.Headers[HeaderAttempts]
	if !ok {
		return 0
	}
	return attemptsValue(v)
}

// attemptsValue converts a header value of any AMQP type to a count.
func attemptsValue(v any) int {
	n, ok := header.Int(v)
	switch {
	case !ok, n < 0:
		return 0
	case n > maxAttempts:
		return maxAttempts
	}
	return int(n)
}
