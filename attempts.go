package rabbitmw

import (
	"math"
	"strconv"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"
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
	var n int64
	switch x := v.(type) {
	case int:
		n = int64(x)
	case int8:
		n = int64(x)
	case int16:
		n = int64(x)
	case int32:
		n = int64(x)
	case int64:
		n = x
	case uint8:
		n = int64(x)
	case uint16:
		n = int64(x)
	case uint32:
		n = int64(x)
	case uint64:
		if x > maxAttempts {
			return maxAttempts
		}
		n = int64(x)
	case float32:
		return floatAttempts(float64(x))
	case float64:
		return floatAttempts(x)
	case string:
		p, err := strconv.ParseInt(strings.TrimSpace(x), 10, 64)
		if err != nil {
			return 0
		}
		n = p
	case []byte:
		return attemptsValue(string(x))
	default:
		return 0
	}
	switch {
	case n < 0:
		return 0
	case n > maxAttempts:
		return maxAttempts
	}
	return int(n)
}

func floatAttempts(f float64) int {
	switch {
	case math.IsNaN(f), f < 0, f != math.Trunc(f):
		return 0
	case f > maxAttempts:
		return maxAttempts
	}
	return int(f)
}
