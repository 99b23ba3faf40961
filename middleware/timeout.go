package middleware

import (
	"context"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/errchain"
)

// ErrTimeout is wrapped by the error of a handler that failed after its
// deadline set by [Timeout] had passed.
var ErrTimeout error = &sentinel{"middleware: handler timed out", "timeout"}

// Timeout returns a layer that gives the context of the layers and handler
// beneath it a deadline d from the start of each delivery. It panics if d is
// not positive.
//
// The deadline works through the context, as every deadline in Go does: a
// handler that does not watch ctx runs on, and Timeout waits for it, since
// settling a message while its handler still runs could apply the handler's
// effect after the message was given to another consumer. When the handler
// returns an error after the deadline passed, Timeout wraps it with
// ErrTimeout and the duration; a nil result stands, late or not.
//
// Place Timeout beneath Dedup, so the deadline bounds the business handler
// and not Dedup's own store calls, and keep d well below Dedup's lease and
// RabbitMQ's consumer_timeout.
func Timeout(d time.Duration) rabbitmw.Middleware {
	if d <= 0 {
		panic(fmt.Sprintf("middleware: Timeout: non-positive duration %v", d))
	}
	return func(next rabbitmw.Handler) rabbitmw.Handler { return &timeout{d: d, next: next} }
}

// timeout is the handler of a Timeout layer. A [Dedup] directly above it
// runs next itself, under a context with the deadline (see
// [dedup.handleKeyed]), rather than give it a context of its own beneath
// Dedup's.
type timeout struct {
	d    time.Duration
	next rabbitmw.Handler
}

func (t *timeout) Handle(ctx context.Context, dv *amqp.Delivery) error {
	if ctx == nil {
		ctx = context.Background()
	}
	tctx := &cancelContext{parent: ctx, deadline: time.Now().Add(t.d)}
	defer tctx.end()
	err := t.next.Handle(tctx, dv)
	return t.result(ctx, tctx, err)
}

// result is the result of a handler that returned err under tctx, which
// has the layer's deadline, beneath ctx: err wrapped with ErrTimeout if
// the deadline has passed (and ctx has not ended), else err. It asks the
// clock, not tctx's Err: a watched context learns of its deadline from a
// timer, which may not have run yet as the handler returns.
func (t *timeout) result(ctx context.Context, tctx *cancelContext, err error) error {
	err = errchain.Safe(err)
	if err != nil && ctx.Err() == nil && time.Until(tctx.deadline) <= 0 {
		return fmt.Errorf("%w after %v: %w", ErrTimeout, t.d, err)
	}
	return err
}
