// Package transport is what package broker runs on: a Transport makes
// Sessions with one server. Package broker implements it over AMQP for
// RabbitMQ; package brokertest implements it in memory, and registers its
// servers here (Register) for broker.New to find by their URL. Everything
// above a Session (reconnecting, topology, settlement, shutdown) is
// written once, in package broker.
//
// The errors of package broker that a Session reports are defined here,
// and package broker exports the same values.
package transport

import (
	"context"
	"fmt"
	"strconv"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Errors that a Transport or Session wraps. Package broker exports each
// under the same name and documents it there. Each names its type of
// failure (see rabbitmw.ErrorType).
var (
	ErrNacked         error = &sentinel{"broker: publish nacked by the server", "nacked"}
	ErrUnroutable     error = &sentinel{"broker: message unroutable", "unroutable"}
	ErrClosed         error = &sentinel{"broker: closed", "closed"}
	ErrConnectionLost error = &sentinel{"broker: connection lost", "connection_lost"}
	ErrUnreachable    error = &sentinel{"broker: server unreachable", "unreachable"}
	ErrInvalidMessage error = &sentinel{"broker: invalid message", "invalid_message"}
)

// A Transport makes sessions with one server.
type Transport interface {
	// Dial opens a session. Its errors wrap ErrUnreachable when trying
	// again later may help; any other error is fatal (bad credentials, a
	// malformed URL, a closed in-memory server). name labels the
	// connection on the server.
	Dial(ctx context.Context, name string) (Session, error)
	// String names the server for logs, without credentials.
	String() string
}

// A Session is one connection, with a channel for consuming and getting
// and a confirm-mode channel for publishing.
//
// Every method that takes a context returns when it is done, with
// ctx.Err(), even while it waits for the server's answer; what was sent
// may still take effect (a queue declared or deleted), and a message that
// a Get abandoned this way receives is given back to its queue.
//
// Errors: an operation interrupted by the loss of the session returns an
// error wrapping ErrConnectionLost; a refusal by the server (no such queue,
// other arguments, no permission) returns an *amqp.Error with Server set,
// possibly wrapped in a *QueueError naming the queue.
type Session interface {
	// Declare declares (or, when passive, checks) each queue in order,
	// and binds it as its spec says.
	Declare(ctx context.Context, specs []QueueSpec) error
	// DeclareExchanges declares (or, when passive, checks) each exchange
	// in order.
	DeclareExchanges(ctx context.Context, specs []ExchangeSpec) error
	// Consume sets the prefetch count (0: unlimited) and starts a consumer
	// with manual acks. The returned channel is closed when the consumer
	// is cancelled (by Cancel, after the deliveries already received have
	// been handed out) or the session is lost (at once; the server
	// requeues what was not settled).
	Consume(queue, tag string, prefetch int) (<-chan amqp.Delivery, error)
	// Cancel stops the consumer tag (basic.cancel).
	Cancel(tag string) error
	// Publish publishes msg with the mandatory flag and waits for the
	// server's confirm. It returns an error wrapping ErrUnroutable for a
	// returned message or a missing exchange, and ErrNacked for a nack.
	// Under a ctx that is done already it sends nothing, and returns
	// ctx.Err(). It refuses a message that cannot be sent
	// (CheckPublishing, or one whose properties and headers exceed
	// MaxProperties) with an error wrapping ErrInvalidMessage, sending
	// nothing.
	Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error
	// Node names the server of this session, for logs: host:port/vhost,
	// without credentials.
	Node() string
	// MaxProperties is the most bytes the properties and headers of a
	// message may take on this connection: its frame size less a frame's
	// header and end (0: no limit).
	MaxProperties() int
	// Get takes one message from queue with manual ack (basic.get).
	Get(ctx context.Context, queue string) (*amqp.Delivery, bool, error)
	// SyncGets returns once the server has processed what was sent so far
	// on the channel of Get, the acknowledgements of its messages among
	// them: a synchronous round trip on that channel. An ack that was
	// written is not done until then: if the connection drops first, the
	// server requeues the message.
	SyncGets(ctx context.Context) error
	// Length returns the number of ready messages in queue.
	Length(ctx context.Context, queue string) (int, error)
	// Delete deletes the queues; missing ones are skipped.
	Delete(ctx context.Context, queues []string) error
	// Closed is closed when the session is lost or closed: the connection
	// or either channel closed.
	Closed() <-chan struct{}
	// Reason says why, once Closed() is closed; it wraps ErrConnectionLost.
	Reason() error
	// Cancelled receives the tag of a consumer that the server cancelled.
	Cancelled() <-chan string
	// Close closes the connection; unsettled deliveries return to their
	// queues. When it returns, every goroutine the session started has
	// ended (the transport library's own goroutines may take a moment
	// more). It is idempotent.
	Close() error
}

// A QueueSpec is one queue to declare, or to check (Passive), and the
// bindings to make once it is declared.
type QueueSpec struct {
	Name     string
	Passive  bool
	Args     amqp.Table
	Bindings []BindingSpec
}

// A BindingSpec binds a queue to Exchange with routing key Key.
type BindingSpec struct {
	Exchange string
	Key      string
	Args     amqp.Table
}

// An ExchangeSpec is one exchange to declare, or to check (Passive).
type ExchangeSpec struct {
	Name       string
	Kind       string
	Durable    bool
	AutoDelete bool
	Internal   bool
	Passive    bool
	Args       amqp.Table
}

// An ExchangeError is a server refusal about one exchange: declaring or
// checking it, or binding a queue to it.
type ExchangeError struct {
	Exchange string
	// Binding is the binding refused, when the refusal is of a binding
	// of Queue to Exchange; nil when it is of the exchange itself.
	Binding *BindingSpec
	Queue   string
	Err     error
}

func (e *ExchangeError) Error() string {
	return "exchange " + strconv.Quote(e.Exchange) + ": " + e.Err.Error()
}
func (e *ExchangeError) Unwrap() error { return e.Err }

// A QueueError is a server refusal about one queue.
type QueueError struct {
	Queue string
	Err   error
}

func (e *QueueError) Error() string { return "queue " + strconv.Quote(e.Queue) + ": " + e.Err.Error() }
func (e *QueueError) Unwrap() error { return e.Err }

// MemoryScheme starts the URLs of the servers registered with Register.
const MemoryScheme = "memory://"

var registry = struct {
	sync.Mutex
	next    uint64
	servers map[string]Transport
}{servers: make(map[string]Transport)}

// Register makes t the server at a new URL, "memory://<n>", until
// Unregister, and returns the URL.
func Register(t Transport) string {
	registry.Lock()
	defer registry.Unlock()
	registry.next++
	url := MemoryScheme + strconv.FormatUint(registry.next, 10)
	registry.servers[url] = t
	return url
}

// Unregister forgets the server at url.
func Unregister(url string) {
	registry.Lock()
	defer registry.Unlock()
	delete(registry.servers, url)
}

// Lookup returns the server registered at url or, if there is none (it
// was unregistered, or never registered), a Transport whose every Dial
// fails with an error wrapping ErrClosed.
func Lookup(url string) Transport {
	registry.Lock()
	defer registry.Unlock()
	if t, ok := registry.servers[url]; ok {
		return t
	}
	return missing(url)
}

// missing is the Transport of a URL at which no server is registered.
type missing string

func (m missing) String() string { return string(m) }

func (m missing) Dial(context.Context, string) (Session, error) {
	return nil, fmt.Errorf("broker: no in-memory server at %s (closed, or never started): %w", string(m), ErrClosed)
}

// A sentinel is an error that names its type of failure.
type sentinel struct{ text, typ string }

func (e *sentinel) Error() string     { return e.text }
func (e *sentinel) ErrorType() string { return e.typ }
