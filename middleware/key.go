package middleware

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// ErrNoKey is returned by [Key] for a delivery that has neither a message id
// nor a body, and so nothing to tell it from any other such delivery.
var ErrNoKey error = &sentinel{"middleware: delivery has no message id and an empty body", "no_key"}

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

// ErrKeyMismatch is wrapped by the error with which a [Keys] layer
// dead-letters a delivery whose key, made with its Keying, is not the key
// that a layer above it made (a Retry or Dedup that made the default key,
// or another Keys layer): the Keys layer stands beneath the layer that
// names the message, where it cannot.
var ErrKeyMismatch error = &sentinel{"middleware: keyed layers disagree on a message's key", "key_mismatch"}

// Keying is how a message is named in the store: by Key, under Namespace.
// The zero value means [Key], with no namespace. It is set in one place,
// a [Keys] layer (or StackOptions.Keying, which puts one in the stack),
// where [Retry] and [Dedup] both read it.
type Keying struct {
	// Key returns a delivery's key. Default: [Key] (message_id, else the
	// MD5 of the body). When Key returns an error, Dedup dead-letters the
	// delivery with the error as the reason, and Retry counts its failures
	// by its attempts header alone.
	Key func(*amqp.Delivery) (string, error)
	// Namespace, when set, is prepended to every key (as
	// "namespace:key"), so that services sharing one store do not see
	// each other's keys.
	Namespace string
}

// Keys returns a layer that names each delivery's message by k for the
// [Retry] and [Dedup] layers beneath it (through any layers between):
// they count its failures and claim it under that one key. Without a Keys
// layer above them, they name a message by [Key], with no namespace, and
// the outermost of them hands its key to the others.
//
// Put it above the outermost of Retry and Dedup ([Stack] does, with
// StackOptions.Keying). Beneath one of them, it finds the message already
// named: if it would name it otherwise, it returns an error wrapping
// ErrKeyMismatch, with both keys, inside rabbitmw.Permanent, and the
// message is dead-lettered with that reason at once rather than have its
// failures counted under one key and its claim taken under another.
func Keys(k Keying) rabbitmw.Middleware {
	kg := newKeying(k, "Keys")
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			if d == nil {
				return next.Handle(ctx, d)
			}
			if ctx == nil {
				ctx = context.Background()
			}
			down, err := kg.handDown(ctx, d)
			if err != nil {
				return rabbitmw.Permanent(err)
			}
			return handleKeyed(next, ctx, d, down)
		})
	}
}

// keying is a layer's Keying, with its default.
type keying struct {
	key       func(*amqp.Delivery) (string, error)
	namespace string
	set       bool   // a Keying was given (a Keys layer)
	layer     string // "Keys", "Retry" or "Dedup", for ErrKeyMismatch
}

func newKeying(k Keying, layer string) *keying {
	kg := &keying{key: k.Key, namespace: k.Namespace, set: k.Key != nil || k.Namespace != "", layer: layer}
	if kg.key == nil {
		kg.key = Key
	}
	return kg
}

// make returns the store key of d by k alone.
func (k *keying) make(d *amqp.Delivery) (string, error) {
	key, err := k.key(d)
	if err != nil {
		return "", err
	}
	if key == "" {
		return "", ErrNoKey
	}
	if k.namespace != "" {
		key = k.namespace + ":" + key
	}
	return key, nil
}

// of returns the store key of d: the one that a keyed layer above made
// for d, if there is one, else k's own. If k is a Keys layer's and
// makes another key than the layer above, the error wraps ErrKeyMismatch.
func (k *keying) of(ctx context.Context, d *amqp.Delivery) (string, error) {
	key, _, err := k.resolve(ctx, d, keyed{})
	return key, err
}

// resolve is [keying.of] for a layer that may have been handed the key
// above made as an argument (see [keyedHandler]); above.by is nil if not.
// It also returns the key that the layer hands down to the layers beneath
// (down.by is nil if they find it in ctx already).
func (k *keying) resolve(ctx context.Context, d *amqp.Delivery, above keyed) (key string, down keyed, err error) {
	c := above
	if above.by == nil {
		var ok bool
		if c, ok = keyedFrom(ctx, d); !ok {
			down = k.made(d)
			return down.key, down, down.err
		}
	}
	if err := k.check(&c, d); err != nil {
		return "", keyed{}, err
	}
	return c.key, above, c.err
}

// handDown returns the key that a layer hands down for d to the layers
// beneath it: its own, or none (by is nil) if a layer above made one, in
// ctx, or an error wrapping ErrKeyMismatch if that key is not k's.
func (k *keying) handDown(ctx context.Context, d *amqp.Delivery) (keyed, error) {
	if c, ok := keyedFrom(ctx, d); ok {
		return keyed{}, k.check(&c, d)
	}
	return k.made(d), nil
}

// made returns the key that k makes for d.
func (k *keying) made(d *amqp.Delivery) keyed {
	key, err := k.make(d)
	return keyed{d: d, by: k, key: key, err: err}
}

// check returns an error wrapping ErrKeyMismatch if k is a Keying of its
// own, other than the one that made c, and makes another key for d.
func (k *keying) check(c *keyed, d *amqp.Delivery) error {
	if !k.set || c.by == k {
		return nil
	}
	key, err := k.make(d)
	if (err == nil) == (c.err == nil) && key == c.key {
		return nil
	}
	return fmt.Errorf("%w: %s makes %s; the %s above it made %s", ErrKeyMismatch, k.layer, describeKey(key, err), c.by.layer, describeKey(c.key, c.err))
}

func describeKey(key string, err error) string {
	if err != nil {
		return "no key (" + text.Error(err) + ")"
	}
	return text.QuoteKey(key)
}

// keyed is the key that a keyed layer made for d, and hands to the layers
// beneath it.
type keyed struct {
	d   *amqp.Delivery
	by  *keying // nil: no key
	key string
	err error
}

// keyedKey is the context key of a *keyed.
type keyedKey struct{}

// keyedContext is a context that carries a key: one allocation for both.
type keyedContext struct {
	context.Context
	keyed keyed
}

func (c *keyedContext) Value(key any) any {
	if key == (keyedKey{}) {
		return &c.keyed
	}
	return c.Context.Value(key)
}

// keyedFrom returns the key that a layer above made for d and handed down
// in ctx, and false if there is none. A key made for another delivery (by
// a handler that runs a chain of its own for another message, in its
// context) is not d's. ctx answers the key of keyedKey with a *keyed, or
// with the *claimContext of a Dedup, which keeps the key it hands down in
// its claim rather than in a keyed of its own.
func keyedFrom(ctx context.Context, d *amqp.Delivery) (keyed, bool) {
	var c keyed
	switch v := ctx.Value(keyedKey{}).(type) {
	case *keyed:
		c = *v
	case *claimContext:
		c = v.handedDown()
	default:
		return keyed{}, false
	}
	return c, c.d == d
}

// A keyedHandler takes the key that a layer above made for d as an
// argument. It saves the layer above the allocation of a context to hand
// the key down in, on the recommended stack, where Recover stands between
// Retry and Dedup: both take it.
type keyedHandler interface {
	handleKeyed(ctx context.Context, d *amqp.Delivery, k keyed) error
}

// handleKeyed calls next for d, handing it k: as an argument if next takes
// one, else in its context. With no k (k.by nil), it calls next.Handle.
func handleKeyed(next rabbitmw.Handler, ctx context.Context, d *amqp.Delivery, k keyed) error {
	if k.by == nil {
		return next.Handle(ctx, d)
	}
	if kh, ok := next.(keyedHandler); ok {
		return kh.handleKeyed(ctx, d, k)
	}
	return next.Handle(&keyedContext{Context: ctx, keyed: k}, d)
}
