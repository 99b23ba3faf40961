package rabbitmw

import (
	"context"
	"strconv"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A Handler processes one delivery.
//
// Handle is called with the delivery's context and the delivery itself; it
// returns nil when the message was processed, or an error saying why not.
// The error decides what happens to the message, by the one settlement
// contract of this package (see [Decide]):
//
//   - nil: the message is acknowledged;
//   - an error that wraps [ErrDuplicate]: the message was already processed,
//     and it is acknowledged;
//   - an error made by [Permanent]: retrying cannot help, and the message is
//     dead-lettered at once;
//   - an error made by [RetryAfter]: the message is requeued, to be delivered
//     again no sooner than the given delay;
//   - any other error: the message is requeued for another attempt.
//
// The marks of [WithAttempts] and [NotCounted] change none of this. This
// list is the contract; the broker package's documentation and
// [Settler] say what each outcome does on the wire.
//
// A Handler never calls Ack, Nack or Reject on the delivery: the code that
// owns the channel settles it, once, from the returned error (the broker
// package, or a [Settler] for a plain amqp091 channel). A Handler may read
// the delivery but must not modify it, nor keep it after Handle returns.
//
// Handle must honour the cancellation of ctx: when ctx is done the work
// should stop and Handle return. A client that reads only ctx's deadline
// and not its cancellation (go-redis v9: a blocking command ends at ctx's
// deadline with ContextTimeoutEnabled, else at its own timeout) does not
// stop when a lost lease cancels ctx: give such a call a deadline of its
// own, below the lease. A Handler may be called concurrently from several
// goroutines, with different deliveries.
//
// If Handle panics, the panic is the caller's: the [middleware.Recover]
// layer turns it into an error that counts as a failed attempt, and the
// broker package turns a panic that escapes the whole chain into a
// dead-lettered message. Without either, a panic propagates like any other.
type Handler interface {
	Handle(ctx context.Context, d *amqp.Delivery) error
}

// The HandlerFunc type is an adapter to allow the use of ordinary functions
// as handlers. If f is a function with the appropriate signature,
// HandlerFunc(f) is a [Handler] that calls f.
type HandlerFunc func(ctx context.Context, d *amqp.Delivery) error

// Handle calls f(ctx, d).
func (f HandlerFunc) Handle(ctx context.Context, d *amqp.Delivery) error {
	return f(ctx, d)
}

// A Middleware wraps a Handler in another: a layer that runs code before and
// after the next one, and may decide not to call it at all.
type Middleware func(Handler) Handler

// Chain composes middlewares into one. The first argument is the outermost
// layer: Chain(a, b, c)(h) is a(b(c(h))), so a delivery passes through a,
// then b, then c, and reaches h last; the result travels back in the reverse
// order. Chain with no arguments returns a Middleware that returns its
// handler unchanged. A nil Middleware in the list panics at once, when Chain
// is called, rather than at the first delivery.
func Chain(m ...Middleware) Middleware {
	for i, mw := range m {
		if mw == nil {
			panic("rabbitmw: Chain: middleware " + strconv.Itoa(i) + " is nil")
		}
	}
	layers := append([]Middleware(nil), m...)
	return func(h Handler) Handler {
		if h == nil {
			panic("rabbitmw: Chain: nil handler")
		}
		for i := len(layers) - 1; i >= 0; i-- {
			h = layers[i](h)
		}
		return h
	}
}
