package broker

import (
	"maps"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
	"github.com/rabbitmw/rabbitmw/internal/header"
)

// Headers written by the broker. [rabbitmw.HeaderAttempts]
// ("x-rabbitmw-attempts") is written too: on a message sent to a delay
// queue when a layer counted the attempts, and always on a dead-lettered
// one.
const (
	// HeaderError is the error text of a dead-lettered message (a string
	// of at most 4 KiB).
	HeaderError = "x-rabbitmw-error"
	// HeaderErrorType is the type of the failure, as
	// [rabbitmw.ErrorType] names it: "panic", "timeout", "busy", a Go
	// type such as "*json.SyntaxError", or "error" for an error made by
	// errors.New or fmt.Errorf.
	HeaderErrorType = "x-rabbitmw-error-type"
	// HeaderFirstError and HeaderFirstFailedAt are the error text (at
	// most 512 bytes) and the time (a timestamp, UTC, whole seconds) of
	// the first failure the broker copied the message for: written on its
	// first delay copy, or, if it had none, left out of its dead-letter
	// copy, whose HeaderError and HeaderFailedAt then say the same. A
	// failure that is not counted (rabbitmw.NotCounted: busy, the store
	// unavailable) is not one. RabbitMQ's x-first-death-* name the first
	// time the server dead-lettered the message, which for a message
	// delayed on a retry is the first delay queue's expiry.
	HeaderFirstError    = "x-rabbitmw-first-error"
	HeaderFirstFailedAt = "x-rabbitmw-first-failed-at"
	// HeaderOriginalExchange and HeaderOriginalRoutingKey are the exchange
	// and routing key the message was first published with: recorded at
	// its first delay or dead-letter (or, for a message RabbitMQ
	// dead-lettered itself, at its replay, from its x-death record), and
	// kept at later hops. Consume gives them back to the delivery before
	// the handler runs.
	HeaderOriginalExchange   = "x-rabbitmw-original-exchange"
	HeaderOriginalRoutingKey = "x-rabbitmw-original-routing-key"
	// HeaderOriginalQueue is the work queue the message was dead-lettered
	// from.
	HeaderOriginalQueue = "x-rabbitmw-original-queue"
	// HeaderFailedAt is when the message was dead-lettered (a timestamp,
	// UTC, whole seconds).
	HeaderFailedAt = "x-rabbitmw-failed-at"
	// HeaderHost and HeaderProcess identify the consumer that
	// dead-lettered the message (Options.Host and Options.Process).
	HeaderHost    = "x-rabbitmw-host"
	HeaderProcess = "x-rabbitmw-process"
	// HeaderNotBefore is the time (Unix milliseconds, int64) before which
	// a message must not be handled: set on a message delayed longer than
	// the longest delay queue. A consumer that receives it earlier sends
	// it back to a delay queue for the remainder without handling it. A
	// value more than 7 days ahead is taken for a corrupt header: the
	// message is dead-lettered, with that reason.
	HeaderNotBefore = "x-rabbitmw-not-before"
	// HeaderUserID keeps the UserId property of a message that the broker
	// republishes (RabbitMQ refuses a publish whose user-id is not the
	// connection's user, so the copy goes without it). Consume gives it
	// back to the delivery before the handler runs, as it does
	// HeaderOriginalExpiration and HeaderOriginalDeliveryMode.
	HeaderUserID = "x-rabbitmw-user-id"
	// HeaderOriginalExpiration keeps the Expiration property (a per-message
	// TTL) of a message that the broker copies: no copy carries one, so
	// that nothing expires out of a delay or dead-letter queue, as
	// RabbitMQ's own dead-lettering removes it (and keeps it in x-death as
	// original-expiration).
	HeaderOriginalExpiration = "x-rabbitmw-original-expiration"
	// HeaderOriginalDeliveryMode keeps the DeliveryMode property (an
	// int64) of a message that was not persistent when the broker copied
	// it: every copy is persistent.
	HeaderOriginalDeliveryMode = "x-rabbitmw-original-delivery-mode"
	// HeaderMalformedXDeath keeps an x-death header that is not what
	// RabbitMQ itself writes (an array of tables, each with an integer
	// count), moved there from the copy sent to a delay queue: RabbitMQ
	// 3.10 updates x-death when the copy expires, and a malformed one
	// crashes the delay queue. A HeaderDeaths that is not in x-death's
	// form is kept there too, if HeaderMalformedXDeath is free, when the
	// delay copy needs HeaderDeaths for records of its own.
	HeaderMalformedXDeath = "x-rabbitmw-x-death"
	// HeaderDeaths keeps the x-death records that name the work queue:
	// those RabbitMQ wrote when it dead-lettered the message out of the
	// work queue (it expired there, or went past a length or delivery
	// limit, or was rejected) before the message came back to it, replayed
	// from the dead-letter queue by an operator or a shovel. When the delay
	// queue dead-letters a copy back to the work queue, RabbitMQ 3.10
	// takes such a record, with no reject among the later ones, for a
	// dead-letter cycle, and drops the copy. So the copy sent to a delay
	// queue carries those records here instead of in x-death: in x-death's
	// form (an array of tables), merged with the records moved there on
	// earlier hops, one record per queue and reason, the counts added, as
	// RabbitMQ counts. The copy keeps its x-death, empty if nothing else is
	// left, so that RabbitMQ leaves x-first-death-* as they were.
	//
	// So a handler sees, on a message back from a delay queue, x-death as
	// RabbitMQ wrote it but for the records that name the work queue, and
	// those records here. The dead-lettered copy has them back in x-death,
	// merged the same way, and no HeaderDeaths: the dead-letter queue shows
	// the message's whole history. (A HeaderDeaths not in x-death's form
	// is not merged.)
	HeaderDeaths = "x-rabbitmw-deaths"
)

// maxErrorText bounds HeaderError, in bytes, and maxFirstErrorText
// HeaderFirstError, which a delay copy carries (see retryHeadroom).
const (
	maxErrorText      = 4 << 10
	maxFirstErrorText = 512
)

// noteFirstFailure records on h, the headers of a delay copy, the failure
// err at time at, unless h records one already or err is not counted.
func noteFirstFailure(h amqp.Table, err error, at time.Time) {
	if err == nil || rabbitmw.IsNotCounted(err) {
		return
	}
	if _, ok := h[HeaderFirstFailedAt]; ok {
		return
	}
	h[HeaderFirstError] = transport.Truncate(err.Error(), maxFirstErrorText)
	h[HeaderFirstFailedAt] = at.UTC().Truncate(time.Second)
}

// faultHeaders returns the headers of the dead-lettered copy of d: all of
// d's headers, whatever their types, the records of HeaderDeaths back in
// x-death, plus the fault headers that say why, where and when. The attempt
// count is dec.Attempts, or, when no layer counted (0), the count recorded
// on d plus this failed attempt. It does not modify d.
func faultHeaders(d *amqp.Delivery, dec rabbitmw.Decision, queue string, at time.Time, host, process string) amqp.Table {
	h := make(amqp.Table, len(d.Headers)+9)
	maps.Copy(h, d.Headers)
	restoreDeaths(h)
	var text, typ string
	if dec.Err != nil {
		text = transport.Truncate(dec.Err.Error(), maxErrorText)
		typ = rabbitmw.ErrorType(dec.Err)
	}
	h[HeaderError] = text
	h[HeaderErrorType] = typ
	attempts := dec.Attempts
	if attempts <= 0 {
		attempts = rabbitmw.PriorAttempts(d) + 1
	}
	h[rabbitmw.HeaderAttempts] = int64(attempts)
	setIfAbsent(h, HeaderOriginalExchange, d.Exchange)
	setIfAbsent(h, HeaderOriginalRoutingKey, d.RoutingKey)
	h[HeaderOriginalQueue] = queue
	h[HeaderFailedAt] = at.UTC().Truncate(time.Second)
	h[HeaderHost] = host
	h[HeaderProcess] = process
	return h
}

// delayHeaders returns the headers of the copy of d, from work queue
// queue, sent to a delay queue: all of d's, the attempt count of dec when a
// layer counted one, the original exchange and routing key at the first
// hop, and HeaderNotBefore when notBefore is not zero (removed otherwise).
// An x-death not in RabbitMQ's form moves to HeaderMalformedXDeath; the
// records of one in that form that name queue move to HeaderDeaths. It
// does not modify d.
func delayHeaders(d *amqp.Delivery, dec rabbitmw.Decision, queue string, notBefore time.Time) amqp.Table {
	h := make(amqp.Table, len(d.Headers)+4)
	maps.Copy(h, d.Headers)
	if dec.Attempts > 0 {
		h[rabbitmw.HeaderAttempts] = int64(dec.Attempts)
	}
	setIfAbsent(h, HeaderOriginalExchange, d.Exchange)
	setIfAbsent(h, HeaderOriginalRoutingKey, d.RoutingKey)
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

// mergeDeaths returns the x-death records of newer, then those of older
// with a queue and reason that none of newer's has. A record of newer with
// the queue and reason of one of older is replaced by that older one, its
// count the sum of both (a record without a count counts 1): RabbitMQ
// keeps the first record of a queue and reason, time and all, and counts
// the later dead-letterings in it. Both must be in RabbitMQ's form of
// x-death; neither is modified.
func mergeDeaths(newer, older []any) []any {
	out := make([]any, 0, len(newer)+len(older))
	merged := make([]bool, len(older))
	for _, d := range newer {
		r := d.(amqp.Table)
		for i, o := range older {
			e := o.(amqp.Table)
			if !merged[i] && e["queue"] == r["queue"] && e["reason"] == r["reason"] {
				merged[i] = true
				c := maps.Clone(e)
				c["count"] = deathCount(e) + deathCount(r)
				d = c
				break
			}
		}
		out = append(out, d)
	}
	for i, o := range older {
		if !merged[i] {
			out = append(out, o)
		}
	}
	return out
}

// deathCount returns the count of x-death record r, in RabbitMQ's form: 1
// if it has none.
func deathCount(r amqp.Table) int64 {
	if n, ok := r["count"].(int64); ok {
		return n
	}
	return 1
}

// wellFormedXDeath reports whether v has the form RabbitMQ gives x-death,
// which it relies on when it dead-letters the message again: an array of
// tables, each with a long (int64) count, strings for queue, reason and
// exchange, a timestamp for time, and an array of strings for
// routing-keys, where present.
func wellFormedXDeath(v any) bool {
	entries, ok := v.([]any)
	if !ok {
		return false
	}
	for _, e := range entries {
		t, ok := e.(amqp.Table)
		if !ok {
			return false
		}
		if c, ok := t["count"]; ok {
			if n, ok := c.(int64); !ok || n < 0 {
				return false
			}
		}
		for _, k := range []string{"queue", "reason", "exchange"} {
			if x, ok := t[k]; ok {
				if _, ok := x.(string); !ok {
					return false
				}
			}
		}
		if x, ok := t["time"]; ok {
			if _, ok := x.(time.Time); !ok {
				return false
			}
		}
		if x, ok := t["routing-keys"]; ok {
			keys, ok := x.([]any)
			if !ok {
				return false
			}
			for _, k := range keys {
				if _, ok := k.(string); !ok {
					return false
				}
			}
		}
	}
	return true
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
// [asPublished] gives them back to the delivery a handler sees. msg's
// headers may be modified.
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
	return msg
}

// asPublished gives d, delivered from a work queue, the fields it had when
// first delivered, which the copies that brought it back (from a delay
// queue, or replayed from the dead-letter queue) changed: Exchange and
// RoutingKey from HeaderOriginalExchange and HeaderOriginalRoutingKey,
// and the properties that [asCopy] keeps in headers. A header of another
// type, or a property d carries itself, is left alone.
func asPublished(d *amqp.Delivery) {
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

func setIfAbsent(h amqp.Table, k string, v any) {
	if _, ok := h[k]; !ok {
		h[k] = v
	}
}
