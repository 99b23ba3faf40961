package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

const (
	dialTimeout      = 30 * time.Second // TCP connect
	handshakeTimeout = 30 * time.Second // TLS and AMQP handshakes
	closeTimeout     = 5 * time.Second  // the connection.close handshake
)

// amqpTransport connects to RabbitMQ with amqp091. Its connections have no
// automatic recovery (Config.Recovery is nil): amqp091's recovery reuses the
// Channel object, and a delivery tag from before a reconnect would then be
// acked on the new channel, closing it. The consumer reconnects by itself,
// and every session starts with fresh channels.
type amqpTransport struct {
	url       string
	uri       amqp.URI
	parseErr  error
	heartbeat time.Duration
	tls       *tls.Config // nil: amqp091's default
	external  bool
	log       *slog.Logger
	obs       *Observer
}

func newAMQPTransport(url string, cfg config) *amqpTransport {
	uri, err := amqp.ParseURI(url)
	return &amqpTransport{url: url, uri: uri, parseErr: err, heartbeat: cfg.heartbeat, tls: cfg.tls, external: cfg.external, log: cfg.log, obs: &cfg.obs}
}

// check returns the fatal error of a URL that no dial can use: one that
// is malformed, or one of amqp:// while Options.TLS or ExternalAuth asks
// for TLS, which would send the credentials unencrypted (or fail the
// EXTERNAL handshake each time): a typo, more likely than a wish.
func (t *amqpTransport) check() error {
	switch {
	case t.parseErr != nil:
		return fmt.Errorf("broker: malformed AMQP URL: %w", t.parseErr)
	case t.uri.Scheme == "amqp" && (t.tls != nil || t.external):
		return fmt.Errorf("broker: %s: the URL is amqp://, not amqps://, while Options.TLS or ExternalAuth asks for TLS: the connection would not be encrypted: write amqps://, or drop those options", t)
	}
	return nil
}

// String returns host:port/vhost, without credentials.
func (t *amqpTransport) String() string {
	if t.parseErr != nil {
		return "(malformed URL)"
	}
	return net.JoinHostPort(t.uri.Host, strconv.Itoa(t.uri.Port)) + "/" + strings.TrimPrefix(t.uri.Vhost, "/")
}

// Dial connects to the server and opens a session named name.
//
// amqp091 reports a socket closed after connection.start-ok without a
// reply as its ErrCredentials: RabbitMQ closes it so on wrong credentials
// (amqp091 does not ask for a connection.close there), and so does a
// network cut. One more handshake tells the two apart: credentials are
// refused only when both handshakes are.
func (t *amqpTransport) Dial(ctx context.Context, name string) (session, error) {
	s, err := t.dialOnce(ctx, name)
	if err != nil && errors.Is(err, amqp.ErrCredentials) && ctx.Err() == nil {
		s, err = t.dialOnce(ctx, name)
	}
	return s, err
}

func (t *amqpTransport) dialOnce(ctx context.Context, name string) (session, error) {
	if err := t.check(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	// Close the socket if ctx is done during the handshake, which amqp091
	// does not watch.
	var (
		mu  sync.Mutex
		raw net.Conn
	)
	stop := context.AfterFunc(ctx, func() {
		mu.Lock()
		defer mu.Unlock()
		if raw != nil {
			raw.Close()
		}
	})
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(name)
	var tlsConfig *tls.Config
	if t.tls != nil {
		tlsConfig = t.tls.Clone() // amqp091 writes ServerName into it
	}
	var sasl []amqp.Authentication
	if t.external {
		sasl = []amqp.Authentication{&amqp.ExternalAuth{}}
	}
	conn, err := amqp.DialConfig(t.url, amqp.Config{
		Heartbeat:       t.heartbeat,
		Properties:      props,
		TLSClientConfig: tlsConfig,
		SASL:            sasl,
		Dial: func(network, addr string) (net.Conn, error) {
			d := net.Dialer{Timeout: dialTimeout}
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			if err := c.SetDeadline(time.Now().Add(handshakeTimeout)); err != nil {
				c.Close()
				return nil, err
			}
			mu.Lock()
			raw = c
			mu.Unlock()
			return c, nil
		},
	})
	stopped := stop()
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %s: %w", ErrUnreachable, t, ctx.Err())
		}
		return nil, t.dialError(err)
	}
	if !stopped {
		// ctx was done, and the socket is being closed under us.
		conn.Close()
		return nil, fmt.Errorf("%w: %s: %w", ErrUnreachable, t, ctx.Err())
	}
	mu.Lock()
	socket := raw
	mu.Unlock()
	s, err := newAMQPSession(conn, socket, t.String(), name, t.log, t.obs)
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: %s: open channels: %w", ErrUnreachable, t, err)
	}
	return s, nil
}

// dialError classifies a failure to connect.
func (t *amqpTransport) dialError(err error) error {
	var (
		ve    *tls.CertificateVerificationError
		alert tls.AlertError
	)
	switch {
	case errors.As(err, &ve):
		return fmt.Errorf("%w: %s: the server's certificate is not trusted: give Options.TLS the CA that signed it (RootCAs) and the name it was issued for (ServerName): %w", ErrCertificate, t, err)
	case errors.As(err, &alert):
		return fmt.Errorf("%w: %s: the server refused the TLS handshake (check Options.TLS: the client certificate, and whether the server's CA signed it): %w", ErrCertificate, t, err)
	}
	if errors.Is(err, amqp.ErrVhost) {
		// amqp091's own value for a socket closed after connection.open
		// without a reply: the network failed. A vhost the server refuses
		// comes as its connection.close, a distinct *amqp.Error.
		return fmt.Errorf("%w: %s: the connection closed during the AMQP handshake: %w", ErrUnreachable, t, err)
	}
	var ae *amqp.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case amqp.AccessRefused:
			if t.external {
				return fmt.Errorf("%w: %s: SASL EXTERNAL: check the client certificate in Options.TLS, and that the server has a user named as the certificate: %w", ErrAccessRefused, t, err)
			}
			return fmt.Errorf("%w: %s: check the user name and password in the URL: %w", ErrAccessRefused, t, err)
		case amqp.NotAllowed:
			return fmt.Errorf("%w: %s: check the virtual host and the user's permissions: %w", ErrAccessRefused, t, err)
		}
	}
	return fmt.Errorf("%w: %s: %w", ErrUnreachable, t, err)
}

// amqpSession is a session on an amqp091 connection: a consume channel
// (con), a confirm-mode publish channel (pub, see pubChannel), and a
// channel for basic.get (getCh) opened when first needed; declare, length
// and delete use a short-lived channel each, so that the server's
// refusals (which close the channel they occur on) do not end the
// session.
//
// The publish channel is replaced, the session going on, when the server
// nacks a publish on it (see replaceInterval): RabbitMQ 3.10 can go on
// nacking every publish of a channel that published to a quorum queue
// whose leader died, for 30 s and more after a new leader is elected,
// while a new channel's publishes are confirmed at once. The consume
// channel, and its deliveries, are not touched.
//
// Its goroutines all end when the connection closes: watch, which ends
// the session (closes done) when the connection or con closes; one per
// publish channel (pubChannel.run), which resolves that channel's
// publishes, ends the session if the channel closes unasked, and ends
// when amqp091 closes its notify channels; and publisher, the only
// caller of Publish on a publish channel and the only one to replace it,
// which ends when done is closed; and one per call of the server whose
// caller has a context that can end (see await), which ends when the
// server answers or the connection closes.
//
// amqp091's Publish can block for long: on the channel's mutex, which it
// holds while it writes (behind another publish) and which the channel's
// shutdown holds; and on the socket, when the server stops reading (a
// resource alarm) or the network stops answering. PublishWithContext looks
// at its context only before it starts. So the callers of publish do not
// call it: they hand their message to the publisher goroutine and wait for
// the result or for their context, whichever comes first. A write that
// stays blocked ends when close closes the socket.
type amqpSession struct {
	conn     *amqp.Connection
	raw      net.Conn // the socket under conn
	node     string   // host:port/vhost
	name     string   // the connection's name, for logs
	log      *slog.Logger
	obs      *Observer // its PublishChannel; nil: none
	maxProps int       // see transport.Session.MaxProperties
	con      *amqp.Channel

	// pub is the publish channel in use, and retired the one it replaced,
	// if any, which is closed once its publishes are resolved. Both are
	// the publisher goroutine's own, after newAMQPSession.
	pub, retired *pubChannel

	done    chan struct{}
	endOnce sync.Once
	err     error // why done was closed; written before
	cancels chan string
	wg      sync.WaitGroup

	// requests hands a publish to the publisher goroutine. Unbuffered: a
	// publish handed over is being sent, and one not handed over can be
	// given up.
	requests chan *pendingPublish

	// pendMu guards byID, the settled flag of each publish, and the
	// publishes and state of each publish channel (see pubChannel), and
	// is only ever held briefly: never across a call of amqp091 that may
	// wait for its reader, which may be blocked handing a confirm to the
	// goroutine of a publish channel.
	pendMu sync.Mutex
	// byID holds the publish in flight for each message id. A basic.return
	// names its message only by its properties, so two publishes of one id
	// in flight at once could not be told apart: a publish waits until the
	// one before it with its id is resolved.
	byID map[string]*pendingPublish

	getMu sync.Mutex
	getCh *amqp.Channel

	// callMu guards closing, set by Close before it waits for wg: a call
	// of the server (see await) adds to wg only while closing is unset.
	callMu  sync.Mutex
	closing bool
}

func newAMQPSession(conn *amqp.Connection, raw net.Conn, node, name string, log *slog.Logger, obs *Observer) (*amqpSession, error) {
	s := &amqpSession{
		conn:     conn,
		raw:      raw,
		node:     node,
		name:     name,
		log:      log,
		obs:      obs,
		done:     make(chan struct{}),
		cancels:  make(chan string, 1),
		requests: make(chan *pendingPublish),
		byID:     make(map[string]*pendingPublish),
	}
	if n := conn.Config.FrameSize; n > 0 { // negotiated by now
		s.maxProps = n - transport.FrameOverhead
	}
	var err error
	if s.pub, err = s.openPub(); err != nil {
		return nil, err
	}
	if s.con, err = conn.Channel(); err != nil {
		return nil, err
	}
	// amqp091 sends to the NotifyClose channels without blocking (they hold
	// one value each), and closes them all when the connection closes.
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	conClosed := s.con.NotifyClose(make(chan *amqp.Error, 1))
	s.con.NotifyCancel(s.cancels)
	s.wg.Add(2)
	go s.watch(connClosed, conClosed)
	go s.publisher()
	s.pub.start()
	return s, nil
}

// watch ends the session when the connection or the consume channel
// closes. It ends then.
func (s *amqpSession) watch(connClosed, conClosed chan *amqp.Error) {
	defer s.wg.Done()
	select {
	case e := <-connClosed:
		s.end("connection", e)
	case e := <-conClosed:
		s.end("consume channel", e)
	}
}

// end ends the session, the first time it is called: what (the
// connection, or one of its channels) closed, for reason e (nil: closed
// without an error).
func (s *amqpSession) end(what string, e *amqp.Error) {
	s.endOnce.Do(func() {
		if e == nil {
			s.err = fmt.Errorf("%w: %s closed", ErrConnectionLost, what)
		} else {
			s.err = fmt.Errorf("%w: %s closed: %w", ErrConnectionLost, what, e)
		}
		close(s.done)
	})
}

// translate classifies an error of an amqp091 call: a server's refusal
// (a soft error: the channel closes, the connection stays) passes as is;
// anything else means the session is lost.
func (s *amqpSession) translate(err error) error {
	var ae *amqp.Error
	if errors.As(err, &ae) && ae.Server && ae.Recover {
		return err
	}
	select {
	case <-s.done:
		return s.err
	default:
	}
	return lostError(err)
}

func (s *amqpSession) Consume(queue, tag string, prefetch int) (<-chan amqp.Delivery, error) {
	if err := s.con.Qos(prefetch, 0, false); err != nil {
		return nil, s.translate(err)
	}
	d, err := s.con.Consume(queue, tag, false, false, false, false, nil)
	if err != nil {
		return nil, &queueError{Queue: queue, Err: s.translate(err)}
	}
	return d, nil
}

func (s *amqpSession) Cancel(tag string) error {
	return s.translate(s.con.Cancel(tag, false))
}

// withChannel runs f on a new channel, closed afterwards.
func (s *amqpSession) withChannel(f func(ch *amqp.Channel) error) error {
	ch, err := s.conn.Channel()
	if err != nil {
		return s.translate(err)
	}
	defer ch.Close()
	return f(ch)
}

// errCallerGone ends a call of the server between two of its methods once
// its caller has left (see await); nobody sees it.
var errCallerGone = errors.New("broker: the caller left")

// await runs f, calls of amqp091 that wait for the server's answers and
// watch no context, on a goroutine of its own, and waits for f no longer
// than ctx lets it: when ctx ends first, await returns ctx.Err(), and f
// goes on until the server answers or the connection closes (Close
// waits for it). f learns through gone that its caller left, so that a
// series of calls stops at the next one; a value f returns after that is
// handed to giveBack, if set, for a message got that nobody will settle.
// A ctx that can never end runs f on the caller's goroutine.
func await[T any](ctx context.Context, s *amqpSession, f func(gone func() bool) (T, error), giveBack func(T)) (T, error) {
	var zero T
	if err := ctx.Err(); err != nil {
		return zero, err
	}
	if ctx.Done() == nil {
		return f(func() bool { return false })
	}
	s.callMu.Lock()
	if s.closing {
		s.callMu.Unlock()
		return zero, fmt.Errorf("%w: session closed", ErrConnectionLost)
	}
	s.wg.Add(1)
	s.callMu.Unlock()

	// state: 0 while f runs and its caller waits; callerGone once the
	// caller left; returned once f's result went to the caller.
	const callerGone, returned = 1, 2
	var state atomic.Int32
	type result struct {
		v   T
		err error
	}
	res := make(chan result, 1)
	go func() { // ends when f returns
		defer s.wg.Done()
		v, err := f(func() bool { return state.Load() == callerGone })
		if !state.CompareAndSwap(0, returned) {
			if err == nil && giveBack != nil {
				giveBack(v)
			}
			return
		}
		res <- result{v, err}
	}()
	select {
	case r := <-res:
		return r.v, r.err
	case <-ctx.Done():
		if state.CompareAndSwap(0, callerGone) {
			return zero, ctx.Err()
		}
		r := <-res // f returned as ctx ended: its result is the caller's
		return r.v, r.err
	}
}

// awaitErr is await for calls that return only an error.
func awaitErr(ctx context.Context, s *amqpSession, f func(gone func() bool) error) error {
	_, err := await(ctx, s, func(gone func() bool) (struct{}, error) { return struct{}{}, f(gone) }, nil)
	return err
}

func (s *amqpSession) Declare(ctx context.Context, specs []queueSpec) error {
	if len(specs) == 0 {
		return nil
	}
	return awaitErr(ctx, s, func(gone func() bool) error {
		return s.declare(specs, gone)
	})
}

func (s *amqpSession) declare(specs []queueSpec, gone func() bool) error {
	return s.withChannel(func(ch *amqp.Channel) error {
		for _, q := range specs {
			if gone() {
				return errCallerGone
			}
			var err error
			if q.Passive {
				_, err = ch.QueueDeclarePassive(q.Name, true, false, false, false, nil)
			} else {
				_, err = ch.QueueDeclare(q.Name, true, false, false, false, q.Args)
			}
			if err != nil {
				return &queueError{Queue: q.Name, Err: s.translate(err)}
			}
			for _, b := range q.Bindings {
				if err := ch.QueueBind(q.Name, b.Key, b.Exchange, false, b.Args); err != nil {
					return &exchangeError{Exchange: b.Exchange, Binding: &b, Queue: q.Name, Err: s.translate(err)}
				}
			}
		}
		return nil
	})
}

func (s *amqpSession) DeclareExchanges(ctx context.Context, specs []exchangeSpec) error {
	if len(specs) == 0 {
		return nil
	}
	return awaitErr(ctx, s, func(gone func() bool) error {
		return s.declareExchanges(specs, gone)
	})
}

func (s *amqpSession) declareExchanges(specs []exchangeSpec, gone func() bool) error {
	return s.withChannel(func(ch *amqp.Channel) error {
		for _, e := range specs {
			if gone() {
				return errCallerGone
			}
			declare := ch.ExchangeDeclare
			if e.Passive {
				declare = ch.ExchangeDeclarePassive
			}
			if err := declare(e.Name, e.Kind, e.Durable, e.AutoDelete, e.Internal, false, e.Args); err != nil {
				var ae *amqp.Error
				if errors.As(err, &ae) && ae.Server && ae.Code == amqp.CommandInvalid {
					// A kind the server lacks (its plugin is not enabled):
					// RabbitMQ closes the connection, but every reconnect
					// would meet the refusal again. It is the server's
					// answer, not a lost connection.
					return &exchangeError{Exchange: e.Name, Err: err}
				}
				return &exchangeError{Exchange: e.Name, Err: s.translate(err)}
			}
		}
		return nil
	})
}

func (s *amqpSession) Length(ctx context.Context, queue string) (int, error) {
	return await(ctx, s, func(func() bool) (int, error) {
		var n int
		err := s.withChannel(func(ch *amqp.Channel) error {
			q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
			if err != nil {
				return s.translate(err)
			}
			n = q.Messages
			return nil
		})
		return n, err
	}, nil)
}

func (s *amqpSession) Delete(ctx context.Context, queues []string) error {
	return awaitErr(ctx, s, func(gone func() bool) error {
		return s.delete(queues, gone)
	})
}

func (s *amqpSession) delete(queues []string, gone func() bool) error {
	for len(queues) > 0 {
		var rest []string
		err := s.withChannel(func(ch *amqp.Channel) error {
			for j, q := range queues {
				if gone() {
					return errCallerGone
				}
				if _, err := ch.QueueDelete(q, false, false, false); err != nil {
					var ae *amqp.Error
					if errors.As(err, &ae) && ae.Server && ae.Code == amqp.NotFound {
						// Older servers refuse to delete a missing queue and
						// close the channel: go on with a new one.
						rest = queues[j+1:]
						return nil
					}
					return &queueError{Queue: q, Err: s.translate(err)}
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		queues = rest
	}
	return nil
}

// SyncGets and Get take getMu on await's goroutine, so that a call
// waiting behind an abandoned one (which holds getMu until the server
// answers it) still returns when its own context ends.
func (s *amqpSession) SyncGets(ctx context.Context) error {
	return awaitErr(ctx, s, func(gone func() bool) error {
		s.getMu.Lock()
		defer s.getMu.Unlock()
		if s.getCh == nil || gone() {
			return nil
		}
		// basic.qos is answered in turn, after the methods sent before
		// it, and changes nothing for basic.get.
		if err := s.getCh.Qos(0, 0, false); err != nil {
			return s.translate(err)
		}
		return nil
	})
}

func (s *amqpSession) Get(ctx context.Context, queue string) (*amqp.Delivery, bool, error) {
	d, err := await(ctx, s, func(gone func() bool) (*amqp.Delivery, error) {
		return s.get(queue, gone)
	}, func(d *amqp.Delivery) {
		if d != nil {
			// Got for a caller that left: back to the queue, at once,
			// rather than when the channel closes.
			_ = d.Nack(false, true)
		}
	})
	return d, d != nil, err
}

// get takes one message of queue; nil when the queue is empty.
func (s *amqpSession) get(queue string, gone func() bool) (*amqp.Delivery, error) {
	s.getMu.Lock()
	defer s.getMu.Unlock()
	if gone() {
		return nil, errCallerGone
	}
	if s.getCh == nil || s.getCh.IsClosed() {
		ch, err := s.conn.Channel()
		if err != nil {
			return nil, s.translate(err)
		}
		s.getCh = ch
	}
	d, ok, err := s.getCh.Get(queue, false)
	if err != nil {
		return nil, s.translate(err)
	}
	if !ok {
		return nil, nil
	}
	return &d, nil
}

func (s *amqpSession) Node() string             { return s.node }
func (s *amqpSession) MaxProperties() int       { return s.maxProps }
func (s *amqpSession) Closed() <-chan struct{}  { return s.done }
func (s *amqpSession) Reason() error            { return s.err }
func (s *amqpSession) Cancelled() <-chan string { return s.cancels }

func (s *amqpSession) Close() error {
	s.callMu.Lock()
	s.closing = true
	s.callMu.Unlock()
	err := s.conn.CloseDeadline(time.Now().Add(closeTimeout))
	// A write that amqp091 is blocked in holds the publish channel's
	// mutex, which the connection's shutdown waits for (and CloseDeadline
	// returns at once if that shutdown has begun): closing the socket ends
	// the write, the shutdown, and the session's goroutines.
	if s.raw != nil {
		s.raw.Close()
	}
	s.wg.Wait()
	if errors.Is(err, amqp.ErrClosed) {
		err = nil
	}
	return err
}
