package middleware

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/errchain"
	"github.com/rabbitmw/rabbitmw/internal/text"
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
//	error         for a failure (any outcome but acked and duplicate),
//	              the error's text, cut to its first 4 KiB, ending in
//	              "…", if it is longer; if its Error method panics (a
//	              nil pointer returned as an error, say), a text naming
//	              its type, and the failure settles as any other
//	error_type    for a failure, its type (rabbitmw.ErrorType), as the
//	              dead-letter headers and otelmw name it
//	reason        for a duplicate, why it is one (the text of its error,
//	              cut as error's is: a duplicate is no failure, and
//	              carries no error)
//	stack         for a recovered panic (rabbitmw.PanicError): its stack
//
// The level is Info for acked and duplicate, Warn for requeued and delayed,
// and Error for dead-lettered and panicked. A panic from beneath is logged,
// then let go on. Log records what the result asks for; the code that
// settles reports its own failures to do so.
//
// A nil l discards: Log(nil) returns a layer that adds nothing. Log(l) is
// LogWith(l, LogOptions{}).
func Log(l *slog.Logger) rabbitmw.Middleware {
	return LogWith(l, LogOptions{})
}

// LogOptions configures the layer of [LogWith]. The zero value means the
// defaults, those of [Log].
//
// Only the levels of the two successful outcomes can be changed: they are
// most of a busy consumer's records. A requeue or a delay is always a Warn
// and a dead-letter an Error, so that no setting hides a failure.
type LogOptions struct {
	// AckLevel is the level of the record of an acked delivery. The zero
	// value is slog.LevelInfo.
	AckLevel slog.Level
	// DuplicateLevel is the level of the record of a duplicate: a delivery
	// of a message already processed. The zero value is slog.LevelInfo.
	DuplicateLevel slog.Level
	// AppendAttrs, if set, appends attributes of d (read from its headers,
	// say) to attrs and returns the result, as append does; the record
	// carries them after its own. It is called only for a record that will
	// be written, on the goroutine that handles d, so it must be quick and
	// safe for concurrent use. It must not modify d, nor keep attrs.
	// Attributes that are the same for every delivery belong on the
	// logger instead (l.With).
	AppendAttrs func(attrs []slog.Attr, d *amqp.Delivery) []slog.Attr
}

// LogWith returns the layer of [Log], with the levels and the attributes
// that opts asks for. A nil l discards: LogWith(nil, opts) returns a layer
// that adds nothing.
func LogWith(l *slog.Logger, opts LogOptions) rabbitmw.Middleware {
	if l == nil {
		return func(next rabbitmw.Handler) rabbitmw.Handler { return next }
	}
	lg := &deliveryLog{
		l:           l,
		ack:         opts.AckLevel,
		duplicate:   opts.DuplicateLevel,
		top:         max(slog.LevelError, opts.AckLevel, opts.DuplicateLevel),
		appendAttrs: opts.AppendAttrs,
	}
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			if d == nil {
				return next.Handle(ctx, d)
			}
			if ctx == nil {
				ctx = context.Background()
			}
			if !l.Enabled(ctx, lg.top) {
				return next.Handle(ctx, d) // nothing would be written
			}
			start := time.Now()
			finished := false
			defer func() {
				if !finished {
					lg.write(ctx, d, start, "panicked", slog.LevelError, rabbitmw.Decision{}, nil)
				}
			}()
			err := errchain.Safe(next.Handle(ctx, d))
			finished = true
			dec := rabbitmw.Decide(err)
			lg.write(ctx, d, start, dec.Outcome.String(), lg.level(dec.Outcome), dec, err)
			return err
		})
	}
}

// deliveryLog is the configuration of one Log layer.
type deliveryLog struct {
	l              *slog.Logger
	ack, duplicate slog.Level
	top            slog.Level // the highest level of any record
	appendAttrs    func([]slog.Attr, *amqp.Delivery) []slog.Attr
}

// level returns the level of the record of a delivery with outcome o.
func (lg *deliveryLog) level(o rabbitmw.Outcome) slog.Level {
	switch o {
	case rabbitmw.Ack:
		return lg.ack
	case rabbitmw.Duplicate:
		return lg.duplicate
	case rabbitmw.Requeue, rabbitmw.Delay:
		return slog.LevelWarn
	case rabbitmw.DeadLetter:
		return slog.LevelError
	}
	return slog.LevelInfo
}

// attrsRoom is the number of attributes a record holds without growing its
// slice: the layer's own, at most eleven.
const attrsRoom = 11

func (lg *deliveryLog) write(ctx context.Context, d *amqp.Delivery, start time.Time, outcome string, level slog.Level, dec rabbitmw.Decision, err error) {
	if !lg.l.Enabled(ctx, level) {
		return
	}
	if lg.appendAttrs == nil {
		// A slice of its own, which does not escape: no allocation.
		attrs := appendDeliveryAttrs(make([]slog.Attr, 0, attrsRoom), d, start, outcome, dec, err)
		lg.l.LogAttrs(ctx, level, "delivery", attrs...)
		return
	}
	// The compiler cannot see what the user's function does with the slice,
	// so a slice made here would be allocated on the heap for every record:
	// take one from a pool instead.
	p := attrsPool.Get().(*[]slog.Attr)
	attrs := appendDeliveryAttrs((*p)[:0], d, start, outcome, dec, err)
	attrs = lg.appendAttrs(attrs, d)
	lg.l.LogAttrs(ctx, level, "delivery", attrs...) // copies attrs into its record
	clear(attrs)                                    // let go of the strings and values
	*p = attrs[:0]
	attrsPool.Put(p)
}

// attrsPool holds the attribute slices of the records that carry a user's
// attributes.
var attrsPool = sync.Pool{New: func() any {
	s := make([]slog.Attr, 0, 2*attrsRoom)
	return &s
}}

// appendDeliveryAttrs appends the layer's own attributes of a record to
// attrs.
func appendDeliveryAttrs(attrs []slog.Attr, d *amqp.Delivery, start time.Time, outcome string, dec rabbitmw.Decision, err error) []slog.Attr {
	attempt := dec.Attempts
	if attempt == 0 {
		attempt = rabbitmw.PriorAttempts(d) + 1
	}
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
	switch {
	case err != nil && dec.Outcome == rabbitmw.Duplicate:
		// Not a failure: an alert on error must not fire on it.
		attrs = append(attrs, slog.String("reason", text.Capped(err)))
	case err != nil:
		attrs = append(attrs,
			slog.String("error", text.Capped(err)),
			slog.String("error_type", rabbitmw.ErrorType(err)))
		var pe *rabbitmw.PanicError
		if errors.As(err, &pe) {
			attrs = append(attrs, slog.String("stack", string(pe.Stack)))
		}
	}
	return attrs
}
