package middleware

import (
	"context"
	"errors"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
)

// Log returns a layer that writes one record to l per delivery, after the
// layers beneath it return, with the message "delivery" and these
// attributes:
//
//	message_id    the message_id property ("" when absent)
//	delivery_tag  the delivery tag
//	routing_key   the routing key it was published with
//	redelivered   the Redelivered flag
//	attempt       the attempt number: the count a layer attached with
//	              rabbitmw.WithAttempts, else the count the message carries
//	              in its attempts header, plus one
//	duration      the time spent beneath Log
//	outcome       what the result asks for (rabbitmw.Decide): acked,
//	              duplicate, requeued, delayed or dead-lettered; or panicked
//	delay         for delayed: the least delay before the next delivery
//	error         the error text, when there is one
//	stack         for a recovered panic (rabbitmw.PanicError): its stack
//
// The level is Info for acked and duplicate, Warn for requeued and delayed,
// and Error for dead-lettered and panicked. A panic from beneath is logged,
// then let go on. Log records what the result asks for; the code that
// settles reports its own failures to do so.
//
// A nil l discards: Log(nil) returns a layer that adds nothing.
func Log(l *slog.Logger) rabbitmw.Middleware {
	if l == nil {
		return func(next rabbitmw.Handler) rabbitmw.Handler { return next }
	}
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			if d == nil {
				return next.Handle(ctx, d)
			}
			if ctx == nil {
				ctx = context.Background()
			}
			if !l.Enabled(ctx, slog.LevelError) {
				return next.Handle(ctx, d) // nothing would be written
			}
			start := time.Now()
			finished := false
			defer func() {
				if !finished {
					logDelivery(ctx, l, d, start, "panicked", slog.LevelError, rabbitmw.Decision{}, nil)
				}
			}()
			err := next.Handle(ctx, d)
			finished = true
			dec := rabbitmw.Decide(err)
			level := slog.LevelInfo
			switch dec.Outcome {
			case rabbitmw.Requeue, rabbitmw.Delay:
				level = slog.LevelWarn
			case rabbitmw.DeadLetter:
				level = slog.LevelError
			}
			logDelivery(ctx, l, d, start, dec.Outcome.String(), level, dec, err)
			return err
		})
	}
}

func logDelivery(ctx context.Context, l *slog.Logger, d *amqp.Delivery, start time.Time, outcome string, level slog.Level, dec rabbitmw.Decision, err error) {
	if !l.Enabled(ctx, level) {
		return
	}
	attempt := dec.Attempts
	if attempt == 0 {
		attempt = rabbitmw.PriorAttempts(d) + 1
	}
	attrs := make([]slog.Attr, 0, 10)
	attrs = append(attrs,
		slog.String("message_id", d.MessageId),
		slog.Uint64("delivery_tag", d.DeliveryTag),
		slog.String("routing_key", d.RoutingKey),
		slog.Bool("redelivered", d.Redelivered),
		slog.Int("attempt", attempt),
		slog.Duration("duration", time.Since(start)),
		slog.String("outcome", outcome),
	)
	if dec.Outcome == rabbitmw.Delay {
		attrs = append(attrs, slog.Duration("delay", dec.Delay))
	}
	if err != nil {
		attrs = append(attrs, slog.String("error", err.Error()))
		var pe *rabbitmw.PanicError
		if errors.As(err, &pe) {
			attrs = append(attrs, slog.String("stack", string(pe.Stack)))
		}
	}
	l.LogAttrs(ctx, level, "delivery", attrs...)
}
