// Package expiration checks a message's Expiration property (its TTL)
// as RabbitMQ reads it. RabbitMQ refuses a publish whose Expiration it
// cannot read by closing the channel, which fails the publishes in
// flight beside it: such a message must be refused before it is sent.
package expiration

import (
	"fmt"
	"strconv"
	"strings"
)

// Max is the longest Expiration RabbitMQ takes: ten years, in
// milliseconds.
const Max = 315360000000

// Check returns why RabbitMQ would refuse a publish whose Expiration is
// s, or nil if it takes it. RabbitMQ reads a whole number of milliseconds
// in decimal, with an optional sign, and refuses it if it is negative or
// over Max. The empty string is no expiration.
func Check(s string) error {
	if s == "" {
		return nil
	}
	d, negative := s, false
	if d[0] == '+' || d[0] == '-' {
		d, negative = d[1:], d[0] == '-'
	}
	if d == "" || strings.Trim(d, "0123456789") != "" {
		return fmt.Errorf("Expiration %q is not a whole number of milliseconds, which RabbitMQ requires", s)
	}
	n, err := strconv.ParseUint(d, 10, 64)
	switch {
	case err != nil || n > Max:
		return fmt.Errorf("Expiration %q is over RabbitMQ's limit of %d milliseconds (ten years)", s, uint64(Max))
	case negative && n > 0:
		return fmt.Errorf("Expiration %q is negative", s)
	}
	return nil
}
