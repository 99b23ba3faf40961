package broker

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
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
}

func newAMQPTransport(url string, cfg config) *amqpTransport {
	uri, err := amqp.ParseURI(url)
	return &amqpTransport{url: url, uri: uri, parseErr: err, heartbeat: cfg.heartbeat, tls: cfg.tls, external: cfg.external}
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
	if t.parseErr != nil {
		return nil, fmt.Errorf("broker: malformed AMQP URL: %w", t.parseErr)
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
	s, err := newAMQPSession(conn, socket, t.String())
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
// (con), a confirm-mode publish channel (pub), and a channel for basic.get
// (getCh) opened when first needed; declare, length and delete use a
// short-lived channel each, so that the server's refusals (which close the
// channel they occur on) do not end the session.
//
// It runs three goroutines, all ended when the connection closes: watch,
// which closes done when the connection or con or pub closes; confirms,
// which resolves publishes; both end when amqp091 closes the notify
// channels they read; and publisher, the only caller of pub.Publish, which
// ends when done is closed.
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
	maxProps int      // see transport.Session.MaxProperties
	pub      *amqp.Channel
	con      *amqp.Channel

	done    chan struct{}
	err     error // why done was closed; written before
	cancels chan string
	wg      sync.WaitGroup

	// requests hands a publish to the publisher goroutine. Unbuffered: a
	// publish handed over is being sent, and one not handed over can be
	// given up.
	requests chan *pendingPublish

	// pendMu guards pending, returned, byID, unconfirmed and the settled
	// flag of each publish, and is only ever held briefly: never across a
	// call of amqp091 that may wait for its reader, which may be blocked
	// handing a confirm to the confirms goroutine.
	pendMu   sync.Mutex
	pending  map[uint64]*pendingPublish
	returned map[string]int // message id -> basic.returns not yet matched
	// byID holds the publish in flight for each message id. A basic.return
	// names its message only by its properties, so two publishes of one id
	// in flight at once could not be told apart: a publish waits until the
	// one before it with its id is resolved.
	byID map[string]*pendingPublish
	// unconfirmed is set when the confirms goroutine has ended: no confirm
	// will come for a publish sent after that.
	unconfirmed bool

	getMu sync.Mutex
	getCh *amqp.Channel
}

// A pendingPublish is one call of publish: the message, and its result.
// It is resolved exactly once, by whichever comes first of its confirm (or
// return), the close of its channel, a failure to send it, or its caller
// giving up before it was sent; done then receives the result (nil,
// ErrUnroutable, ErrNacked, errChannelClosed, a *sendError, or the
// caller's context error) and resolved is closed.
type pendingPublish struct {
	exchange, key string
	msg           amqp.Publishing
	// abandoned is the caller's ctx.Done(): once it is closed, a publish
	// not yet sent is not sent.
	abandoned <-chan struct{}

	done     chan error // buffered: resolve never blocks
	resolved chan struct{}
	settled  bool
}

// resolve settles p with res, unless it is settled already (the first
// result stands), and lets the next publish of p's id go. s.pendMu must be
// held.
func (s *amqpSession) resolve(p *pendingPublish, res error) {
	if p.settled {
		return
	}
	p.settled = true
	p.done <- res
	close(p.resolved)
	if s.byID[p.msg.MessageId] == p {
		delete(s.byID, p.msg.MessageId)
	}
}

// errChannelClosed tells a waiting publish that its channel closed before the
// confirm; the session's reason says why.
var errChannelClosed = errors.New("publish channel closed")

// A sendError is amqp091's failure to send a publish.
type sendError struct{ err error }

func (e *sendError) Error() string { return e.err.Error() }

func newAMQPSession(conn *amqp.Connection, raw net.Conn, node string) (*amqpSession, error) {
	s := &amqpSession{
		conn:     conn,
		raw:      raw,
		node:     node,
		done:     make(chan struct{}),
		cancels:  make(chan string, 1),
		requests: make(chan *pendingPublish),
		pending:  make(map[uint64]*pendingPublish),
		returned: make(map[string]int),
		byID:     make(map[string]*pendingPublish),
	}
	if n := conn.Config.FrameSize; n > 0 { // negotiated by now
		s.maxProps = n - transport.FrameOverhead
	}
	var err error
	if s.pub, err = conn.Channel(); err != nil {
		return nil, err
	}
	if err = s.pub.Confirm(false); err != nil {
		return nil, err
	}
	if s.con, err = conn.Channel(); err != nil {
		return nil, err
	}
	// amqp091 sends to the NotifyClose channels without blocking (they hold
	// one value each), and closes them all when the connection closes.
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	pubClosed := s.pub.NotifyClose(make(chan *amqp.Error, 1))
	conClosed := s.con.NotifyClose(make(chan *amqp.Error, 1))
	s.con.NotifyCancel(s.cancels)
	// Unbuffered on purpose: amqp091's reader blocks handing over a return
	// until the confirms goroutine takes it, and the server sends a
	// message's basic.return before its basic.ack; so the return is
	// recorded before the ack can be received.
	returns := s.pub.NotifyReturn(make(chan amqp.Return))
	confirms := s.pub.NotifyPublish(make(chan amqp.Confirmation))
	s.wg.Add(3)
	go s.watch(connClosed, pubClosed, conClosed)
	go s.confirms(confirms, returns)
	go s.publisher()
	return s, nil
}

// watch closes done when the connection or either channel closes. It ends
// then.
func (s *amqpSession) watch(connClosed, pubClosed, conClosed chan *amqp.Error) {
	defer s.wg.Done()
	var what string
	var e *amqp.Error
	select {
	case e = <-connClosed:
		what = "connection"
	case e = <-pubClosed:
		what = "publish channel"
	case e = <-conClosed:
		what = "consume channel"
	}
	if e == nil {
		s.err = fmt.Errorf("%w: %s closed", ErrConnectionLost, what)
	} else {
		s.err = fmt.Errorf("%w: %s closed: %w", ErrConnectionLost, what, e)
	}
	close(s.done)
}

// confirms resolves waiting publishes from the publish channel's returns
// and confirms, until the channel closes; it then fails the publishes still
// waiting and ends.
func (s *amqpSession) confirms(confirms <-chan amqp.Confirmation, returns <-chan amqp.Return) {
	defer s.wg.Done()
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			s.pendMu.Lock()
			s.returned[r.MessageId]++
			s.pendMu.Unlock()
		case c, ok := <-confirms:
			if !ok {
				s.pendMu.Lock()
				for seq, p := range s.pending {
					s.resolve(p, errChannelClosed)
					delete(s.pending, seq)
				}
				s.unconfirmed = true
				s.pendMu.Unlock()
				return
			}
			s.pendMu.Lock()
			p := s.pending[c.DeliveryTag]
			delete(s.pending, c.DeliveryTag)
			if p != nil {
				var res error
				if n := s.returned[p.msg.MessageId]; n > 0 {
					if n == 1 {
						delete(s.returned, p.msg.MessageId)
					} else {
						s.returned[p.msg.MessageId] = n - 1
					}
					res = ErrUnroutable
				} else if !c.Ack {
					res = ErrNacked
				}
				s.resolve(p, res)
			}
			s.pendMu.Unlock()
		}
	}
}

// publisher sends the publishes handed to it, one at a time, until done is
// closed; it ends then. Being the only caller of pub.Publish, it knows the
// sequence number of each publish without holding a lock across the call.
func (s *amqpSession) publisher() {
	defer s.wg.Done()
	for {
		select {
		case p := <-s.requests:
			s.send(p)
		case <-s.done:
			return
		}
	}
}

// send publishes p on pub and records it as pending its confirm.
func (s *amqpSession) send(p *pendingPublish) {
	select {
	case <-p.abandoned:
		// Its caller gave up before it was sent: it is not sent.
		s.pendMu.Lock()
		s.resolve(p, errAbandoned)
		s.pendMu.Unlock()
		return
	default:
	}
	// Outside pendMu: amqp091 takes its confirms' lock here, which its
	// reader holds while it hands a confirm to the confirms goroutine.
	seq := s.pub.GetNextPublishSeqNo()
	s.pendMu.Lock()
	if s.unconfirmed {
		// The channel closed, and its confirms with it.
		s.resolve(p, errChannelClosed)
		s.pendMu.Unlock()
		return
	}
	s.pending[seq] = p
	s.pendMu.Unlock()
	if err := s.pub.Publish(p.exchange, p.key, true, false, p.msg); err != nil {
		// The confirms goroutine may have failed p already, if the channel
		// closed meanwhile: the first result stands.
		s.pendMu.Lock()
		if s.pending[seq] == p {
			delete(s.pending, seq)
		}
		s.resolve(p, &sendError{err: err})
		s.pendMu.Unlock()
	}
}

// errAbandoned resolves a publish whose caller gave up before it was sent;
// nobody reads it.
var errAbandoned = errors.New("publish abandoned")

func (s *amqpSession) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	// amqp091 would refuse an invalid message as it writes it, closing the
	// connection; RabbitMQ, or a consumer's amqp091, would close theirs.
	size, err := transport.CheckPublishing(exchange, key, msg)
	if err == nil {
		err = transport.FitFrame(size, s.maxProps, 0)
	}
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err // nothing sent
	}
	p := &pendingPublish{
		exchange:  exchange,
		key:       key,
		msg:       msg,
		abandoned: ctx.Done(),
		done:      make(chan error, 1),
		resolved:  make(chan struct{}),
	}
	if err := s.awaitTurn(ctx, p); err != nil {
		return err
	}
	if err := s.handOver(ctx, p); err != nil {
		return err
	}
	select {
	case res := <-p.done:
		return s.publishResult(res, exchange, key)
	case <-ctx.Done():
		// The publish stays pending: the confirms goroutine removes it,
		// and matches its return, if any.
		return ctx.Err()
	}
}

// awaitTurn waits until no other publish of p's message id is in flight
// (see byID), and records p as the one in flight. It returns ctx's error
// or the session's reason, without recording p, if either comes first.
func (s *amqpSession) awaitTurn(ctx context.Context, p *pendingPublish) error {
	for {
		s.pendMu.Lock()
		prev := s.byID[p.msg.MessageId]
		if prev == nil {
			s.byID[p.msg.MessageId] = p
			s.pendMu.Unlock()
			return nil
		}
		s.pendMu.Unlock()
		select {
		case <-prev.resolved:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.done:
			return s.err
		}
	}
}

// handOver hands p to the publisher goroutine, which resolves it from
// then on. If ctx is done or the session closes first, p is not handed
// over: handOver resolves it with that error and returns it.
func (s *amqpSession) handOver(ctx context.Context, p *pendingPublish) error {
	var res error
	select {
	case s.requests <- p:
		return nil
	case <-ctx.Done():
		res = ctx.Err()
	case <-s.done:
		res = s.err
	}
	s.pendMu.Lock()
	s.resolve(p, res)
	s.pendMu.Unlock()
	return res
}

// publishResult translates res, the result of a publish handed over (see
// pendingPublish), into the error Publish returns.
func (s *amqpSession) publishResult(res error, exchange, key string) error {
	var se *sendError
	switch {
	case res == nil:
		return nil
	case errors.As(res, &se):
		return s.translate(se.err)
	case errors.Is(res, errChannelClosed):
		<-s.done // closed by watch, if not already: pub is closed
		var ae *amqp.Error
		if errors.As(s.err, &ae) && ae.Server && ae.Recover {
			// The server closed the channel for a publish it refused.
			if ae.Code == amqp.NotFound && exchange != "" && strings.Contains(ae.Reason, "'"+exchange+"'") {
				return fmt.Errorf("%w: exchange %q does not exist (%s)", ErrUnroutable, exchange, ae.Reason)
			}
			if ae.Code != amqp.NotFound {
				return fmt.Errorf("broker: publish refused by the server: %w", ae)
			}
		}
		return s.err
	default:
		return fmt.Errorf("%w: exchange %q, routing key %q", res, exchange, key)
	}
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

func (s *amqpSession) Declare(_ context.Context, specs []queueSpec) error {
	if len(specs) == 0 {
		return nil
	}
	return s.withChannel(func(ch *amqp.Channel) error {
		for _, q := range specs {
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
					return &exchangeError{Exchange: b.Exchange, Err: s.translate(err)}
				}
			}
		}
		return nil
	})
}

func (s *amqpSession) DeclareExchanges(_ context.Context, specs []exchangeSpec) error {
	if len(specs) == 0 {
		return nil
	}
	return s.withChannel(func(ch *amqp.Channel) error {
		for _, e := range specs {
			declare := ch.ExchangeDeclare
			if e.Passive {
				declare = ch.ExchangeDeclarePassive
			}
			if err := declare(e.Name, e.Kind, e.Durable, e.AutoDelete, e.Internal, false, e.Args); err != nil {
				return &exchangeError{Exchange: e.Name, Err: s.translate(err)}
			}
		}
		return nil
	})
}

func (s *amqpSession) Length(_ context.Context, queue string) (int, error) {
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
}

func (s *amqpSession) Delete(_ context.Context, queues []string) error {
	for len(queues) > 0 {
		var rest []string
		err := s.withChannel(func(ch *amqp.Channel) error {
			for j, q := range queues {
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

func (s *amqpSession) SyncGets(_ context.Context) error {
	s.getMu.Lock()
	defer s.getMu.Unlock()
	if s.getCh == nil {
		return nil
	}
	// basic.qos is answered in turn, after the methods sent before it,
	// and changes nothing for basic.get.
	if err := s.getCh.Qos(0, 0, false); err != nil {
		return s.translate(err)
	}
	return nil
}

func (s *amqpSession) Get(_ context.Context, queue string) (*amqp.Delivery, bool, error) {
	s.getMu.Lock()
	defer s.getMu.Unlock()
	if s.getCh == nil || s.getCh.IsClosed() {
		ch, err := s.conn.Channel()
		if err != nil {
			return nil, false, s.translate(err)
		}
		s.getCh = ch
	}
	d, ok, err := s.getCh.Get(queue, false)
	if err != nil {
		return nil, false, s.translate(err)
	}
	if !ok {
		return nil, false, nil
	}
	return &d, true, nil
}

func (s *amqpSession) Node() string             { return s.node }
func (s *amqpSession) MaxProperties() int       { return s.maxProps }
func (s *amqpSession) Closed() <-chan struct{}  { return s.done }
func (s *amqpSession) Reason() error            { return s.err }
func (s *amqpSession) Cancelled() <-chan string { return s.cancels }

func (s *amqpSession) Close() error {
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
