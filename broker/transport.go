package broker

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A transport makes sessions with one server: RabbitMQ over AMQP
// (amqpTransport) or the in-memory server (memTransport). Everything above
// it (reconnecting, topology, settlement, shutdown) is written once, in
// terms of these two interfaces.
type transport interface {
	// dial opens a session. Its errors wrap ErrUnreachable when trying
	// again later may help; any other error is fatal (bad credentials, a
	// malformed URL, a closed Memory). name labels the connection on the
	// server.
	dial(ctx context.Context, name string) (session, error)
	// String names the server for logs, without credentials.
	String() string
}

// A session is one connection, with a channel for consuming and getting
// and a confirm-mode channel for publishing.
//
// Errors: an operation interrupted by the loss of the session returns an
// error wrapping ErrConnectionLost; a refusal by the server (no such queue,
// other arguments, no permission) returns an *amqp.Error with Server set,
// possibly wrapped in a *queueError naming the queue.
type session interface {
	// declare declares (or, when passive, checks) each queue in order.
	declare(ctx context.Context, specs []queueSpec) error
	// consume sets the prefetch count (0: unlimited) and starts a consumer
	// with manual acks. The returned channel is closed when the consumer
	// is cancelled (by cancel, after the deliveries already received have
	// been handed out) or the session is lost (at once; the server
	// requeues what was not settled).
	consume(queue, tag string, prefetch int) (<-chan amqp.Delivery, error)
	// cancel stops the consumer tag (basic.cancel).
	cancel(tag string) error
	// publish publishes msg with the mandatory flag and waits for the
	// server's confirm. It returns an error wrapping ErrUnroutable for a
	// returned message or a missing exchange, and ErrNacked for a nack.
	// Under a ctx that is done already it sends nothing, and returns
	// ctx.Err(). It refuses a message that cannot be sent
	// (checkPublishing, or one whose properties and headers exceed
	// maxProperties) with an error wrapping ErrInvalidMessage, sending
	// nothing.
	publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error
	// maxProperties is the most bytes the properties and headers of a
	// message may take on this connection: its frame size less a frame's
	// header and end (0: no limit).
	maxProperties() int
	// get takes one message from queue with manual ack (basic.get).
	get(ctx context.Context, queue string) (*amqp.Delivery, bool, error)
	// length returns the number of ready messages in queue.
	length(ctx context.Context, queue string) (int, error)
	// delete deletes the queues; missing ones are skipped.
	delete(ctx context.Context, queues []string) error
	// closed is closed when the session is lost or closed: the connection
	// or either channel closed.
	closed() <-chan struct{}
	// reason says why, once closed() is closed; it wraps ErrConnectionLost.
	reason() error
	// cancelled receives the tag of a consumer that the server cancelled.
	cancelled() <-chan string
	// close closes the connection; unsettled deliveries return to their
	// queues. When it returns, every goroutine the session started has
	// ended (the transport library's own goroutines may take a moment
	// more). It is idempotent.
	close() error
}
