package broker

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/header"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// delay sends a copy of d to the delay queue for dec.Delay and acks d once
// the copy is confirmed. A copy that cannot be sent (ErrInvalidMessage:
// with what a delay adds, it would not leave a frame's headroom free, as
// it must since it comes back with RabbitMQ's x-death) would fail the same
// way every time: d is dead-lettered instead, with the reason.
func (cn *conn) delay(ctx context.Context, d *amqp.Delivery, dec rabbitmw.Decision) error {
	tr, over := cn.top.tierFor(dec.Delay)
	var due time.Time
	if over {
		// The delay queue alone cannot guarantee the delay: it is too
		// short. (The copy has no Expiration of its own to cut its stay:
		// see asCopy.)
		due = time.Now().Add(dec.Delay)
	}
	h := delayHeaders(d, dec, cn.top.queue, due)
	noteFirstFailure(h, dec.Err, time.Now())
	msg := republishing(d, h)
	err := cn.publishCopy(ctx, tr.queue, msg, retryHeadroom)
	cn.b.cfg.obs.republish(ctx, RepublishEvent{Outcome: rabbitmw.Delay, Queue: cn.top.queue, To: tr.queue, Delay: dec.Delay, Err: err, Delivery: d})
	if errors.Is(err, ErrInvalidMessage) {
		cn.log.LogAttrs(ctx, slog.LevelWarn, "broker: delay copy cannot be sent; the message is dead-lettered",
			slog.String("message_id", d.MessageId),
			slog.String("error", err.Error()))
		return cn.deadLetter(ctx, d, rabbitmw.Decision{
			Outcome:  rabbitmw.DeadLetter,
			Attempts: dec.Attempts,
			Err:      copyRefused("delay", err, dec.Err),
		})
	}
	if err != nil {
		return cn.copyFailed(ctx, d, failedCopy{"delay", tr.queue, err})
	}
	return d.Ack(false)
}

// maxFirstErrorText bounds HeaderFirstError, which a delay copy carries
// (see retryHeadroom).
const maxFirstErrorText = 512

// noteFirstFailure records on h, the headers of a delay copy, the failure
// err at time at, unless h records one already or err is not counted.
func noteFirstFailure(h amqp.Table, err error, at time.Time) {
	if err == nil || rabbitmw.IsNotCounted(err) {
		return
	}
	if _, ok := h[HeaderFirstFailedAt]; ok {
		return
	}
	h[HeaderFirstError] = text.Truncate(text.Error(err), maxFirstErrorText)
	h[HeaderFirstFailedAt] = at.UTC().Truncate(time.Second)
}

// delayHeaders returns the headers of the copy of d, from work queue
// queue, sent to a delay queue: all of d's, the attempt count of dec when a
// layer counted one, d's fields as its handler saw them (recordAsSeen),
// and HeaderNotBefore when notBefore is not zero (removed otherwise).
// An x-death not in RabbitMQ's form moves to HeaderMalformedXDeath; the
// records of one in that form that name queue move to HeaderDeaths. It
// does not modify d.
func delayHeaders(d *amqp.Delivery, dec rabbitmw.Decision, queue string, notBefore time.Time) amqp.Table {
	h := make(amqp.Table, len(d.Headers)+4)
	maps.Copy(h, d.Headers)
	if dec.Attempts > 0 {
		h[rabbitmw.HeaderAttempts] = int64(dec.Attempts)
	}
	recordAsSeen(h, d)
	if notBefore.IsZero() {
		delete(h, HeaderNotBefore)
	} else {
		h[HeaderNotBefore] = notBefore.UnixMilli()
	}
	if v, ok := h["x-death"]; ok && !wellFormedXDeath(v) {
		delete(h, "x-death")
		setIfAbsent(h, HeaderMalformedXDeath, v)
	} else {
		setAsideDeaths(h, queue)
	}
	return h
}

// recordAsSeen makes h, the headers of a copy of d, record d's exchange
// and routing key, and leaves the headers of the properties and of the CC
// header that asCopy keeps to be written from d's own: all as d's handler
// saw them, once asPublished gave d back the fields its copies carry. Whatever d's
// headers said of them goes: an exchange that routed d left its fields
// alone (its headers may be another message's, forwarded whole), and so
// must every later delivery of it.
func recordAsSeen(h amqp.Table, d *amqp.Delivery) {
	h[HeaderOriginalExchange] = d.Exchange
	h[HeaderOriginalRoutingKey] = d.RoutingKey
	delete(h, HeaderUserID)
	delete(h, HeaderOriginalExpiration)
	delete(h, HeaderOriginalDeliveryMode)
	delete(h, HeaderOriginalCC)
}

// setAsideDeaths moves the records of h's x-death, in RabbitMQ's form, that
// name queue to HeaderDeaths, merged into those already there (see
// HeaderDeaths). It leaves x-death an array, if empty. It modifies h, not
// the values in it.
func setAsideDeaths(h amqp.Table, queue string) {
	deaths, _ := h["x-death"].([]any)
	kept := make([]any, 0, len(deaths))
	var moved []any
	for _, d := range deaths {
		if r, _ := d.(amqp.Table); r["queue"] == queue {
			moved = append(moved, d)
		} else {
			kept = append(kept, d)
		}
	}
	if len(moved) == 0 {
		return
	}
	var earlier []any
	if v, ok := h[HeaderDeaths]; ok {
		if wellFormedXDeath(v) {
			earlier = v.([]any)
		} else {
			setIfAbsent(h, HeaderMalformedXDeath, v)
		}
	}
	h[HeaderDeaths] = mergeDeaths(moved, earlier)
	h["x-death"] = kept
}

// notBefore reads HeaderNotBefore from h: Unix milliseconds of any integer
// type, or a timestamp.
func notBefore(h amqp.Table) (time.Time, bool) {
	v, ok := h[HeaderNotBefore]
	if !ok {
		return time.Time{}, false
	}
	if t, ok := v.(time.Time); ok {
		return t, true
	}
	ms, ok := header.Int(v)
	if !ok {
		return time.Time{}, false
	}
	return time.UnixMilli(ms), true
}

// maxNotBefore bounds how far ahead HeaderNotBefore may be: a message whose
// header is further ahead is dead-lettered rather than delayed.
const maxNotBefore = 7 * 24 * time.Hour
