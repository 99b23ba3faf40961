package broker

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// deadLetter sends a copy of d with fault headers to the dead-letter queue
// and acks d once the copy is confirmed.
//
// A copy that cannot be sent (ErrInvalidMessage; with d as delivered,
// only because its fault headers make it too big for a frame) is sent
// again without most of them: d's headers, its fields as its handler saw
// them (recordAsSeen), the attempt count, the queue,
// and HeaderError cut to 512 bytes, saying so. If even that cannot be
// sent, d fills its frame: it is rejected without requeue, and the
// reason logged at Error. The work queue's dead-letter arguments then take
// it to the dead-letter queue, without fault headers, with RabbitMQ's
// x-death (reason "rejected") (DeclareAll declares them; a work queue
// declared elsewhere without them drops it). It is never requeued: it
// would fail the same way again.
func (cn *conn) deadLetter(ctx context.Context, d *amqp.Delivery, dec rabbitmw.Decision) error {
	h := faultHeaders(d, dec, cn.top.queue, time.Now(), cn.b.cfg.host, cn.b.cfg.process)
	errText, _ := h[HeaderError].(string)
	attempts, _ := h[rabbitmw.HeaderAttempts].(int64)
	err := cn.publishCopy(ctx, cn.top.dlq, republishing(d, h), 0)
	if errors.Is(err, ErrInvalidMessage) {
		cut := make(amqp.Table, len(d.Headers)+3)
		maps.Copy(cut, d.Headers)
		recordAsSeen(cut, d)
		cut[HeaderError] = text.Truncate("broker: fault headers cut, the dead-letter copy did not fit ("+err.Error()+"): "+errText, maxCutErrorText)
		cut[rabbitmw.HeaderAttempts] = attempts
		cut[HeaderOriginalQueue] = cn.top.queue
		err = cn.publishCopy(ctx, cn.top.dlq, republishing(d, cut), 0)
	}
	errType, _ := h[HeaderErrorType].(string)
	cn.b.cfg.obs.republish(ctx, RepublishEvent{Outcome: rabbitmw.DeadLetter, Queue: cn.top.queue, To: cn.top.dlq, ErrorType: errType, Err: err, Delivery: d})
	if errors.Is(err, ErrInvalidMessage) {
		cn.log.LogAttrs(ctx, slog.LevelError, "broker: dead-letter copy cannot be sent; the message is rejected to the work queue's dead-letter exchange",
			slog.String("message_id", d.MessageId),
			slog.String("error", errText),
			slog.String("reason", err.Error()))
		return d.Reject(false)
	}
	if err != nil {
		return cn.copyFailed(ctx, d, failedCopy{"dead-letter", cn.top.dlq, err})
	}
	// Debug: the dead-letter was logged where it was decided (see
	// Options.Logger).
	cn.log.LogAttrs(ctx, slog.LevelDebug, "broker: dead-letter copy confirmed",
		slog.String("message_id", d.MessageId),
		slog.String("to", cn.top.dlq),
		slog.String("error", errText),
		slog.Int64("attempts", attempts))
	return d.Ack(false)
}

// maxCutErrorText bounds HeaderError on a dead-letter copy cut to fit.
const maxCutErrorText = 512

// faultHeaders returns the headers of the dead-lettered copy of d: all of
// d's headers, whatever their types, the records of HeaderDeaths back in
// x-death, d's fields as its handler saw them (recordAsSeen), plus the
// fault headers that say why, where and when. The attempt
// count is dec.Attempts, or, when no layer counted (0), the count recorded
// on d plus this failed attempt. It does not modify d.
func faultHeaders(d *amqp.Delivery, dec rabbitmw.Decision, queue string, at time.Time, host, process string) amqp.Table {
	h := make(amqp.Table, len(d.Headers)+9)
	maps.Copy(h, d.Headers)
	restoreDeaths(h)
	var reason, typ string
	if dec.Err != nil {
		reason = text.Capped(dec.Err) // at most text.MaxError bytes
		typ = rabbitmw.ErrorType(dec.Err)
	}
	h[HeaderError] = reason
	h[HeaderErrorType] = typ
	attempts := dec.Attempts
	if attempts <= 0 {
		attempts = rabbitmw.PriorAttempts(d) + 1
	}
	h[rabbitmw.HeaderAttempts] = int64(attempts)
	recordAsSeen(h, d)
	h[HeaderOriginalQueue] = queue
	h[HeaderFailedAt] = at.UTC().Truncate(time.Second)
	h[HeaderHost] = host
	h[HeaderProcess] = process
	return h
}

// restoreDeaths puts the records of h's HeaderDeaths back in its x-death,
// merged (see HeaderDeaths), and removes HeaderDeaths; it does nothing
// unless both are in RabbitMQ's form of x-death, or x-death is absent. It
// modifies h, not the values in it.
func restoreDeaths(h amqp.Table) {
	aside, ok := h[HeaderDeaths]
	if !ok || !wellFormedXDeath(aside) {
		return
	}
	v, ok := h["x-death"]
	if ok && !wellFormedXDeath(v) {
		return
	}
	deaths, _ := v.([]any)
	h["x-death"] = mergeDeaths(deaths, aside.([]any))
	delete(h, HeaderDeaths)
}
