// Package expose hands package deadletter the parts of package broker
// that it builds on and that broker does not export: a session of a
// Broker's own, and the broker's reading of a server's refusal and of a
// lost connection, the copies it publishes of a message, and the form it
// expects of x-death. Package broker sets each variable when it is
// initialised, so they are set before any package that imports broker
// runs.
package expose

import (
	"context"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

var (
	// Dial opens a session of the server of b, a *broker.Broker, that
	// the caller closes, named as the dead-letter operations'. It tries
	// again while the server is unreachable, until ctx is done.
	Dial func(ctx context.Context, b any) (transport.Session, error)
	// Refusal turns a server's 404 about queue into an error wrapping
	// broker.ErrQueueNotFound; other errors pass unchanged.
	Refusal func(queue string, err error) error
	// LostError wraps err as broker.ErrConnectionLost, unless it already
	// is one.
	LostError func(err error) error
	// AsCopy returns msg as every copy the broker makes goes (its
	// Expiration, UserId and a transient DeliveryMode kept in headers).
	AsCopy func(msg amqp.Publishing) amqp.Publishing
	// Republishing returns a persistent copy of d with headers h (which
	// it may modify), as the broker publishes every copy it makes.
	Republishing func(d *amqp.Delivery, h amqp.Table) amqp.Publishing
	// WellFormedXDeath reports whether v has the form RabbitMQ gives
	// x-death.
	WellFormedXDeath func(v any) bool
)
