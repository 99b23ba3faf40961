package middleware

import (
	"crypto/md5"
	"encoding/hex"
	"errors"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrNoKey is returned by [Key] for a delivery that has neither a message id
// nor a body, and so nothing to tell it from any other such delivery.
var ErrNoKey = errors.New("middleware: delivery has no message id and an empty body")

// Key returns the idempotency key of d: its message_id property or, when
// that is empty, the hex MD5 digest of its body. It is the key that
// hand-written Redis consumers commonly use, so a fleet of them and
// consumers built on this package agree on what a duplicate is.
//
// A delivery with no message id and an empty body has no key: Key returns
// ErrNoKey rather than giving every such delivery the digest of nothing,
// which would make all but the first of them look like duplicates and drop
// them. Dedup dead-letters such a delivery with that reason.
//
// Publishers should set message_id: two different messages with the same
// body and no id share a key, and only the first is processed.
func Key(d *amqp.Delivery) (string, error) {
	if d.MessageId != "" {
		return d.MessageId, nil
	}
	if len(d.Body) == 0 {
		return "", ErrNoKey
	}
	sum := md5.Sum(d.Body)
	return hex.EncodeToString(sum[:]), nil
}
