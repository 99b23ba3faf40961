package broker

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
)

// asPublished gives a delivery back the fields that its copies changed,
// from the headers they keep them in, and leaves alone what is malformed
// or carried by the delivery itself.
func TestAsPublished(t *testing.T) {
	first := amqp.Delivery{
		Exchange: "events", RoutingKey: "order.created", UserId: "alice", Expiration: "4000",
		DeliveryMode: amqp.Transient, MessageId: "m", Headers: amqp.Table{"k": "v"},
	}
	copied := republishing(&first, delayHeaders(&first, rabbitmw.Decision{Outcome: rabbitmw.Delay}, "orders", time.Time{}))
	hop := amqp.Delivery{ // the copy, back from the delay queue
		Exchange: "", RoutingKey: "orders", Headers: copied.Headers, UserId: copied.UserId,
		Expiration: copied.Expiration, DeliveryMode: copied.DeliveryMode, MessageId: copied.MessageId,
	}
	view := func(d amqp.Delivery) []any {
		return []any{d.Exchange, d.RoutingKey, d.UserId, d.Expiration, d.DeliveryMode}
	}
	cases := []struct {
		name string
		d    amqp.Delivery
		want []any
	}{
		{"first delivery", first, view(first)},
		{"back from a delay queue", hop, view(first)},
		{"no headers", amqp.Delivery{RoutingKey: "orders", DeliveryMode: 2}, []any{"", "orders", "", "", uint8(2)}},
		{"malformed headers", amqp.Delivery{RoutingKey: "orders", DeliveryMode: 2, Headers: amqp.Table{
			HeaderOriginalExchange: []byte("events"), HeaderOriginalRoutingKey: "order.created",
			HeaderUserID: int32(1), HeaderOriginalExpiration: int64(4000), HeaderOriginalDeliveryMode: int64(7),
		}}, []any{"", "orders", "", "", uint8(2)}},
		{"another queue's copy, forwarded by a producer with its headers", amqp.Delivery{
			Exchange: "billing", RoutingKey: "invoice.paid", DeliveryMode: 2, Headers: copied.Headers,
		}, []any{"billing", "invoice.paid", "", "", uint8(2)}},
		{"properties the delivery carries", amqp.Delivery{RoutingKey: "orders", UserId: "bob", Expiration: "9", DeliveryMode: 1, Headers: amqp.Table{
			HeaderUserID: "alice", HeaderOriginalExpiration: "4000", HeaderOriginalDeliveryMode: int64(0),
		}}, []any{"", "orders", "bob", "9", uint8(1)}},
	}
	for _, c := range cases {
		d := c.d
		asPublished(&d, "orders")
		assert.Equal(t, c.want, view(d), c.name)
	}
}

// A session that is open until closed is closed.
type openSession struct {
	session
	closed chan struct{}
}

func (s openSession) Closed() <-chan struct{} { return s.closed }

// recordingAcker records the settlements made through it.
type recordingAcker struct{ calls []string }

func (a *recordingAcker) Ack(tag uint64, multiple bool) error {
	a.calls = append(a.calls, fmt.Sprintf("ack %d multiple=%t", tag, multiple))
	return nil
}

func (a *recordingAcker) Nack(tag uint64, multiple, requeue bool) error {
	a.calls = append(a.calls, fmt.Sprintf("nack %d multiple=%t requeue=%t", tag, multiple, requeue))
	return nil
}

func (a *recordingAcker) Reject(tag uint64, requeue bool) error {
	a.calls = append(a.calls, fmt.Sprintf("reject %d requeue=%t", tag, requeue))
	return nil
}

// A delivery whose copy failed is requeued, after requeueBackoff, if the
// copy is known not to be in its queue: not sent (its context was done
// before), nacked or returned by the server. If the copy's fate is
// unknown (the session was lost, or its context ended, before the
// confirm), it is left unsettled and the session given up: the server
// redelivers it, and it is not requeued beside a copy that may exist.
func TestCopyFailed(t *testing.T) {
	requeued := []string{"nack 7 multiple=false requeue=true"}
	for _, c := range []struct {
		name    string
		err     error
		settled []string // the delivery's settlements
		givenUp bool
	}{
		{"not sent, its context done", fmt.Errorf("%w: %w", errNotSent, context.DeadlineExceeded), requeued, false},
		{"not sent, its context cancelled", fmt.Errorf("%w: %w", errNotSent, context.Canceled), requeued, false},
		{"nacked", fmt.Errorf("%w: exchange %q, routing key %q", ErrNacked, "", "q.dlq"), requeued, false},
		{"returned", fmt.Errorf("%w: exchange %q, routing key %q", ErrUnroutable, "", "q.dlq"), requeued, false},
		{"session lost", fmt.Errorf("%w: publish channel closed", ErrConnectionLost), nil, true},
		{"no confirm in time", context.DeadlineExceeded, nil, true},
		{"context cancelled", context.Canceled, nil, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				cn := newConn(&consumer{log: slog.New(slog.DiscardHandler)}, openSession{closed: make(chan struct{})}, nil, nil)
				rec := &recordingAcker{}
				d := &amqp.Delivery{Acknowledger: rec, DeliveryTag: 7, MessageId: "m"}
				begin := time.Now()
				err := cn.copyFailed(context.Background(), d, failedCopy{"dead-letter", "q.dlq", c.err})
				assert.Equal(t, c.settled, rec.calls, "settlements")
				assert.Equal(t, c.givenUp, isClosed(cn.given), "session given up")
				if c.givenUp {
					require.ErrorIs(t, err, errUnsettled, "copyFailed")
					require.ErrorIs(t, cn.givenUp, ErrConnectionLost, "the reason the session was given up")
				} else {
					require.NoError(t, err, "copyFailed")
					assert.Equal(t, requeueBackoff, time.Since(begin), "pause before the requeue")
				}
			})
		})
	}
}
