package broker

import (
	"context"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
)

// An Observer receives a Broker's events, for traces and metrics. Every
// field is optional: a nil one costs nothing. The funcs are called on the
// goroutine of the event and must be quick and safe for concurrent use.
type Observer struct {
	// Publish, if set, is called by [Broker.Publish] before it sends msg,
	// with the caller's context. It may add headers to msg.Headers (a
	// copy of the caller's table, never nil), which is how a tracing
	// layer injects its trace context. It returns a func, or nil, that
	// Publish calls once with its result when it returns.
	Publish func(ctx context.Context, exchange, key string, msg *amqp.Publishing) (done func(error))
	// Republish, if set, is called after a consumer published the copy
	// of a delivery that settles it as Delay or DeadLetter, with the
	// result of that publish.
	Republish func(ctx context.Context, e RepublishEvent)
	// Reconnect, if set, is called when a connection was lost or could
	// not be made, before the wait for the next attempt.
	Reconnect func(e ReconnectEvent)
	// Connect, if set, is called when a connection is made, with the
	// node it is on.
	Connect func(e ConnectEvent)
	// Ack, if set, is called after a consumer sent a basic.ack, which may
	// settle several deliveries at once (see Acks in the package documentation).
	Ack func(e AckEvent)
	// PublishChannel, if set, is called when a connection replaced its
	// publish channel after the server nacked publishes on it, or tried to
	// and could not open a new one (see Publishing in the package
	// documentation). Replacements that come again and again mean a queue
	// that refuses publishes (a length limit with reject-publish, a quorum
	// queue without a majority), not a channel stuck after an election.
	PublishChannel func(e PublishChannelEvent)
}

// A PublishChannelEvent is a publish channel replaced after nacks, or a
// replacement that failed.
type PublishChannelEvent struct {
	// Node names the server: host:port/vhost, without credentials.
	Node string
	// Connection is the connection's name, as the server shows it.
	Connection string
	// Nacks is the number of publishes the server nacked on the channel
	// replaced (or kept).
	Nacks int
	// Err is nil when the channel was replaced; otherwise why a new one
	// could not be opened, and the nacked channel stays in use.
	Err error
}

// An AckEvent is a basic.ack sent by a consumer.
type AckEvent struct {
	// Queue is the queue consumed.
	Queue string
	// Deliveries is the number of deliveries the ack settled: more than
	// one for a multiple ack.
	Deliveries int
	// Err is the error of sending it: its deliveries are then redelivered.
	Err error
}

// A RepublishEvent is a copy of a delivery published by a consumer to
// settle it (see Copies that fail in the package documentation).
type RepublishEvent struct {
	// Outcome is rabbitmw.Delay or rabbitmw.DeadLetter.
	Outcome rabbitmw.Outcome
	// Queue is the queue consumed, and To the queue the copy went to: a
	// delay queue or the dead-letter queue.
	Queue, To string
	// Delay is, for Delay, the delay asked for.
	Delay time.Duration
	// ErrorType is, for DeadLetter, the [HeaderErrorType] of the copy.
	ErrorType string
	// Err is nil when the server confirmed the copy; otherwise the
	// delivery was requeued instead.
	Err error
	// Delivery is the delivery settled. It must not be modified nor kept.
	Delivery *amqp.Delivery
}

// A ConnectEvent is a connection made.
type ConnectEvent struct {
	// Queue is the queue of the consumer whose connection it is; empty
	// for the connection that Publish and the inspection methods share,
	// and for a dead-letter operation's.
	Queue string
	// Node names the server: host:port/vhost, without credentials.
	Node string
}

// A ReconnectEvent is a lost connection, or one that could not be made.
type ReconnectEvent struct {
	// Queue is the queue of the consumer whose connection it was; empty
	// for the connection that Publish and the inspection methods share.
	Queue string
	// Err says what happened.
	Err error
	// Wait is how long the broker waits before it tries again.
	Wait time.Duration
}

func (o *Observer) republish(ctx context.Context, e RepublishEvent) {
	if o.Republish != nil {
		o.Republish(ctx, e)
	}
}

func (o *Observer) reconnect(queue string, err error, wait time.Duration) {
	if o.Reconnect != nil {
		o.Reconnect(ReconnectEvent{Queue: queue, Err: err, Wait: wait})
	}
}

func (o *Observer) connect(queue, node string) {
	if o.Connect != nil {
		o.Connect(ConnectEvent{Queue: queue, Node: node})
	}
}

func (o *Observer) publishChannel(e PublishChannelEvent) {
	if o != nil && o.PublishChannel != nil {
		o.PublishChannel(e)
	}
}
