package broker

import (
	"bytes"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/internal/header"
)

// Memory is an in-process stand-in for a RabbitMQ server, for tests and
// for examples that need no setup. A [Broker] made by [Memory.Broker] runs
// the same code on it as on RabbitMQ: the consumer, its settlement and its
// reconnection are not doubles.
//
// It emulates what the broker relies on, as RabbitMQ 3.10 does it:
//
//   - the default exchange only: a message published with routing key K
//     goes to queue K; a publish to any other exchange, or to a key that
//     names no queue, is returned as unroutable;
//   - durable queues with the arguments x-queue-type ("quorum" or
//     "classic"), x-message-ttl, x-dead-letter-exchange (the default
//     exchange ""), x-dead-letter-routing-key and x-delivery-limit;
//     redeclaring with other arguments fails with 406 PRECONDITION_FAILED,
//     a passive declare of a missing queue with 404 NOT_FOUND;
//   - dead-lettering on expiry at the head of a queue (by its TTL or the
//     message's Expiration, in milliseconds), on a reject or nack without
//     requeue, and past a quorum queue's delivery limit, with the x-death,
//     x-first-death-queue, x-first-death-reason and x-first-death-exchange
//     headers as RabbitMQ writes them; a message that would circle through
//     dead-lettering without a reject is dropped, by RabbitMQ's rule (see
//     deadLetterCycle);
//   - per-consumer prefetch, delivery tags per connection, ack, nack and
//     reject (multiple too), Redelivered on a returned message, an
//     x-delivery-count header on quorum queues; a settlement with an unknown
//     tag closes the connection (406), as RabbitMQ closes the channel;
//   - on a connection's close, its unsettled deliveries return to their
//     queues; deleting a queue cancels its consumers (basic.cancel);
//   - header values and timestamps as the wire carries them (int becomes
//     int32, times lose their fractions of a second), and a publish whose
//     UserId is not "guest", the memory server's only user, is refused;
//   - a frame_max of 128 KiB, RabbitMQ's default; a message that amqp091
//     or RabbitMQ could not carry is refused as on RabbitMQ
//     (ErrInvalidMessage).
//
// Delivered messages are real amqp.Delivery values whose Acknowledger is
// the memory connection: settling one after its connection closed returns
// amqp.ErrClosed. Exchanges other than the default one, bindings and
// persistence are not emulated.
//
// Memory starts a goroutine per consumer, which ends when the consumer is
// cancelled or its connection closes, and one clock goroutine for TTLs,
// started when a message that can expire is first queued and ended by Close.
// Call Close when done with a Memory.
type Memory struct {
	mu        sync.Mutex
	queues    map[string]*memQueue
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

	// Counters that tests read.
	unknownTags     int // settlements of unknown delivery tags
	requeuedOnClose int // deliveries returned to a queue because their connection closed
	nacked          int // nacks and rejects with requeue
	ackFrames       int // basic.ack frames taken (multiple or not)
	acked           int // deliveries they settled
}

// memUser is the only user of a Memory server.
const memUser = "guest"

// NewMemory returns an empty in-memory server.
func NewMemory() *Memory {
	return &Memory{
		queues:    make(map[string]*memQueue),
		conns:     make(map[*memConn]struct{}),
		clockWake: make(chan struct{}, 1),
		quit:      make(chan struct{}),
	}
}

// Broker returns a Broker connected to m. Options.Heartbeat does not apply.
func (m *Memory) Broker(opts Options) *Broker {
	return newBroker(&memTransport{m: m}, opts.resolve())
}

// CloseConnections closes every connection to m, as
// `rabbitmqctl close_all_connections` does to a RabbitMQ server, and
// returns how many it closed. Their unsettled deliveries return to their
// queues, marked Redelivered; their consumers' delivery channels close; the
// brokers that used them connect again.
func (m *Memory) CloseConnections() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	n := 0
	for c := range m.conns {
		c.shutdown(&amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - Closed via CloseConnections", Server: true})
		n++
	}
	return n
}

// Close closes every connection to m and stops its timers; later
// connections fail with ErrClosed. When Close returns, every goroutine that
// m started has ended. Close is idempotent.
func (m *Memory) Close() {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return
	}
	m.closed = true
	for c := range m.conns {
		c.shutdown(&amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - memory server closed", Server: true})
	}
	close(m.quit)
	m.mu.Unlock()
	m.wg.Wait()
}

// setDown makes m refuse new connections (down) or accept them again.
func (m *Memory) setDown(down bool) {
	m.mu.Lock()
	m.down = down
	m.mu.Unlock()
}

// setConfirmDelay makes every publish wait d for its confirm, as on a busy
// server: the message is in its queue at once, and a publish whose context
// ends first returns the context's error, as amqp091's does.
func (m *Memory) setConfirmDelay(d time.Duration) {
	m.mu.Lock()
	m.confirmDelay = d
	m.mu.Unlock()
}

// memStats is a snapshot of m's counters.
type memStats struct {
	unknownTags, requeuedOnClose, nacked, conns int
	ackFrames, acked                            int
}

func (m *Memory) stats() memStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return memStats{unknownTags: m.unknownTags, requeuedOnClose: m.requeuedOnClose, nacked: m.nacked, conns: len(m.conns),
		ackFrames: m.ackFrames, acked: m.acked}
}

// unacked returns the number of deliveries of queue not yet settled.
func (m *Memory) unacked(queue string) int {
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

// A memQueue is a queue. Its fields are guarded by Memory.mu.
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
func (m *Memory) enqueue(q *memQueue, msg *memMsg) {
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
func (m *Memory) requeue(q *memQueue, msg *memMsg) {
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
// (see addDeath) and without its Expiration property. m.mu must be held.
func (m *Memory) deadLetter(q *memQueue, msg *memMsg, reason string) {
	if !q.dlx || q.dlxName != "" {
		return // no dead-letter exchange, or one the memory server lacks: dropped
	}
	key := msg.key
	if q.hasDLRK {
		key = q.dlrk
	}
	target := m.queues[key]
	if target == nil {
		return // unroutable: dropped
	}
	pub := msg.pub
	pub.Headers = addDeath(copyTable(pub.Headers), q.name, reason, msg.exchange, msg.key, pub.Expiration, time.Now())
	pub.Expiration = ""
	if reason != "rejected" && deadLetterCycle(pub.Headers["x-death"], key) {
		return // a cycle: dropped, as RabbitMQ does
	}
	m.enqueue(target, &memMsg{pub: pub, exchange: q.dlxName, key: key})
}

// deadLetterCycle reports whether deaths, the x-death header of a message
// being dead-lettered for a reason other than rejected, with this
// dead-lettering already recorded, closes a cycle through queue target
// that no client took part in: the records, most recent first, reach one
// that names target with no record of a reject on the way (that one
// included), and nothing but records. RabbitMQ 3.10 drops such a message
// rather than let it circle forever.
func deadLetterCycle(deaths any, target string) bool {
	records, _ := deaths.([]any)
	for _, d := range records {
		r, ok := d.(amqp.Table)
		if !ok {
			return false // put there by a client: not a cycle of the server's making
		}
		if r["queue"] == target {
			return r["reason"] != "rejected"
		}
		if r["reason"] == "rejected" {
			return false
		}
	}
	return false
}

// addDeath records in h a dead-lettering out of queue for reason, as
// RabbitMQ 3.10 does, and returns h:
//
//   - with no x-death, it sets x-death to the one new record, and
//     x-first-death-reason, -queue and -exchange, over any set before;
//   - with an x-death that is not an array, it sets x-death to the new
//     record alone;
//   - otherwise it groups the records by queue and reason, one record for
//     each, which reverses their order when there are two or more (the
//     server does so); the record of this queue and reason, if any, counts
//     one more and keeps its time, exchange and routing keys; it goes
//     first, or a new record with a count of 1 does.
//
// A record has count, reason, queue, time, exchange (the one the message
// was published to) and routing-keys, and original-expiration when the
// message had an Expiration.
func addDeath(h amqp.Table, queue, reason, exchange, key, expiration string, at time.Time) amqp.Table {
	if h == nil {
		h = amqp.Table{}
	}
	entry := amqp.Table{
		"count":        int64(1),
		"reason":       reason,
		"queue":        queue,
		"time":         time.Unix(at.Unix(), 0),
		"exchange":     exchange,
		"routing-keys": []any{key},
	}
	if expiration != "" {
		entry["original-expiration"] = expiration
	}
	v, present := h["x-death"]
	deaths, isArray := v.([]any)
	switch {
	case !present:
		h["x-first-death-reason"] = reason
		h["x-first-death-queue"] = queue
		h["x-first-death-exchange"] = exchange
		h["x-death"] = []any{entry}
		return h
	case !isArray:
		h["x-death"] = []any{entry}
		return h
	}
	others := make([]any, 0, len(deaths))
	for _, d := range groupDeaths(deaths) {
		if r, ok := d.(amqp.Table); ok && r["queue"] == queue && r["reason"] == reason {
			entry = copyTable(r)
			n, ok := header.Integer(r["count"])
			if !ok {
				n = 0 // RabbitMQ counts a record without a count as none
			}
			entry["count"] = n + 1
			continue
		}
		others = append(others, d)
	}
	h["x-death"] = append([]any{entry}, others...)
	return h
}

// groupDeaths returns the x-death records of deaths as RabbitMQ 3.10
// regroups them before it adds one: one or none as they are; of several,
// the first record of each queue and reason, given the number of such
// records as its count if it has none, in the reverse order. (An element
// that is not a table, which crashes the server's queue process, is kept as
// a record of its own.)
func groupDeaths(deaths []any) []any {
	if len(deaths) <= 1 {
		return deaths
	}
	same := func(a, b amqp.Table) bool {
		return reflect.DeepEqual(a["queue"], b["queue"]) && reflect.DeepEqual(a["reason"], b["reason"])
	}
	var grouped []any
	for i, d := range deaths {
		r, ok := d.(amqp.Table)
		if !ok {
			grouped = append(grouped, d)
			continue
		}
		seen, n := false, 0
		for j, e := range deaths {
			if o, ok := e.(amqp.Table); ok && same(r, o) {
				seen = seen || j < i
				n++
			}
		}
		if seen {
			continue
		}
		if _, ok := r["count"]; !ok {
			r = maps.Clone(r)
			r["count"] = int64(n)
		}
		grouped = append(grouped, r)
	}
	slices.Reverse(grouped)
	return grouped
}

// dispatch hands q's ready messages to its consumers with room under their
// prefetch, round-robin. m.mu must be held.
func (m *Memory) dispatch(q *memQueue) {
	for len(q.ready) > 0 && len(q.consumers) > 0 {
		var cons *memConsumer
		for range len(q.consumers) {
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
	h := copyTable(p.Headers)
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
func (m *Memory) startClock() {
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
func (m *Memory) clock() {
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
func (m *Memory) expire(now time.Time) time.Time {
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
	msg.Headers = copyTable(msg.Headers)
	msg.Body = bytes.Clone(msg.Body)
	if !msg.Timestamp.IsZero() {
		msg.Timestamp = time.Unix(msg.Timestamp.Unix(), 0)
	}
	return msg
}

// copyTable deep-copies t, converting values as the wire does.
func copyTable(t amqp.Table) amqp.Table {
	if t == nil {
		return nil
	}
	c := make(amqp.Table, len(t))
	for k, v := range t {
		c[k] = copyValue(v)
	}
	return c
}

func copyValue(v any) any {
	switch x := v.(type) {
	case amqp.Table:
		return copyTable(x)
	case []any:
		c := make([]any, len(x))
		for i, e := range x {
			c[i] = copyValue(e)
		}
		return c
	case []byte:
		return bytes.Clone(x)
	case int:
		return int32(x) // amqp091 sends an int as a 32-bit integer
	case time.Time:
		return time.Unix(x.Unix(), 0)
	}
	return v
}
