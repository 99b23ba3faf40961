// Package rabbitmwtest provides utilities for testing handlers and layers
// without a broker, in the manner of net/http/httptest.
package rabbitmwtest

import (
	"fmt"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A Call is one settlement call received by a [Recorder].
type Call struct {
	Method   string // "ack", "nack" or "reject"
	Tag      uint64
	Multiple bool
	Requeue  bool
}

// String returns the call in a form fit for test failures, such as
// "nack(tag=3, requeue=true)".
func (c Call) String() string {
	switch c.Method {
	case "ack":
		return fmt.Sprintf("ack(tag=%d)", c.Tag)
	default:
		return fmt.Sprintf("%s(tag=%d, requeue=%t)", c.Method, c.Tag, c.Requeue)
	}
}

// A Recorder is an [amqp.Acknowledger] that records the calls it receives,
// so a test can check how a delivery was settled. Its zero value is ready to
// use; it is safe for concurrent use.
type Recorder struct {
	// Err, when not nil, is returned by every Ack, Nack and Reject, as a
	// closed channel would; the call is recorded all the same.
	Err error

	mu    sync.Mutex
	calls []Call
	tag   uint64
}

// NewRecorder returns a new Recorder.
func NewRecorder() *Recorder { return new(Recorder) }

// Deliver returns a delivery of msg as a consumer would receive it: with
// msg's properties, headers and body, the next delivery tag of r (from 1),
// and r as its Acknowledger.
func (r *Recorder) Deliver(msg amqp.Publishing) *amqp.Delivery {
	r.mu.Lock()
	r.tag++
	tag := r.tag
	r.mu.Unlock()
	return &amqp.Delivery{
		Acknowledger:    r,
		Headers:         msg.Headers,
		ContentType:     msg.ContentType,
		ContentEncoding: msg.ContentEncoding,
		DeliveryMode:    msg.DeliveryMode,
		Priority:        msg.Priority,
		CorrelationId:   msg.CorrelationId,
		ReplyTo:         msg.ReplyTo,
		Expiration:      msg.Expiration,
		MessageId:       msg.MessageId,
		Timestamp:       msg.Timestamp,
		Type:            msg.Type,
		UserId:          msg.UserId,
		AppId:           msg.AppId,
		DeliveryTag:     tag,
		Body:            msg.Body,
	}
}

// Ack records an ack.
func (r *Recorder) Ack(tag uint64, multiple bool) error {
	return r.record(Call{Method: "ack", Tag: tag, Multiple: multiple})
}

// Nack records a nack.
func (r *Recorder) Nack(tag uint64, multiple, requeue bool) error {
	return r.record(Call{Method: "nack", Tag: tag, Multiple: multiple, Requeue: requeue})
}

// Reject records a reject.
func (r *Recorder) Reject(tag uint64, requeue bool) error {
	return r.record(Call{Method: "reject", Tag: tag, Requeue: requeue})
}

func (r *Recorder) record(c Call) error {
	r.mu.Lock()
	r.calls = append(r.calls, c)
	r.mu.Unlock()
	return r.Err
}

// Calls returns the calls recorded so far, in order.
func (r *Recorder) Calls() []Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Call(nil), r.calls...)
}

// Settlement returns how the delivery with the given tag was settled, in
// the words of [github.com/rabbitmw/rabbitmw.Outcome], so far as a channel
// can tell them apart:
//
//   - "acked": an ack (the Ack or Duplicate outcome);
//   - "requeued": a nack or reject with requeue (Requeue, or Delay once its
//     delay is over);
//   - "dead-lettered": a nack or reject without requeue (DeadLetter). On a
//     real channel RabbitMQ routes such a message to the queue's
//     dead-letter exchange, and drops it if the queue has none;
//   - "unsettled": no call yet;
//   - "settled N times": more than one call for the tag, which is always a
//     bug.
func (r *Recorder) Settlement(tag uint64) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var found []Call
	for _, c := range r.calls {
		if c.Tag == tag {
			found = append(found, c)
		}
	}
	switch {
	case len(found) == 0:
		return "unsettled"
	case len(found) > 1:
		return fmt.Sprintf("settled %d times", len(found))
	}
	switch c := found[0]; {
	case c.Method == "ack":
		return "acked"
	case c.Requeue:
		return "requeued"
	default:
		return "dead-lettered"
	}
}
