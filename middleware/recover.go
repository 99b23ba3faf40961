package middleware

import (
	"context"
	"runtime/debug"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
)

// Recover returns a layer that turns a panic in the layers and handler
// beneath it into a [*rabbitmw.PanicError] carrying the panic value and the
// stack. The error settles like any other failure: Retry, above Recover,
// counts it as a failed attempt, so a message that always panics ends in
// the dead-letter queue rather than crashing the consumer or cycling
// forever.
//
// Layers beneath Recover see the panic before it is recovered and may clean
// up on the way (Dedup releases its claim). A panic in a layer above Recover
// is not caught here; the broker package catches one that escapes the whole
// chain and dead-letters its message.
func Recover() rabbitmw.Middleware {
	return func(next rabbitmw.Handler) rabbitmw.Handler { return recoverer{next} }
}

type recoverer struct{ next rabbitmw.Handler }

func (r recoverer) Handle(ctx context.Context, d *amqp.Delivery) (err error) {
	defer recoverInto(&err)
	return r.next.Handle(ctx, d)
}

// handleKeyed implements [keyedHandler], and hands k on.
func (r recoverer) handleKeyed(ctx context.Context, d *amqp.Delivery, k keyed) (err error) {
	defer recoverInto(&err)
	return handleKeyed(r.next, ctx, d, k)
}

// recoverInto, deferred, sets *err to the PanicError of a panic, if there
// is one, and stops it.
func recoverInto(err *error) {
	if v := recover(); v != nil {
		*err = &rabbitmw.PanicError{Value: v, Stack: debug.Stack()}
	}
}
