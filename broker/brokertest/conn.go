package brokertest

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
	"github.com/rabbitmw/rabbitmw/internal/header"
)

// frameMax is a Server's frame_max: RabbitMQ's default.
const frameMax = 131072

// A memConsumer hands its queue's messages to a client. Its pump goroutine
// sends buf to out; it ends, closing out, when the consumer was cancelled
// and buf is empty, or at once when stop is closed (the connection closed).
type memConsumer struct {
	tag      string
	q        *memQueue
	conn     *memConn
	prefetch int
	unacked  int
	buf      []amqp.Delivery
	ending   bool
	wake     chan struct{} // cap 1
	stop     chan struct{}
	out      chan amqp.Delivery
}

func (c *memConsumer) pump(m *Server) {
	defer m.wg.Done()
	defer close(c.out)
	for {
		m.mu.Lock()
		if len(c.buf) == 0 {
			ending := c.ending
			m.mu.Unlock()
			if ending {
				return
			}
			select {
			case <-c.wake:
				continue
			case <-c.stop:
				return
			}
		}
		d := c.buf[0]
		c.buf[0] = amqp.Delivery{}
		c.buf = c.buf[1:]
		m.mu.Unlock()
		select {
		case c.out <- d:
		case <-c.stop:
			return
		}
	}
}

func (c *memConsumer) signal() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// A dialer is the transport.Transport of a Server, registered at its URL
// for broker.New to find. (It keeps Dial out of the Server's methods.)
type dialer struct{ m *Server }

var _ transport.Transport = dialer{}

func (d dialer) String() string { return d.m.url }

// Dial opens a connection to the Server.
func (d dialer) Dial(ctx context.Context, _ string) (transport.Session, error) {
	m := d.m
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stats.Dials++
	switch {
	case m.closed:
		return nil, fmt.Errorf("brokertest: server %s: %w", m.url, transport.ErrClosed)
	case m.down:
		return nil, fmt.Errorf("%w: server %s is down", transport.ErrUnreachable, m.url)
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("%w: %w", transport.ErrUnreachable, err)
	}
	c := &memConn{
		m:         m,
		done:      make(chan struct{}),
		cancels:   make(chan string, 16),
		unacked:   make(map[uint64]*memUnacked),
		consumers: make(map[string]*memConsumer),
	}
	m.conns[c] = struct{}{}
	return c, nil
}

// A memConn is a connection to a Server, with a single channel: it is the
// session, and the Acknowledger of the deliveries it receives. Its fields
// are guarded by Server.mu.
type memConn struct {
	m         *Server
	done      chan struct{}
	err       error
	cancels   chan string
	isClosed  bool
	tag       uint64
	unacked   map[uint64]*memUnacked
	consumers map[string]*memConsumer // active, by tag
	pumps     []*memConsumer          // every consumer started, to stop on close
}

var _ transport.Session = (*memConn)(nil)

// shutdown closes c for reason; its unsettled deliveries return to their
// queues, its consumers stop. m.mu must be held.
func (c *memConn) shutdown(reason *amqp.Error) {
	if c.isClosed {
		return
	}
	m := c.m
	c.isClosed = true
	delete(m.conns, c)
	// Cancelled consumers may still be handing out their buffer: stop
	// them too, so that no pump outlives its connection.
	for _, cons := range c.pumps {
		cons.q.removeConsumer(cons)
		close(cons.stop)
	}
	c.consumers, c.pumps = nil, nil
	tags := slices.Sorted(maps.Keys(c.unacked))
	touched := make(map[*memQueue]bool)
	for _, tag := range tags {
		u := c.unacked[tag]
		m.requeue(u.q, u.msg)
		m.stats.RequeuedOnClose++
		touched[u.q] = true
	}
	c.unacked = nil
	if reason == nil {
		c.err = fmt.Errorf("%w: connection closed", transport.ErrConnectionLost)
	} else {
		c.err = fmt.Errorf("%w: connection closed: %w", transport.ErrConnectionLost, reason)
	}
	close(c.done)
	for q := range touched {
		m.dispatch(q)
	}
}

func (c *memConn) Node() string             { return c.m.url }
func (c *memConn) MaxProperties() int       { return frameMax - transport.FrameOverhead }
func (c *memConn) Closed() <-chan struct{}  { return c.done }
func (c *memConn) Reason() error            { return c.err }
func (c *memConn) Cancelled() <-chan string { return c.cancels }

func (c *memConn) Close() error {
	c.m.mu.Lock()
	c.shutdown(nil)
	c.m.mu.Unlock()
	return nil
}

// lost returns c's error if c is closed. m.mu must be held.
func (c *memConn) lost() error {
	if c.isClosed {
		return c.err
	}
	return nil
}

func notFound(queue string) error {
	return &transport.QueueError{Queue: queue, Err: &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no queue '" + queue + "' in vhost '/'", Server: true, Recover: true}}
}

func (c *memConn) Declare(_ context.Context, specs []transport.QueueSpec) error {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return err
	}
	for _, s := range specs {
		q := m.queues[s.Name]
		switch {
		case s.Passive && q == nil:
			return notFound(s.Name)
		case s.Passive:
		case q != nil:
			if err := equivalent(q, s.Args); err != nil {
				return err
			}
		default:
			var err error
			if q, err = newMemQueue(s.Name, s.Args); err != nil {
				return err
			}
			m.queues[s.Name] = q
		}
		for _, b := range s.Bindings {
			if err := m.bind(q, b); err != nil {
				return err
			}
		}
	}
	return nil
}

// queueArgs are the arguments compared when a queue is declared again.
var queueArgs = []string{"x-queue-type", "x-message-ttl", "x-dead-letter-exchange", "x-dead-letter-routing-key", "x-delivery-limit", "x-single-active-consumer", "x-dead-letter-strategy", "x-overflow"}

func newMemQueue(name string, args amqp.Table) (*memQueue, error) {
	q := &memQueue{name: name, args: rabbit.WireTable(args)}
	bad := func(k string) error {
		return &transport.QueueError{Queue: name, Err: &amqp.Error{Code: amqp.PreconditionFailed,
			Reason: fmt.Sprintf("PRECONDITION_FAILED - invalid arg '%s' for queue '%s' in vhost '/': %v", k, name, args[k]), Server: true, Recover: true}}
	}
	for k, v := range args {
		switch k {
		case "x-queue-type":
			switch v {
			case "quorum":
				q.quorum = true
			case "classic":
			default:
				return nil, bad(k)
			}
		case "x-message-ttl":
			n, ok := header.Integer(v)
			if !ok || n < 0 {
				return nil, bad(k)
			}
			q.ttl, q.hasTTL = time.Duration(n)*time.Millisecond, true
		case "x-dead-letter-exchange":
			s, ok := v.(string)
			if !ok {
				return nil, bad(k)
			}
			q.dlx, q.dlxName = true, s
		case "x-dead-letter-routing-key":
			s, ok := v.(string)
			if !ok {
				return nil, bad(k)
			}
			q.dlrk, q.hasDLRK = s, true
		case "x-single-active-consumer":
			b, ok := v.(bool)
			if !ok {
				return nil, bad(k)
			}
			q.single = b
		case "x-delivery-limit":
			n, ok := header.Integer(v)
			if !ok || n < 0 {
				return nil, bad(k)
			}
			q.limit = int(n)
		case "x-dead-letter-strategy":
			// The Server loses no dead-lettered message either way.
			if v != "at-most-once" && v != "at-least-once" {
				return nil, bad(k)
			}
		case "x-overflow":
			// The Server has no length limit, so no overflow.
			if v != "drop-head" && v != "reject-publish" && v != "reject-publish-dlx" {
				return nil, bad(k)
			}
		}
	}
	return q, nil
}

// equivalent checks args against those q was declared with, as RabbitMQ
// does for a second declaration.
func equivalent(q *memQueue, args amqp.Table) error {
	for _, k := range queueArgs {
		got, inGot := args[k]
		cur, inCur := q.args[k]
		if k == "x-queue-type" {
			// Absent means classic.
			if !inGot {
				got, inGot = "classic", true
			}
			if !inCur {
				cur, inCur = "classic", true
			}
		}
		if inGot == inCur && argString(got) == argString(cur) {
			continue
		}
		received, current := "none", "none"
		if inGot {
			received = "the value '" + argString(got) + "'"
		}
		if inCur {
			current = "the value '" + argString(cur) + "'"
		}
		return &transport.QueueError{Queue: q.name, Err: &amqp.Error{Code: amqp.PreconditionFailed,
			Reason: "PRECONDITION_FAILED - inequivalent arg '" + k + "' for queue '" + q.name + "' in vhost '/': received " + received + " but current is " + current,
			Server: true, Recover: true}}
	}
	return nil
}

func argString(v any) string {
	if n, ok := header.Integer(v); ok {
		return strconv.FormatInt(n, 10)
	}
	return fmt.Sprint(v)
}

func (q *memQueue) removeConsumer(c *memConsumer) {
	if i := slices.Index(q.consumers, c); i >= 0 {
		q.consumers = slices.Delete(q.consumers, i, i+1)
	}
}

func (c *memConn) Consume(queue, tag string, prefetch int) (<-chan amqp.Delivery, error) {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return nil, err
	}
	q := m.queues[queue]
	if q == nil {
		return nil, notFound(queue)
	}
	if _, dup := c.consumers[tag]; dup {
		return nil, &amqp.Error{Code: amqp.NotAllowed, Reason: "NOT_ALLOWED - attempt to reuse consumer tag '" + tag + "'", Server: true}
	}
	cons := &memConsumer{
		tag:      tag,
		q:        q,
		conn:     c,
		prefetch: prefetch,
		wake:     make(chan struct{}, 1),
		stop:     make(chan struct{}),
		out:      make(chan amqp.Delivery),
	}
	c.consumers[tag] = cons
	c.pumps = append(c.pumps, cons)
	q.consumers = append(q.consumers, cons)
	m.wg.Add(1)
	go cons.pump(m)
	m.dispatch(q)
	return cons.out, nil
}

func (c *memConn) Cancel(tag string) error {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return err
	}
	cons := c.consumers[tag]
	if cons == nil {
		return nil
	}
	delete(c.consumers, tag)
	cons.q.removeConsumer(cons)
	cons.ending = true
	cons.signal()
	return nil
}

func (c *memConn) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	size, err := transport.CheckPublishing(exchange, key, msg)
	if err == nil {
		err = transport.FitFrame(size, c.MaxProperties(), 0)
	}
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err // nothing sent
	}
	delay, err := c.route(exchange, key, msg)
	if err != nil || delay == 0 {
		return err
	}
	// The server has the message; its confirm comes after delay.
	t := time.NewTimer(delay)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-c.done:
		return c.err // written before done was closed
	}
}

// route puts msg in its queue, or refuses it, and returns the server's
// confirm delay (Server.SetConfirmDelay).
func (c *memConn) route(exchange, key string, msg amqp.Publishing) (time.Duration, error) {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return 0, err
	}
	if msg.UserId != "" && msg.UserId != memUser {
		err := &amqp.Error{Code: amqp.PreconditionFailed, Server: true, Recover: true,
			Reason: "PRECONDITION_FAILED - user_id property set to '" + msg.UserId + "' but authenticated user was '" + memUser + "'"}
		c.shutdown(err) // as RabbitMQ closes the channel
		return 0, fmt.Errorf("broker: publish refused by the server: %w", err)
	}
	if x := m.exchanges[exchange]; x != nil && x.spec.Internal {
		err := &amqp.Error{Code: amqp.AccessRefused, Server: true, Recover: true,
			Reason: "ACCESS_REFUSED - cannot publish to internal exchange '" + exchange + "' in vhost '/'"}
		c.shutdown(err) // as RabbitMQ closes the channel
		return 0, fmt.Errorf("broker: publish refused by the server: %w", err)
	}
	pub := wirePublishing(msg)
	cc, bcc, err := senderKeys(pub.Headers)
	if err != nil {
		c.shutdown(err) // as RabbitMQ closes the channel
		return 0, fmt.Errorf("broker: publish refused by the server: %w", err)
	}
	delete(pub.Headers, "BCC") // as RabbitMQ does before delivery
	qs, ok := m.targets(exchange, append(append([]string{key}, cc...), bcc...), pub.Headers)
	if !ok {
		return 0, fmt.Errorf("%w: exchange %q does not exist", transport.ErrUnroutable, exchange)
	}
	if len(qs) == 0 {
		return 0, fmt.Errorf("%w: exchange %q, routing key %q", transport.ErrUnroutable, exchange, key)
	}
	for _, q := range qs {
		m.enqueue(q, &memMsg{pub: wirePublishing(pub), exchange: exchange, key: key, cc: cc, bcc: bcc}) // a copy each
	}
	return m.confirmDelay, nil
}

// senderKeys returns the routing keys of h's CC and BCC headers, which
// RabbitMQ routes a message by besides its routing key (sender-selected
// distribution): each must be an array, whose strings are the keys (its
// other elements are ignored); one of another type is refused, as RabbitMQ
// refuses the publish.
func senderKeys(h amqp.Table) (cc, bcc []string, err *amqp.Error) {
	keys := func(name string) ([]string, *amqp.Error) {
		v, ok := h[name]
		if !ok {
			return nil, nil
		}
		arr, ok := v.([]any)
		if !ok {
			return nil, &amqp.Error{Code: amqp.PreconditionFailed, Server: true, Recover: true,
				Reason: fmt.Sprintf("PRECONDITION_FAILED - invalid message: {unacceptable_type_in_header,%q,%T}", name, v)}
		}
		var out []string
		for _, e := range arr {
			if k, ok := e.(string); ok {
				out = append(out, k)
			}
		}
		return out, nil
	}
	if cc, err = keys("CC"); err != nil {
		return nil, nil, err
	}
	bcc, err = keys("BCC")
	return cc, bcc, err
}

// SyncGets: the in-memory server processes each ack as it is sent.
func (c *memConn) SyncGets(context.Context) error {
	c.m.mu.Lock()
	defer c.m.mu.Unlock()
	return c.lost()
}

func (c *memConn) Get(_ context.Context, queue string) (*amqp.Delivery, bool, error) {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return nil, false, err
	}
	q := m.queues[queue]
	if q == nil {
		return nil, false, notFound(queue)
	}
	if len(q.ready) == 0 {
		return nil, false, nil
	}
	msg := q.ready[0]
	q.ready = q.ready[1:]
	c.tag++
	c.unacked[c.tag] = &memUnacked{msg: msg, q: q}
	d := q.delivery(msg, c.tag, "", c, true)
	d.MessageCount = uint32(len(q.ready))
	return &d, true, nil
}

func (c *memConn) Length(_ context.Context, queue string) (int, error) {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return 0, err
	}
	q := m.queues[queue]
	if q == nil {
		return 0, notFound(queue)
	}
	return len(q.ready), nil
}

func (c *memConn) Delete(_ context.Context, queues []string) error {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if err := c.lost(); err != nil {
		return err
	}
	for _, name := range queues {
		q := m.queues[name]
		if q == nil {
			continue
		}
		delete(m.queues, name)
		m.unbindAll(q)
		q.deleted = true
		q.ready = nil
		for _, cons := range q.consumers {
			// basic.cancel from the server: the notice first, then the
			// delivery channel closes once its buffer is handed out.
			select {
			case cons.conn.cancels <- cons.tag:
			default:
			}
			delete(cons.conn.consumers, cons.tag)
			cons.ending = true
			cons.signal()
		}
		q.consumers = nil
	}
	return nil
}

// Ack implements amqp.Acknowledger.
func (c *memConn) Ack(tag uint64, multiple bool) error {
	return c.settle(tag, multiple, settleAck)
}

// Nack implements amqp.Acknowledger.
func (c *memConn) Nack(tag uint64, multiple, requeue bool) error {
	if requeue {
		return c.settle(tag, multiple, settleRequeue)
	}
	return c.settle(tag, multiple, settleReject)
}

// Reject implements amqp.Acknowledger.
func (c *memConn) Reject(tag uint64, requeue bool) error {
	if requeue {
		return c.settle(tag, false, settleRequeue)
	}
	return c.settle(tag, false, settleReject)
}

type settleAction int

const (
	settleAck settleAction = iota
	settleRequeue
	settleReject
)

func (c *memConn) settle(tag uint64, multiple bool, act settleAction) error {
	m := c.m
	m.mu.Lock()
	defer m.mu.Unlock()
	if c.isClosed {
		return amqp.ErrClosed
	}
	// As RabbitMQ: tag itself must be unsettled, multiple or not (a
	// multiple settlement of a tag settled already is an unknown tag,
	// whatever lies below it), but for multiple with tag 0: everything.
	var tags []uint64
	if c.unacked[tag] != nil || (multiple && tag == 0) {
		if !multiple {
			tags = []uint64{tag}
		} else {
			for t := range c.unacked {
				if t <= tag || tag == 0 {
					tags = append(tags, t)
				}
			}
			slices.Sort(tags)
		}
	} else {
		// RabbitMQ closes the channel; the call itself succeeds.
		m.stats.UnknownTags++
		c.shutdown(&amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - unknown delivery tag " + strconv.FormatUint(tag, 10), Server: true, Recover: true})
		return nil
	}
	if act == settleAck {
		m.stats.AckFrames++
		m.stats.Acked += len(tags)
	}
	touched := make(map[*memQueue]bool, 1)
	for _, t := range tags {
		u := c.unacked[t]
		delete(c.unacked, t)
		if u.c != nil {
			u.c.unacked--
		}
		touched[u.q] = true
		switch act {
		case settleRequeue:
			m.stats.Nacked++
			m.requeue(u.q, u.msg)
		case settleReject:
			if !u.q.deleted {
				m.deadLetter(u.q, u.msg, "rejected")
			}
		}
	}
	for q := range touched {
		m.dispatch(q)
	}
	return nil
}
