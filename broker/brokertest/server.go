package brokertest

import (
	"bytes"
	"slices"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// A Server is an in-process stand-in for a RabbitMQ server (see the
// package documentation for what it models). A Broker made with
// broker.New(srv.URL(), opts) runs the same code on it as on RabbitMQ.
//
// A Server starts a goroutine per consumer, which ends when the consumer
// is cancelled or its connection closes, and one clock goroutine for TTLs,
// started when a message that can expire is first queued and ended by
// Close. Call Close when done with a Server. Its methods are safe for
// concurrent use.
type Server struct {
	url       string
	mu        sync.Mutex
	queues    map[string]*memQueue
	exchanges map[string]*memExchange
	conns     map[*memConn]struct{}
	seq       uint64 // message sequence, for requeue order
	closed    bool
	down      bool // refuse connections (for tests of a server that is down)
	clockOn   bool
	clockWake chan struct{} // cap 1
	quit      chan struct{} // closed by Close
	wg        sync.WaitGroup

	// confirmDelay is how long a publish waits for its confirm (for tests
	// of a busy server); 0: no wait.
	confirmDelay time.Duration

	stats Stats
}

// memUser is the only user of a Server.
const memUser = "guest"

// NewServer starts an empty server, and registers it at its URL until
// Close.
func NewServer() *Server {
	m := &Server{
		queues:    make(map[string]*memQueue),
		exchanges: make(map[string]*memExchange),
		conns:     make(map[*memConn]struct{}),
		clockWake: make(chan struct{}, 1),
		quit:      make(chan struct{}),
	}
	m.url = transport.Register(dialer{m})
	return m
}

// URL returns the address of m for broker.New, of the form
// "memory://<n>": it names m in this process only.
func (m *Server) URL() string { return m.url }

// CloseConnections closes every connection to m, as
// `rabbitmqctl close_all_connections` does to a RabbitMQ server, and
// returns how many it closed. Their unsettled deliveries return to their
// queues, marked Redelivered; their consumers' delivery channels close; the
// brokers that used them connect again.
func (m *Server) CloseConnections() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for c := range m.conns {
		c.shutdown(&amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - Closed via CloseConnections", Server: true})
		n++
	}
	return n
}

// Close closes every connection to m, stops its timers and unregisters
// its URL; later connections fail with an error wrapping broker.ErrClosed.
// When Close returns, every goroutine that m started has ended. Close is
// idempotent.
func (m *Server) Close() {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.closed = true
	transport.Unregister(m.url)
	for c := range m.conns {
		c.shutdown(&amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - memory server closed", Server: true})
	}
	close(m.quit)
	m.mu.Unlock()
	m.wg.Wait()
}

// SetDown makes m refuse new connections (down), with an error wrapping
// broker.ErrUnreachable as a server that is down does, or accept them
// again. Connections open already are left alone (CloseConnections closes
// them).
func (m *Server) SetDown(down bool) {
	m.mu.Lock()
	m.down = down
	m.mu.Unlock()
}

// SetConfirmDelay makes every publish wait d for its confirm, as on a busy
// server: the message is in its queue at once, and a publish whose context
// ends first returns the context's error, as amqp091's does. 0, the
// default, confirms at once.
func (m *Server) SetConfirmDelay(d time.Duration) {
	m.mu.Lock()
	m.confirmDelay = d
	m.mu.Unlock()
}

// Stats counts what happened on a Server since NewServer.
type Stats struct {
	// Dials counts the connection attempts, those refused included (by
	// SetDown, or after Close).
	Dials int
	// Conns is the number of connections open now.
	Conns int
	// UnknownTags counts the settlements of a delivery tag that was not
	// outstanding on its connection (each closed that connection, as
	// RabbitMQ closes the channel).
	UnknownTags int
	// RequeuedOnClose counts the deliveries returned to their queue
	// because their connection closed before they were settled.
	RequeuedOnClose int
	// Nacked counts the deliveries returned to their queue by a nack or
	// reject with requeue.
	Nacked int
	// AckFrames counts the basic.ack frames taken, multiple or not, and
	// Acked the deliveries they settled.
	AckFrames, Acked int
}

// Stats returns a snapshot of m's counters.
func (m *Server) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	s.Conns = len(m.conns)
	return s
}

// Unacked returns the number of deliveries of queue, delivered on any
// connection, not settled yet.
func (m *Server) Unacked(queue string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for c := range m.conns {
		for _, u := range c.unacked {
			if u.q.name == queue && m.queues[queue] == u.q {
				n++
			}
		}
	}
	return n
}

// A memQueue is a queue. Its fields are guarded by Server.mu.
type memQueue struct {
	name      string
	args      amqp.Table
	quorum    bool
	ttl       time.Duration
	hasTTL    bool
	dlx       bool // x-dead-letter-exchange set
	dlxName   string
	dlrk      string
	hasDLRK   bool
	limit     int
	single    bool // x-single-active-consumer: the first consumer gets every message
	ready     []*memMsg
	consumers []*memConsumer
	rr        int // round-robin position
	deleted   bool
}

// A memMsg is a message in a queue, or delivered and unsettled.
type memMsg struct {
	seq         uint64
	pub         amqp.Publishing // as the wire would carry it
	exchange    string
	key         string
	cc, bcc     []string // the keys of its CC and BCC headers at its publish
	redelivered bool
	returns     int       // returns to the queue (x-delivery-count on quorum queues)
	expires     time.Time // zero if it never expires
}

// msgTTL returns the time a message with the Expiration property
// expiration may stay in q: the shorter of q's x-message-ttl and the
// message's own TTL (whole milliseconds), if either is set.
func msgTTL(q *memQueue, expiration string) (time.Duration, bool) {
	ttl, ok := q.ttl, q.hasTTL
	if ms, err := strconv.ParseUint(expiration, 10, 32); err == nil {
		if own := time.Duration(ms) * time.Millisecond; !ok || own < ttl {
			ttl, ok = own, true
		}
	}
	return ttl, ok
}

// A memUnacked is a delivery not yet settled.
type memUnacked struct {
	msg *memMsg
	q   *memQueue
	c   *memConsumer // nil for basic.get
}

// enqueue appends msg to q. m.mu must be held.
func (m *Server) enqueue(q *memQueue, msg *memMsg) {
	m.seq++
	msg.seq = m.seq
	if ttl, ok := msgTTL(q, msg.pub.Expiration); ok {
		msg.expires = time.Now().Add(ttl)
		m.startClock()
	}
	q.ready = append(q.ready, msg)
	m.dispatch(q)
}

// requeue returns msg to q, at its place by sequence, or dead-letters it
// past a quorum queue's delivery limit. m.mu must be held; the caller
// dispatches q.
func (m *Server) requeue(q *memQueue, msg *memMsg) {
	if q.deleted {
		return
	}
	msg.redelivered = true
	if q.quorum {
		msg.returns++
		if q.limit > 0 && msg.returns > q.limit {
			m.deadLetter(q, msg, "delivery_limit")
			return
		}
	}
	i, _ := slices.BinarySearchFunc(q.ready, msg.seq, func(e *memMsg, seq uint64) int {
		switch {
		case e.seq < seq:
			return -1
		case e.seq > seq:
			return 1
		}
		return 0
	})
	q.ready = slices.Insert(q.ready, i, msg)
}

// deadLetter sends msg, leaving q for reason, to q's dead-letter target, if
// any, as RabbitMQ does: with the dead-lettering recorded in its headers
// (see rabbit.AddDeath) and without its Expiration property. m.mu must be held.
func (m *Server) deadLetter(q *memQueue, msg *memMsg, reason string) {
	if !q.dlx {
		return // no dead-letter exchange: dropped
	}
	published := append([]string{msg.key}, msg.cc...)
	keys := append(slices.Clip(published), msg.bcc...)
	pub := msg.pub
	pub.Headers = rabbit.AddDeath(rabbit.WireTable(pub.Headers), q.name, reason, msg.exchange, published, pub.Expiration, time.Now())
	pub.Expiration = ""
	key, cc, bcc := msg.key, msg.cc, msg.bcc
	if q.hasDLRK {
		// The queue's key alone, and without the CC header, whose keys
		// would route the message again.
		key, cc, bcc = q.dlrk, nil, nil
		keys = []string{key}
		delete(pub.Headers, "CC")
	}
	targets, _ := m.targets(q.dlxName, keys, pub.Headers)
	for _, target := range targets { // none: unroutable, dropped
		if reason != "rejected" && rabbit.DeadLetterCycle(pub.Headers["x-death"], target.name) {
			continue // a cycle: dropped, as RabbitMQ does
		}
		m.enqueue(target, &memMsg{pub: wirePublishing(pub), exchange: q.dlxName, key: key, cc: cc, bcc: bcc}) // a copy each
	}
}

// dispatch hands q's ready messages to its consumers with room under their
// prefetch, round-robin. m.mu must be held.
func (m *Server) dispatch(q *memQueue) {
	for len(q.ready) > 0 && len(q.consumers) > 0 {
		var cons *memConsumer
		if q.single {
			// The active consumer is the longest registered; the next
			// takes over when it is removed.
			if c := q.consumers[0]; c.prefetch == 0 || c.unacked < c.prefetch {
				cons = c
			}
		}
		for i := 0; i < len(q.consumers) && !q.single; i++ {
			c := q.consumers[q.rr%len(q.consumers)]
			q.rr++
			if c.prefetch == 0 || c.unacked < c.prefetch {
				cons = c
				break
			}
		}
		if cons == nil {
			return
		}
		msg := q.ready[0]
		q.ready[0] = nil
		q.ready = q.ready[1:]
		conn := cons.conn
		conn.tag++
		conn.unacked[conn.tag] = &memUnacked{msg: msg, q: q, c: cons}
		cons.unacked++
		cons.buf = append(cons.buf, q.delivery(msg, conn.tag, cons.tag, conn, false))
		cons.signal()
	}
}

// delivery returns msg as delivered from q with tag, by basic.get or to a
// consumer. A quorum queue adds x-delivery-count to every basic.get, and to
// the deliveries to a consumer of a message it delivered before (RabbitMQ
// 3.10 does so).
func (q *memQueue) delivery(msg *memMsg, tag uint64, consumerTag string, ack amqp.Acknowledger, get bool) amqp.Delivery {
	p := &msg.pub
	h := rabbit.WireTable(p.Headers)
	if q.quorum && (get || msg.returns > 0) {
		if h == nil {
			h = amqp.Table{}
		}
		h["x-delivery-count"] = int64(msg.returns)
	}
	return amqp.Delivery{
		Acknowledger:    ack,
		Headers:         h,
		ContentType:     p.ContentType,
		ContentEncoding: p.ContentEncoding,
		DeliveryMode:    p.DeliveryMode,
		Priority:        p.Priority,
		CorrelationId:   p.CorrelationId,
		ReplyTo:         p.ReplyTo,
		Expiration:      p.Expiration,
		MessageId:       p.MessageId,
		Timestamp:       p.Timestamp,
		Type:            p.Type,
		UserId:          p.UserId,
		AppId:           p.AppId,
		ConsumerTag:     consumerTag,
		DeliveryTag:     tag,
		Redelivered:     msg.redelivered,
		Exchange:        msg.exchange,
		RoutingKey:      msg.key,
		Body:            bytes.Clone(p.Body),
	}
}

// startClock starts the clock goroutine if needed, or wakes it to see a new
// expiry. m.mu must be held.
func (m *Server) startClock() {
	if m.closed {
		return
	}
	if !m.clockOn {
		m.clockOn = true
		m.wg.Add(1)
		go m.clock()
		return
	}
	select {
	case m.clockWake <- struct{}{}:
	default:
	}
}

// clock expires messages at the heads of queues with a TTL. It ends when m
// is closed.
func (m *Server) clock() {
	defer m.wg.Done()
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		m.mu.Lock()
		next := m.expire(time.Now())
		m.mu.Unlock()
		wait := time.Hour
		if !next.IsZero() {
			wait = max(time.Until(next), 0)
		}
		t.Reset(wait)
		select {
		case <-t.C:
		case <-m.clockWake:
		case <-m.quit:
			return
		}
	}
}

// expire dead-letters the expired messages at the heads of queues, and
// returns the next expiry (zero if none). m.mu must be held.
func (m *Server) expire(now time.Time) time.Time {
	var next time.Time
	for again := true; again; {
		again = false
		for _, q := range m.queues {
			for len(q.ready) > 0 && expired(q.ready[0], now) {
				msg := q.ready[0]
				q.ready[0] = nil
				q.ready = q.ready[1:]
				m.deadLetter(q, msg, "expired")
				again = true // the target may be a queue with a TTL
			}
		}
	}
	for _, q := range m.queues {
		if len(q.ready) > 0 {
			if e := q.ready[0].expires; !e.IsZero() && (next.IsZero() || e.Before(next)) {
				next = e
			}
		}
	}
	return next
}

// expired reports whether msg, at the head of its queue, has expired at now.
func expired(msg *memMsg, now time.Time) bool {
	return !msg.expires.IsZero() && !msg.expires.After(now)
}

// wirePublishing returns a copy of msg as the wire would carry it.
func wirePublishing(msg amqp.Publishing) amqp.Publishing {
	msg.Headers = rabbit.WireTable(msg.Headers)
	msg.Body = bytes.Clone(msg.Body)
	if !msg.Timestamp.IsZero() {
		msg.Timestamp = time.Unix(msg.Timestamp.Unix(), 0)
	}
	return msg
}
