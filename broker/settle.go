package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
	"github.com/rabbitmw/rabbitmw/internal/header"
)

// settleTimeout bounds the wait for the confirm of a delayed or
// dead-lettered copy. A session whose confirm has not come by then is
// taken for broken, and given up.
const settleTimeout = 2 * time.Minute

// settle settles d by dec; hctx is the context its handler ran with.
func (cn *conn) settle(hctx context.Context, d *amqp.Delivery, dec rabbitmw.Decision) {
	var err error
	switch dec.Outcome {
	case rabbitmw.Ack, rabbitmw.Duplicate:
		err = ackLater(d) // coalesced, by s's acker
	case rabbitmw.Delay, rabbitmw.DeadLetter:
		// The copy has a context of its own: the shutdown deadline, which
		// cancels hctx, must not cut the wait for its confirm short. A
		// result that came after the deadline gets a short one.
		timeout := settleTimeout
		if hctx.Err() != nil {
			timeout = lateSettleTimeout
		}
		ctx, cancel := context.WithTimeout(context.WithoutCancel(hctx), timeout)
		if dec.Outcome == rabbitmw.Delay {
			err = cn.delay(ctx, d, dec)
		} else {
			err = cn.deadLetter(ctx, d, dec)
		}
		cancel()
	default: // Requeue
		err = d.Nack(false, true)
	}
	cn.report(hctx, d, dec.Outcome, err)
}

// report tells OnSettle of a settlement, and logs it if it failed.
func (c *consumer) report(ctx context.Context, d *amqp.Delivery, o rabbitmw.Outcome, err error) {
	if c.onSettle != nil {
		c.onSettle(d, o, err)
	}
	if err == nil {
		return
	}
	level := slog.LevelWarn
	if errors.Is(err, amqp.ErrClosed) {
		level = slog.LevelDebug // the server redelivers it
	}
	c.log.LogAttrs(ctx, level, "broker: settlement failed",
		slog.String("message_id", d.MessageId),
		slog.Uint64("delivery_tag", d.DeliveryTag),
		slog.String("outcome", o.String()),
		slog.String("error", err.Error()))
}

// errNotSent is wrapped by the error of a copy that was not sent.
var errNotSent = errors.New("broker: copy not sent")

// publishCopy publishes msg to queue on s and waits for the server's
// confirm. Under a context that is done already it sends nothing, and
// returns an error wrapping errNotSent. It refuses a copy that would not
// leave headroom bytes of a frame free (ErrInvalidMessage), sending
// nothing.
func (cn *conn) publishCopy(ctx context.Context, queue string, msg amqp.Publishing, headroom int) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("%w: %w", errNotSent, err)
	}
	if headroom > 0 {
		size, err := transport.CheckPublishing("", queue, msg)
		if err == nil {
			err = transport.FitFrame(size, cn.s.MaxProperties(), headroom)
		}
		if err != nil {
			return err
		}
	}
	return cn.s.Publish(ctx, "", queue, msg)
}

// copyFailed settles d, whose copy to queue failed with err. A copy known
// not to be in queue (not sent, or refused by the server) leaves d to be
// requeued (requeueAfter). A copy whose fate is unknown (the session was
// lost, or ctx ended, before its confirm) may be in queue: requeueing d
// would make the message exist twice, acking it would lose the message if
// the copy is not there. So d is left as it is, and s given up: the server
// redelivers d.
func (cn *conn) copyFailed(ctx context.Context, d *amqp.Delivery, fc failedCopy) error {
	unknown := !errors.Is(fc.err, errNotSent) &&
		(errors.Is(fc.err, ErrConnectionLost) || errors.Is(fc.err, context.DeadlineExceeded) || errors.Is(fc.err, context.Canceled))
	if !unknown {
		return cn.requeueAfter(ctx, d, fc)
	}
	cn.log.LogAttrs(ctx, slog.LevelWarn, "broker: "+fc.kind+" copy not confirmed; the server redelivers the message",
		slog.String("message_id", d.MessageId),
		slog.String("to", fc.queue),
		slog.String("error", fc.err.Error()))
	if !isClosed(cn.s.Closed()) {
		cn.giveUp(fmt.Errorf("%w: the %s copy of message %q was not confirmed: %w", ErrConnectionLost, fc.kind, d.MessageId, fc.err))
	}
	return errUnsettled
}

// requeueBackoff is the pause before a delivery whose copy was refused
// is requeued, so that a failing publish is never a hot loop.
const requeueBackoff = time.Second

// A failedCopy is a copy of a delivery that was not confirmed: its kind
// ("delay", "dead-letter"), the queue it was for, and why.
type failedCopy struct {
	kind, queue string
	err         error
}

// requeueAfter logs a copy that was not published, pauses (unless the
// session or ctx ends first), and requeues d.
func (cn *conn) requeueAfter(ctx context.Context, d *amqp.Delivery, fc failedCopy) error {
	cn.log.LogAttrs(ctx, slog.LevelWarn, "broker: "+fc.kind+" copy not published; requeueing the message",
		slog.String("message_id", d.MessageId),
		slog.String("to", fc.queue),
		slog.String("error", fc.err.Error()))
	t := time.NewTimer(requeueBackoff)
	select {
	case <-t.C:
	case <-ctx.Done():
	case <-cn.s.Closed():
	}
	t.Stop()
	return d.Nack(false, true)
}

// copyRefused is the reason for dead-lettering a message whose copy of kind
// what could not be sent (refusal), after its handler's result (cause, nil
// for a delivery that was not handled): cause first, so that the error
// type header names the handler's error.
func copyRefused(what string, refusal, cause error) error {
	if cause == nil {
		return fmt.Errorf("broker: the %s copy cannot be sent: %w", what, refusal)
	}
	return fmt.Errorf("%w (and the %s copy cannot be sent: %v)", cause, what, refusal)
}

// republishing returns the copy of d with headers h (which it may
// modify), as [asCopy] makes it.
func republishing(d *amqp.Delivery, h amqp.Table) amqp.Publishing {
	return asCopy(amqp.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    d.DeliveryMode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		Expiration:      d.Expiration,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		UserId:          d.UserId,
		AppId:           d.AppId,
		Body:            d.Body,
	})
}

// asCopy returns msg as every copy the broker makes goes (a delay,
// dead-letter, replayed or imported copy): every property kept but three,
// each kept in a header unless the header is there already (an earlier
// copy wrote it):
//
//   - Expiration goes to HeaderOriginalExpiration: nothing in a delay or
//     dead-letter queue expires, as RabbitMQ's own dead-lettering removes
//     the property;
//   - UserId goes to HeaderUserID: RabbitMQ refuses a publish by another
//     user;
//   - DeliveryMode is persistent; a message that was not goes with its
//     mode in HeaderOriginalDeliveryMode.
//
// And two headers, by which RabbitMQ would route the copy to more queues:
// CC goes to HeaderOriginalCC, BCC to HeaderOriginalBCC.
//
// [asPublished] gives them back to the delivery a handler sees (but BCC,
// which a delivery never has). msg's headers may be modified.
func asCopy(msg amqp.Publishing) amqp.Publishing {
	keep := func(k string, v any) {
		if msg.Headers == nil {
			msg.Headers = amqp.Table{}
		}
		setIfAbsent(msg.Headers, k, v)
	}
	if msg.Expiration != "" {
		keep(HeaderOriginalExpiration, msg.Expiration)
		msg.Expiration = ""
	}
	if msg.UserId != "" {
		keep(HeaderUserID, msg.UserId)
		msg.UserId = ""
	}
	if msg.DeliveryMode != amqp.Persistent {
		keep(HeaderOriginalDeliveryMode, int64(msg.DeliveryMode))
		msg.DeliveryMode = amqp.Persistent
	}
	for name, kept := range senderHeaders {
		if v, ok := msg.Headers[name]; ok {
			keep(kept, v)
			delete(msg.Headers, name)
		}
	}
	return msg
}

// senderHeaders maps the headers that RabbitMQ routes a message by, as
// well as its routing key, to the headers a copy keeps them in.
var senderHeaders = map[string]string{"CC": HeaderOriginalCC, "BCC": HeaderOriginalBCC}

// asPublished gives d, delivered from a work queue, the fields it had when
// first delivered, which the copies that brought it back (from a delay
// queue, or replayed from the dead-letter queue) changed: Exchange and
// RoutingKey from HeaderOriginalExchange and HeaderOriginalRoutingKey,
// the properties that [asCopy] keeps in headers, and the CC header. A
// header of another type, or a property or CC header d carries itself, is
// left alone.
//
// Only a delivery that came the way copies come is given them: through the
// default exchange, with queue, the work queue, as routing key. One that an
// exchange routed there was published by a producer, whose headers may be
// another message's (forwarded whole): its own route and properties stand,
// UserId above all, which RabbitMQ validated. (A producer that publishes
// straight to the queue, through the default exchange, cannot be told from
// a copy: headers are not authenticated.)
func asPublished(d *amqp.Delivery, queue string) {
	if d.Exchange != "" || d.RoutingKey != queue {
		return
	}
	h := d.Headers
	if ex, ok := h[HeaderOriginalExchange].(string); ok {
		if key, ok := h[HeaderOriginalRoutingKey].(string); ok {
			d.Exchange, d.RoutingKey = ex, key
		}
	}
	if v, ok := h[HeaderUserID].(string); ok && d.UserId == "" {
		d.UserId = v
	}
	if v, ok := h[HeaderOriginalExpiration].(string); ok && d.Expiration == "" {
		d.Expiration = v
	}
	if v, ok := header.Integer(h[HeaderOriginalDeliveryMode]); ok && v >= 0 && v < int64(amqp.Persistent) && d.DeliveryMode == amqp.Persistent {
		d.DeliveryMode = uint8(v)
	}
	if v, ok := h[HeaderOriginalCC]; ok {
		setIfAbsent(h, "CC", v)
	}
}

func setIfAbsent(h amqp.Table, k string, v any) {
	if _, ok := h[k]; !ok {
		h[k] = v
	}
}
