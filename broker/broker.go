package broker

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
	"github.com/rabbitmw/rabbitmw/internal/clock"
)

// Errors reported by the package. Each is wrapped with detail; test for them
// with errors.Is.
var (
	// ErrNacked reports a publish that the server refused with a basic.nack
	// (for example a queue at its length limit with overflow reject-publish).
	ErrNacked = transport.ErrNacked
	// ErrUnroutable reports a publish that reached no queue: no queue is bound
	// for its routing key, or its exchange does not exist.
	ErrUnroutable = transport.ErrUnroutable
	// ErrConsumerCancelled reports that the server cancelled a consumer,
	// typically because its queue was deleted. Consume returns it, wrapped
	// with the queue name.
	ErrConsumerCancelled = errors.New("broker: consumer cancelled by the server")
	// ErrClosed is returned by the methods of a Broker after Close, and by
	// its dials to a brokertest server after the server's Close.
	ErrClosed = transport.ErrClosed
	// ErrConnectionLost reports a connection or channel that closed under an
	// operation. Operations that can be retried are retried on a new
	// connection; the error reaches the caller only joined to the context's.
	ErrConnectionLost = transport.ErrConnectionLost
	// ErrUnreachable reports a failure to connect that may be temporary: the
	// server is down, the network fails, the handshake times out.
	ErrUnreachable = transport.ErrUnreachable
	// ErrAccessRefused reports a connection refused for its credentials or
	// virtual host. It is fatal: retrying cannot help.
	ErrAccessRefused = errors.New("broker: access refused")
	// ErrCertificate reports a TLS handshake that failed on a
	// certificate: the server's is not signed by a CA that Options.TLS
	// trusts (or the system's, without it), or not for the server's
	// name; or the server refused the client's. It is fatal: retrying
	// cannot help (on a cluster, once no node answered: see NewCluster).
	ErrCertificate = errors.New("broker: TLS certificate refused")
	// ErrQueueNotFound reports a queue that does not exist (with
	// DeclareNone or DeclareSupport, or for Len and Get).
	ErrQueueNotFound = errors.New("broker: queue not found")
	// ErrQueueArguments reports a queue that exists with other arguments than
	// the ones the topology declares (RabbitMQ's 406 PRECONDITION_FAILED).
	ErrQueueArguments = errors.New("broker: queue exists with other arguments")
	// ErrExchangeNotFound reports an exchange that does not exist: one
	// that DeclareSupport checks, or one that a binding names.
	ErrExchangeNotFound = errors.New("broker: exchange not found")
	// ErrExchangeArguments reports an exchange that exists with another
	// kind, other settings or other arguments than the topology declares.
	ErrExchangeArguments = errors.New("broker: exchange exists with other settings")
	// ErrInvalidMessage reports a message that cannot be sent as it is: a
	// property, name or header that AMQP 0-9-1 cannot carry, or that
	// amqp091 could not read back. It is refused before anything is sent,
	// and trying again cannot help; the error names the field and the
	// limit.
	ErrInvalidMessage = transport.ErrInvalidMessage
	// ErrShutdownTimeout reports handlers that had not returned when the
	// shutdown deadline (ConsumeOptions.ShutdownTimeout) and a short grace
	// had passed.
	ErrShutdownTimeout = errors.New("broker: shutdown timed out")
)

// Options configures a Broker. The zero value selects the defaults noted on
// each field. A Broker keeps its own copy: changing Options after New has no
// effect.
type Options struct {
	// Logger receives the broker's records: connection state changes at
	// Info, retries and failed settlements at Warn, panics at Error. Nil
	// discards them.
	//
	// Each dead-letter is logged once, where it is decided. A dead-letter
	// that the handler's result asks for is the record of the chain's
	// middleware.Log layer (at Error, with the handler's error), so the
	// broker logs its copy to the dead-letter queue at Debug only; a chain
	// without a Log layer therefore logs no record of it above Debug (the
	// Observer still sees it). A dead-letter that the broker decides itself
	// is logged by the broker, at Warn (a not-before header too far ahead,
	// a delay copy that cannot be sent) or Error (a panic that escaped the
	// chain, a dead-letter copy that cannot be sent).
	Logger *slog.Logger
	// ReconnectMin and ReconnectMax bound the backoff between connection
	// attempts: the n-th wait is drawn uniformly from [0, min(ReconnectMax,
	// ReconnectMin*2^n)] ("full jitter"). Defaults 100ms and 30s.
	ReconnectMin, ReconnectMax time.Duration
	// Heartbeat is the AMQP heartbeat interval; a dead peer is detected
	// after about two intervals. Default 10s. It does not apply to a
	// brokertest server.
	Heartbeat time.Duration
	// Host and Process identify this consumer in the fault headers of
	// dead-lettered messages ([HeaderHost], [HeaderProcess]). Defaults:
	// os.Hostname(), and "<executable base name>[<pid>]".
	Host    string
	Process string
	// KeepEmptyMessageID makes Publish send a message without a
	// MessageId as it is, instead of giving it a random one. Consumers then
	// key it by its body (middleware.Key), as hand-written consumers do:
	// two messages with the same body are one message.
	KeepEmptyMessageID bool
	// Observer receives the Broker's events, and those of its consumers.
	Observer Observer
	// ConnectionName names the Broker's connections on the server (the
	// client property connection_name, shown by `rabbitmqctl
	// list_connections client_properties` and in the management UI).
	// Each connection's name is ConnectionName, what it is for ("consume
	// <queue>", "dlq"; nothing for the connection that Publish shares),
	// and Process in brackets. Default "rabbitmw".
	ConnectionName string
	// TLS configures the TLS of "amqps://" URLs: the CAs to trust
	// (RootCAs), the client certificate (Certificates), the server name
	// (ServerName; by default the URL's host). Nil selects the system's
	// roots and no client certificate. The Broker uses a copy of it.
	TLS *tls.Config
	// ExternalAuth authenticates with SASL EXTERNAL instead of the URL's
	// user name and password: by the client certificate that TLS
	// presents. RabbitMQ needs the rabbitmq_auth_mechanism_ssl plugin, and
	// a user named as its ssl_cert_login_from setting says (the
	// certificate's distinguished name, or its common name).
	ExternalAuth bool
}

// config is Options with the defaults resolved.
type config struct {
	log          *slog.Logger
	rmin, rmax   time.Duration
	heartbeat    time.Duration
	host         string
	process      string
	keepNoID     bool
	obs          Observer
	connName     string
	tls          *tls.Config // nil: amqp091's default
	external     bool
	serverString string // set by the transport, for logs
}

const (
	// retryHeadroom is what a message that Publish sends, and a copy sent
	// to a delay queue, must leave free of a frame: room for the headers
	// added when it is retried or dead-lettered (the fault headers, an
	// error text of up to 4 KiB among them, the first failure's of up to
	// 512 bytes that a delay copy carries, and RabbitMQ's x-death and
	// x-delivery-count).
	retryHeadroom = 8 << 10

	defaultReconnectMin = 100 * time.Millisecond
	defaultReconnectMax = 30 * time.Second
	defaultHeartbeat    = 10 * time.Second
)

func (o Options) resolve() config {
	c := config{
		log:       o.Logger,
		rmin:      o.ReconnectMin,
		rmax:      o.ReconnectMax,
		heartbeat: o.Heartbeat,
		host:      o.Host,
		process:   o.Process,
		keepNoID:  o.KeepEmptyMessageID,
		obs:       o.Observer,
		connName:  o.ConnectionName,
		external:  o.ExternalAuth,
	}
	if o.TLS != nil {
		c.tls = o.TLS.Clone()
	}
	if c.connName == "" {
		c.connName = "rabbitmw"
	}
	switch {
	case c.rmin < 0, c.rmax < 0, c.heartbeat < 0:
		panic("broker: Options: negative duration")
	case c.rmin > 0 && c.rmax > 0 && c.rmin > c.rmax:
		panic("broker: Options: ReconnectMin exceeds ReconnectMax")
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	if c.rmin == 0 {
		c.rmin = defaultReconnectMin
		if c.rmax > 0 && c.rmax < c.rmin {
			c.rmin = c.rmax
		}
	}
	if c.rmax == 0 {
		c.rmax = max(defaultReconnectMax, c.rmin)
	}
	if c.heartbeat == 0 {
		c.heartbeat = defaultHeartbeat
	}
	if c.host == "" {
		c.host, _ = os.Hostname()
	}
	if c.process == "" {
		exe, err := os.Executable()
		if err != nil || exe == "" {
			exe = os.Args[0]
		}
		c.process = filepath.Base(exe) + "[" + strconv.Itoa(os.Getpid()) + "]"
	}
	return c
}

// A Broker publishes to and consumes from one RabbitMQ server, a cluster
// of them ([NewCluster]), or an in-memory server of package brokertest.
// It is safe for concurrent use.
//
// Publish and the inspection methods (Declare, Len, Get, Delete) share one
// connection, made when first needed and made again after it is lost; when
// the connection is lost under one of them, or the server cannot be
// reached, they try again with backoff until their ctx is done. Each
// Consume call has a connection of its own.
type Broker struct {
	tr  transport.Transport
	cfg config

	// sem guards sess and closed. It is a channel rather than a mutex so that
	// a caller waiting for another's dial can give up when its ctx is done.
	sem    chan struct{}
	sess   session
	closed bool
}

// New returns a Broker for the RabbitMQ server at url, an AMQP URI such as
// "amqp://guest:guest@127.0.0.1:5672/" ("amqps://" for TLS, configured by
// Options.TLS; [NewCluster] for several nodes). It does no
// I/O: connections are made when Publish, Consume or another method needs
// one. A malformed url is reported by the first of those calls.
//
// A url of the form "memory://<n>" names an in-memory server of this
// process, made for tests by
// [github.com/rabbitmw/rabbitmw/broker/brokertest.NewServer]; once that
// server is closed, or if there is none by that URL, connecting fails with
// an error wrapping ErrClosed.
//
// New panics if opts holds a negative duration or a ReconnectMin above
// ReconnectMax.
func New(url string, opts Options) *Broker {
	cfg := opts.resolve()
	if strings.HasPrefix(url, transport.MemoryScheme) {
		return newBroker(transport.Lookup(url), cfg)
	}
	return newBroker(newAMQPTransport(url, cfg), cfg)
}

func newBroker(tr transport.Transport, cfg config) *Broker {
	cfg.serverString = tr.String()
	return &Broker{tr: tr, cfg: cfg, sem: make(chan struct{}, 1)}
}

// Close closes the connection used by Publish and the inspection methods;
// later calls of those return ErrClosed. Deliveries obtained with Get and not
// yet settled return to their queue. Consume calls are not affected: each
// ends when its context is cancelled. Close is idempotent.
func (b *Broker) Close() error {
	b.sem <- struct{}{}
	defer func() { <-b.sem }()
	b.closed = true
	if b.sess == nil {
		return nil
	}
	s := b.sess
	b.sess = nil
	return s.Close()
}

// shared returns the shared session, dialling it if there is none or the last
// one was lost.
func (b *Broker) shared(ctx context.Context) (session, error) {
	select {
	case b.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-b.sem }()
	if b.closed {
		return nil, ErrClosed
	}
	if b.sess != nil {
		select {
		case <-b.sess.Closed():
			_ = b.sess.Close()
			b.sess = nil
		default:
			return b.sess, nil
		}
	}
	s, err := b.dial(ctx, "", "")
	if err != nil {
		return nil, err
	}
	b.sess = s
	return s, nil
}

// retryable reports whether an operation that failed with err may be tried
// again on a new connection.
func retryable(err error) bool {
	return errors.Is(err, ErrConnectionLost) || errors.Is(err, ErrUnreachable)
}

// do runs f on the shared session, on a new one after a lost connection, with
// backoff, until f succeeds, fails for good, or ctx is done.
func (b *Broker) do(ctx context.Context, op string, f func(session) error) error {
	bo := newBackoff(b.cfg.rmin, b.cfg.rmax)
	var last error // the last retryable failure
	for {
		s, err := b.shared(ctx)
		if err == nil {
			err = f(s)
			if err == nil {
				return nil
			}
		}
		if retryable(err) {
			last = err
		}
		if ctx.Err() != nil && (retryable(err) || errors.Is(err, ctx.Err())) {
			if last == nil {
				return fmt.Errorf("broker: %s: %w", op, ctx.Err())
			}
			return fmt.Errorf("broker: %s: %w (last error: %w)", op, ctx.Err(), last)
		}
		if !retryable(err) {
			return err
		}
		d := bo.next()
		b.cfg.obs.reconnect("", err, d)
		b.cfg.log.LogAttrs(ctx, slog.LevelWarn, "broker: "+op+" failed; retrying",
			slog.String("server", b.cfg.serverString),
			slog.String("error", err.Error()),
			slog.Duration("retry_in", d))
		if clock.Sleep(ctx, d) != nil {
			return fmt.Errorf("broker: %s: %w (last error: %w)", op, ctx.Err(), last)
		}
	}
}

// Publish publishes msg to exchange with routing key key, with publisher
// confirms and the mandatory flag, and returns once the server has taken
// responsibility for it (nil), refused it (an error wrapping ErrNacked),
// or returned it because no queue was bound for it (ErrUnroutable; so is a
// publish to an exchange that does not exist). An unroutable message is an
// error, never a silent drop.
//
// A DeliveryMode of 0 is sent as amqp.Persistent, and an empty MessageId
// gets a random one of 32 hex digits; msg is otherwise sent as given. The
// caller's msg is not modified.
//
// If the connection is lost before the confirm arrives, Publish connects
// again, with backoff, and publishes the message again, until ctx is done.
// The message may then reach its queue twice: the server may have taken
// the first copy even though its confirm was lost. Both copies carry the
// same MessageId, by which the consumers' Dedup layer absorbs the second.
// When ctx is done first, Publish returns an error wrapping ctx.Err(); the
// message may or may not have been delivered.
//
// A message that cannot be sent as it is fails at once with an error
// wrapping ErrInvalidMessage, before anything is sent and without touching
// the connection: an exchange, routing key or short-string property
// (MessageId, CorrelationId, ReplyTo, Type, AppId, UserId, ContentType,
// ContentEncoding, Expiration) over 255 bytes; an Expiration that RabbitMQ
// refuses by closing the channel (not a whole number of milliseconds in
// decimal, negative, or over ten years); a CC or BCC header that is not an
// array of strings (RabbitMQ refuses one of another type by closing the
// channel, and skips an element that is not a string, so that the message
// misses a queue); a header value of a type
// amqp091 does not send (it sends bool, int8, uint8, int16, uint16,
// int32, uint32, int64, float32, float64, amqp.Decimal, string, []byte,
// time.Time, amqp.Table, []any and nil; an int only within 32 bits), a
// header name over 255 bytes, or tables and arrays nested more than 32
// deep or holding more than 8192 entries, which amqp091 cannot read back;
// properties and headers that leave less than 8 KiB of the server's frame
// (frame_max, 128 KiB by default) free, for the headers added when the
// message is retried or dead-lettered.
//
// A publish the server refuses by closing the channel (a UserId that is not
// the connection's user, a body above the server's size limit, a missing
// write permission) fails with the server's error; publishes in flight on
// the same connection at that moment may fail with it too, since the server
// does not say which publish it refused.
//
// Publish is safe for concurrent use.
func (b *Broker) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) (err error) {
	if msg.DeliveryMode == 0 {
		msg.DeliveryMode = amqp.Persistent
	}
	if msg.MessageId == "" && !b.cfg.keepNoID {
		msg.MessageId = newMessageID()
	}
	if b.cfg.obs.Publish != nil {
		msg.Headers = maps.Clone(msg.Headers)
		if msg.Headers == nil {
			msg.Headers = amqp.Table{}
		}
		if done := b.cfg.obs.Publish(ctx, exchange, key, &msg); done != nil {
			defer func() { done(err) }()
		}
	}
	size, err := transport.CheckPublishing(exchange, key, msg)
	if err != nil {
		return err
	}
	return b.do(ctx, "publish", func(s session) error {
		if err := transport.FitFrame(size, s.MaxProperties(), retryHeadroom); err != nil {
			return err
		}
		return s.Publish(ctx, exchange, key, msg)
	})
}

// Declare declares the topology of queue as Consume does (see [Topology]),
// for a producer that wants the queues to exist before it publishes. It is
// idempotent.
func (b *Broker) Declare(ctx context.Context, queue string, t Topology) error {
	top, err := t.resolve(queue)
	if err != nil {
		return err
	}
	return b.do(ctx, "declare", func(s session) error {
		return top.declare(ctx, s)
	})
}

// Len returns the number of messages ready for delivery in queue (not
// counting those delivered and not yet settled). It returns an error
// wrapping ErrQueueNotFound if queue does not exist.
func (b *Broker) Len(ctx context.Context, queue string) (int, error) {
	var n int
	err := b.do(ctx, "len", func(s session) error {
		var err error
		n, err = s.Length(ctx, queue)
		return refusal(queue, err)
	})
	return n, err
}

// Get takes the message at the head of queue (basic.get) with manual
// acknowledgement: the caller must settle the returned delivery with Ack,
// Nack or Reject, on the Broker's shared connection; if that connection is
// lost or the Broker closed first, the message returns to the queue. ok is
// false when the queue is empty. Get is meant for tests and tools, not for
// consuming: use Consume.
func (b *Broker) Get(ctx context.Context, queue string) (d *amqp.Delivery, ok bool, err error) {
	err = b.do(ctx, "get", func(s session) error {
		var err error
		d, ok, err = s.Get(ctx, queue)
		return refusal(queue, err)
	})
	return d, ok, err
}

// Delete deletes queue, its dead-letter queue and its delay queues (the
// names that t gives; see [Topology]), with whatever messages they hold.
// Queues that do not exist are skipped. Consumers of a deleted queue are
// cancelled by the server: their Consume returns ErrConsumerCancelled.
func (b *Broker) Delete(ctx context.Context, queue string, t Topology) error {
	top, err := t.resolve(queue)
	if err != nil {
		return err
	}
	names := top.names()
	return b.do(ctx, "delete", func(s session) error {
		return s.Delete(ctx, names)
	})
}

// newMessageID returns 32 random hex digits.
func newMessageID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

// lostError wraps err as a lost connection, unless it already is one.
func lostError(err error) error {
	if err == nil || errors.Is(err, ErrConnectionLost) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrConnectionLost, err)
}
