// Package header reads values of AMQP message headers, whose Go type
// depends on who set them and how they crossed the wire.
package header

import (
	"math"
	"strconv"
	"strings"
)

// Integer returns v as an int64 if it holds one of the Go integer types
// that an AMQP table decodes to (uint64 above the int64 range is clamped),
// and reports false for anything else: floats and strings included. It is
// how RabbitMQ reads integer arguments such as x-message-ttl.
func Integer(v any) (int64, bool) {
	switch x := v.(type) {
	case int:
		return int64(x), true
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	case uint64:
		if x > math.MaxInt64 {
			return math.MaxInt64, true
		}
		return int64(x), true
	}
	return 0, false
}

// Int returns v as a whole number, if it is one: what [Integer] accepts, a
// float with no fractional part (clamped to the int64 range), or a decimal
// string or byte slice (a header set by hand). It reports false for
// anything else.
func Int(v any) (int64, bool) {
	if n, ok := Integer(v); ok {
		return n, true
	}
	switch x := v.(type) {
	case float32:
		return float(float64(x))
	case float64:
		return float(x)
	case string:
		n, err := strconv.ParseInt(strings.TrimSpace(x), 10, 64)
		return n, err == nil
	case []byte:
		return Int(string(x))
	}
	return 0, false
}

func float(f float64) (int64, bool) {
	switch {
	case math.IsNaN(f), f != math.Trunc(f):
		return 0, false
	case f >= math.MaxInt64:
		return math.MaxInt64, true
	case f <= math.MinInt64:
		return math.MinInt64, true
	}
	return int64(f), true
}
