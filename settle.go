package rabbitmw

import (
	"context"
	"errors"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/internal/clock"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// ErrDuplicate reports that a delivery's message was already processed. A
// handler result that wraps it settles as an acknowledgement: the duplicate
// is removed from the queue and nothing else happens. [middleware.Dedup]
// returns it for a message whose key is marked done.
var ErrDuplicate = errors.New("rabbitmw: duplicate delivery")

// ErrNoDelivery is returned by [Settle], and by layers, for a nil delivery.
var ErrNoDelivery = errors.New("rabbitmw: nil delivery")

// An Outcome is what settlement does with a delivery.
type Outcome int

// The outcomes, in the order [Decide] considers them. The zero Outcome is
// not valid.
const (
	Ack        Outcome = iota + 1 // acknowledge: the message was processed
	Duplicate                     // acknowledge: the message had already been processed
	Requeue                       // return the message to its queue for another attempt now
	Delay                         // return the message for another attempt no sooner than a delay
	DeadLetter                    // move the message to the dead-letter queue; never retry it
)

// String returns the outcome as a log would report it: "acked",
// "duplicate", "requeued", "delayed" or "dead-lettered".
func (o Outcome) String() string {
	switch o {
	case Ack:
		return "acked"
	case Duplicate:
		return "duplicate"
	case Requeue:
		return "requeued"
	case Delay:
		return "delayed"
	case DeadLetter:
		return "dead-lettered"
	}
	return "Outcome(" + fmt.Sprint(int(o)) + ")"
}

// A Decision is what a handler's result asks settlement to do.
type Decision struct {
	Outcome Outcome
	// Delay is, for the Delay outcome, the least time before the message
	// may be delivered again. It is zero for the other outcomes.
	Delay time.Duration
	// Attempts is the number of failed attempts of the message counted so
	// far, including this one, as recorded by [WithAttempts]; 0 if no
	// layer counted them.
	Attempts int
	// Err is the handler's result; nil for Ack.
	Err error
}

// Decide reads a handler's result by the settlement contract documented on
// [Handler]. It is the one place that contract is implemented: [Settle],
// [Settler], the broker package and the Log layer all call it.
//
// Markers made by [Permanent] and [RetryAfter] may wrap each other; the
// outermost one decides, so a layer nearer the settling code overrides the
// layers beneath it (Retry turns an inner RetryAfter into a dead-letter at
// its attempt limit, for example). An error with neither marker that wraps
// [ErrDuplicate] settles as Duplicate; any other error as Requeue. The
// marks of [WithAttempts] and [NotCounted] do not change the outcome.
// A [PanicError] whose value wraps ErrDuplicate is no duplicate: a panic
// is a failure, whatever its value.
func Decide(err error) Decision {
	if err == nil {
		return Decision{Outcome: Ack}
	}
	d := Decision{Outcome: Requeue, Err: err}
	var marked, duplicate bool
	read(err, &d, &marked, &duplicate)
	if !marked && duplicate {
		d.Outcome = Duplicate
	}
	return d
}

// read walks err's tree in the order errors.As does (depth first, each
// error before what it wraps) and records the first settlement marker,
// the first attempt count, and whether ErrDuplicate is in it. It is
// errors.As and errors.Is for these few types, without the reflection and
// the allocations that cost on every delivery. An ErrDuplicate beneath a
// [PanicError] does not count: a panic is a failure, whatever its value.
func read(err error, d *Decision, marked, duplicate *bool) {
	for err != nil {
		if _, ok := err.(*PanicError); ok && !*duplicate {
			var panicked bool // ErrDuplicate in the value is ignored
			read(errors.Unwrap(err), d, marked, &panicked)
			return
		}
		switch e := err.(type) {
		case marker:
			if !*marked {
				*marked = true
				d.Outcome, d.Delay = e.settle()
			}
		case *attemptsError:
			if d.Attempts == 0 {
				d.Attempts = e.n
			}
		}
		if !*duplicate {
			if err == ErrDuplicate {
				*duplicate = true
			} else if x, ok := err.(interface{ Is(error) bool }); ok && x.Is(ErrDuplicate) {
				*duplicate = true
			}
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				read(e, d, marked, duplicate)
			}
			return
		default:
			return
		}
	}
}

// marker is implemented by the errors that carry a settlement request.
// Decide finds the outermost one.
type marker interface {
	error
	settle() (Outcome, time.Duration)
}

// Permanent marks err as one that retrying cannot fix: the message is
// dead-lettered at once, with err as the reason. Permanent(nil) is nil. The
// returned error's text is err's, and it unwraps to err.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string                    { return text.Error(e.err) }
func (e *permanentError) Unwrap() error                    { return e.err }
func (e *permanentError) settle() (Outcome, time.Duration) { return DeadLetter, 0 }

// RetryAfter marks err as a failure to try again no sooner than d: the
// message is requeued and not delivered again before d has passed. A d of
// zero or less asks for an ordinary requeue. RetryAfter(nil, d) is nil. The
// returned error's text is err's, and it unwraps to err.
func RetryAfter(err error, d time.Duration) error {
	if err == nil {
		return nil
	}
	return &delayError{err: err, d: d}
}

type delayError struct {
	err error
	d   time.Duration
}

func (e *delayError) Error() string { return text.Error(e.err) }
func (e *delayError) Unwrap() error { return e.err }
func (e *delayError) settle() (Outcome, time.Duration) {
	if e.d <= 0 {
		return Requeue, 0
	}
	return Delay, e.d
}

// WithAttempts records on err that it ended failed attempt number n of its
// message (counting from 1). It does not change how err settles; it lets
// settlement and logging report the count, and lets the broker package
// carry it in the [HeaderAttempts] header of the message it requeues or
// dead-letters. WithAttempts(nil, n) is nil.
func WithAttempts(err error, n int) error {
	if err == nil {
		return nil
	}
	return &attemptsError{err: err, n: n}
}

type attemptsError struct {
	err error
	n   int
}

func (e *attemptsError) Error() string { return text.Error(e.err) }
func (e *attemptsError) Unwrap() error { return e.err }

// NotCounted marks err as a result that is not the message's failure: the
// message was not attempted, or was held back by something other than
// itself (a rate limit, an open circuit breaker, a full bulkhead), or its
// success could not be recorded. [middleware.Retry] does not count such a
// result as an attempt, so it never brings the message nearer to being
// dead-lettered; middleware.Dedup marks its busy, store-unavailable and
// lost-lease errors with it.
//
// The mark does not change how err settles: [Decide] reads the error
// beneath it, so NotCounted(err) is requeued at once, and
// RetryAfter(NotCounted(err), d) is delayed by d. A layer that holds
// messages back should ask for a delay, since a requeued message comes
// straight back. The mark holds wherever it is in an error's tree: an
// error that wraps a NotCounted error, or joins one, is not counted either
// ([IsNotCounted]), except beneath a [PanicError]: a panic is counted. NotCounted(nil) is nil. The returned error's text is
// err's, and it unwraps to err.
func NotCounted(err error) error {
	if err == nil {
		return nil
	}
	return &notCountedError{err}
}

type notCountedError struct{ err error }

func (e *notCountedError) Error() string { return text.Error(e.err) }
func (e *notCountedError) Unwrap() error { return e.err }

// IsNotCounted reports whether err, or any error in its tree, was marked by
// [NotCounted]; a mark beneath a [PanicError] (in the value of a panic)
// does not count, since a panic is a failed attempt whatever its value.
func IsNotCounted(err error) bool {
	for err != nil {
		switch e := err.(type) {
		case *notCountedError:
			return true
		case *PanicError:
			return false
		case interface{ Unwrap() error }:
			err = e.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range e.Unwrap() {
				if IsNotCounted(e) {
					return true
				}
			}
			return false
		default:
			return false
		}
	}
	return false
}

// Settle settles d on its own Acknowledger by [Decide](err): Ack and
// Duplicate acknowledge it, Requeue nacks it with requeue, DeadLetter rejects
// it without requeue, and Delay waits for the delay, then nacks it with
// requeue.
//
// Settle is for deliveries from a plain amqp091 channel; the broker package
// settles its own, and does more. Two limits follow from using only the
// channel:
//
//   - DeadLetter relies on the queue's dead-letter exchange
//     (x-dead-letter-exchange). A queue without one discards a rejected
//     message: declare one before relying on Permanent or on Retry's limit.
//   - Delay holds the delivery, and so one prefetch slot, for the whole
//     delay. If ctx is done first, Settle requeues the message at once and
//     returns ctx's error joined to the requeue's result.
//
// Settle waits out a Delay in the caller's goroutine, so it suits a
// goroutine per delivery, and tests. A loop that receives deliveries one by
// one must not wait: one busy message or one backoff would stall the whole
// consumer. Such a loop settles with a [Settler], which holds delayed
// deliveries off the loop.
//
// Settle returns the error of the Ack, Nack or Reject call, if any (for
// example [amqp.ErrClosed] when the channel is gone, in which case RabbitMQ
// redelivers the message). It must be called once per delivery.
func Settle(ctx context.Context, d *amqp.Delivery, err error) error {
	if d == nil {
		return ErrNoDelivery
	}
	dec := Decide(err)
	if dec.Outcome == Delay {
		if ctx == nil {
			ctx = context.Background()
		}
		if err := clock.Sleep(ctx, dec.Delay); err != nil {
			return settled(d, dec, errors.Join(err, d.Nack(false, true)))
		}
	}
	return settleNow(d, dec)
}

// settleNow settles d as dec asks, without waiting: a Delay whose time is
// up is a requeue.
func settleNow(d *amqp.Delivery, dec Decision) error {
	var err error
	switch dec.Outcome {
	case Ack, Duplicate:
		err = d.Ack(false)
	case Requeue, Delay:
		err = d.Nack(false, true)
	case DeadLetter:
		err = d.Reject(false)
	}
	return settled(d, dec, err)
}

// settled wraps the error of settling d, if any, with the delivery and the
// outcome.
func settled(d *amqp.Delivery, dec Decision, err error) error {
	if err != nil {
		return fmt.Errorf("rabbitmw: settle delivery %d as %s: %w", d.DeliveryTag, dec.Outcome, err)
	}
	return nil
}
