package broker

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A publish channel that the server nacks on every publish, as RabbitMQ
// 3.10 nacks a channel that published to a quorum queue whose leader
// died (for 30 s and more after a new leader is elected, while a new
// channel is confirmed at once), is replaced by a new channel without
// ending the session: the consume channel, and the delivery it holds
// unacknowledged, stay as they were. Each nack stays an error to its
// caller: no publish is reported confirmed that the server did not
// confirm, across the replacement too. (Before, every publish of the
// session was nacked for as long as the channel was.)
func TestRabbitMQStickyNacksReplaceThePublishChannel(t *testing.T) {
	ctx := testContext(t, time.Minute)
	logs := fixtures.NewLogRecorder(t)
	var events recorded[PublishChannelEvent]
	px, s := dialViaNackProxy(t, ctx, "rabbitmw test sticky nacks", Options{Logger: slog.New(logs), Observer: Observer{PublishChannel: events.add}})
	defer s.Close()
	q := queueName(t)
	require.NoError(t, s.Declare(ctx, []queueSpec{{Name: q}}), "declare")
	defer func() { assert.NoError(t, s.Delete(context.Background(), []string{q}), "delete") }()
	require.NoError(t, s.Publish(ctx, "", q, amqp.Publishing{MessageId: "before", Body: []byte("before")}), "publish before")
	deliveries, err := s.Consume(q, "sticky", 1)
	require.NoError(t, err, "consume")
	held := receive(t, deliveries)
	require.Equal(t, "before", held.MessageId)

	px.stick()
	var nacked, confirmed atomic.Int64
	err = s.Publish(ctx, "", q, amqp.Publishing{MessageId: "first", Body: []byte("first")})
	require.ErrorIs(t, err, ErrNacked, "the first publish after the channel turned to nacks")
	nacked.Add(1)

	// Publishers that publish until one of theirs is confirmed; each of
	// them must be, well before its budget.
	const (
		publishers = 8
		budget     = 10 * time.Second
	)
	began := time.Now()
	var wg sync.WaitGroup
	for i := range publishers {
		wg.Go(func() {
			for n := 0; time.Since(began) < budget; n++ {
				id := "p" + strconv.Itoa(i) + "-" + strconv.Itoa(n)
				err := s.Publish(ctx, "", q, amqp.Publishing{MessageId: id, Body: []byte(id)})
				switch {
				case err == nil:
					confirmed.Add(1)
					return
				case errors.Is(err, ErrNacked):
					nacked.Add(1)
				default:
					t.Errorf("publish %s: %v; want a confirm or ErrNacked", id, err)
					return
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d publishes nacked, %d confirmed, in %v", nacked.Load(), confirmed.Load(), time.Since(began).Round(time.Millisecond))
	assert.Equal(t, int64(publishers), confirmed.Load(), "publishers whose publish was confirmed within %v", budget)
	sentNacked, sentAcked := px.tally()
	assert.Equal(t, sentNacked, nacked.Load(), "publishes returned as nacked; want as many as the nacks the client received")
	assert.Equal(t, sentAcked, confirmed.Load(), "publishes returned as confirmed; want as many as the acks the client received")

	requireOpen(t, s)
	assert.GreaterOrEqual(t, logs.Count("publish channel replaced"), 1, "log records of a replaced channel")
	replaced := events.all()
	assert.Len(t, replaced, logs.Count("publish channel replaced"), "Observer.PublishChannel events: one per replacement")
	for _, e := range replaced {
		assert.NoError(t, e.Err, "event of a replacement")
		assert.Positive(t, e.Nacks, "nacks on the channel replaced")
		assert.Equal(t, s.Node(), e.Node, "node")
		assert.Contains(t, e.Connection, "rabbitmw test sticky nacks", "connection")
	}
	// The consume channel still holds its delivery: settling it lets the
	// next one come (prefetch 1).
	require.NoError(t, held.Ack(false), "ack of the delivery held across the replacement")
	next := receive(t, deliveries)
	assert.Equal(t, "first", next.MessageId, "the next delivery")
	require.NoError(t, next.Ack(false))
}

// receive returns the next delivery of ds, failing t if none comes
// within 10 s.
func receive(t *testing.T, ds <-chan amqp.Delivery) amqp.Delivery {
	t.Helper()
	select {
	case d, ok := <-ds:
		require.True(t, ok, "deliveries closed")
		return d
	case <-time.After(10 * time.Second):
		t.Fatal("no delivery within 10s")
		return amqp.Delivery{}
	}
}

// A nackProxy forwards one AMQP connection to target frame by frame.
// Once stick is called, it models RabbitMQ's sticky nacks: every
// basic.ack that the server sends on a channel that had published before
// stick reaches the client as a basic.nack. A channel that publishes for
// the first time after stick is confirmed as the server confirms it. It
// can also hold confirms back (hold), act on the opening of a channel
// (setOnOpen), have confirm mode refused (refuseConfirms) and lower
// channel_max (channelMax); it keeps track of the channels open. It
// closes its connections, and ends its goroutines, when the test ends.
type nackProxy struct {
	*tcpProxy

	mu     sync.Mutex
	stuck  map[uint16]bool               // channels whose acks turn to nacks; nil before stick
	unconf map[uint16]map[uint64]bool    // per channel, the tags published and not yet confirmed
	seq    map[uint16]uint64             // per channel, the tag of its last publish
	counts struct{ nacked, acked int64 } // publishes confirmed after stick, as the client sees them

	// The faults the tests put in, and the channels open.
	holding  map[uint16]bool // the channels whose confirms are held back
	held     [][]byte        // nacks of stuck channels held back, one tag each, in the order of their tags
	client   net.Conn        // the client's side of the connection, for release
	onOpen   func() ([][]byte, bool)
	txSelect map[uint16]bool // the channels sent a tx.select; nil: none will be
	chanMax  uint16
	open     map[uint16]bool // channels open, as the frames in both directions show
	maxOpen  int             // the most channels open at once since resetMaxOpen

	wmu sync.Mutex // held while a frame is written, in either direction
}

// dialViaNackProxy dials a session named name of the RabbitMQ server for
// tests through a nack proxy of t's own, and returns both; setup, if
// given, sets the proxy's faults before the session is dialled. The
// caller closes the session.
func dialViaNackProxy(t *testing.T, ctx context.Context, name string, opts Options, setup ...func(*nackProxy)) (*nackProxy, session) {
	t.Helper()
	uri, err := amqp.ParseURI(testenv.RabbitMQURL(t))
	require.NoError(t, err, "ParseURI")
	px := startNackProxy(t, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	for _, f := range setup {
		f(px)
	}
	uri.Host, uri.Port = "127.0.0.1", px.port()
	s, err := newAMQPTransport(uri.String(), opts.resolve()).Dial(ctx, name)
	require.NoError(t, err, "dial")
	return px, s
}

func startNackProxy(t *testing.T, target string) *nackProxy {
	t.Helper()
	p := &nackProxy{unconf: map[uint16]map[uint64]bool{}, seq: map[uint16]uint64{}, open: map[uint16]bool{}}
	p.tcpProxy = startTCPProxy(t, target,
		func(up, c net.Conn) { p.pump(up, c, true, p.clientFrame) },
		func(c, up net.Conn) {
			p.mu.Lock()
			p.client = c
			p.mu.Unlock()
			p.pump(c, up, false, p.serverFrame)
		})
	return p
}

// hold holds back, from now on, the confirms of the channels stuck now
// (see stick), as nacks of one tag each, until release.
func (p *nackProxy) hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.holding = maps.Clone(p.stuck)
}

// heldCount returns how many confirms are held back.
func (p *nackProxy) heldCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.held)
}

// release sends the client the first n confirms held back (all of them if
// n < 0), and stops holding more if it sent them all.
func (p *nackProxy) release(t *testing.T, n int) {
	t.Helper()
	p.mu.Lock()
	if n < 0 || n > len(p.held) {
		n = len(p.held)
		p.holding = nil
	}
	out := p.held[:n]
	p.held = p.held[n:]
	p.counts.nacked += int64(n)
	c := p.client
	p.mu.Unlock()
	p.wmu.Lock()
	defer p.wmu.Unlock()
	for _, f := range out {
		_, err := c.Write(f)
		require.NoError(t, err, "release of a held nack")
	}
}

// setOnOpen makes f be called when the client opens a channel after
// stick: the frames f returns are sent to the server before the
// channel.open, which is dropped if f returns false.
func (p *nackProxy) setOnOpen(f func() (before [][]byte, forward bool)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.onOpen = f
}

// refuseConfirms makes the server refuse to put the channels opened
// after stick in confirm mode: a tx.select is sent to the server before
// their confirm.select (its tx.select-ok does not reach the client), so
// that the server closes the channel with 406 PRECONDITION_FAILED.
func (p *nackProxy) refuseConfirms() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.txSelect = map[uint16]bool{}
}

// channelMax makes the server seem to offer n channels at most.
func (p *nackProxy) channelMax(n uint16) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.chanMax = n
}

// openChannels returns the channels open now, and the most open at once
// since the last resetMaxOpen.
func (p *nackProxy) openChannels() (open []uint16, most int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for ch := range p.open {
		open = append(open, ch)
	}
	slices.Sort(open)
	return open, p.maxOpen
}

func (p *nackProxy) resetMaxOpen() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.maxOpen = len(p.open)
}

// stick turns the acks of every channel that has published so far into
// nacks.
func (p *nackProxy) stick() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stuck = map[uint16]bool{}
	for ch := range p.seq {
		p.stuck[ch] = true
	}
}

// unconfirmed returns how many publishes the client sent that the server
// has not confirmed yet.
func (p *nackProxy) unconfirmed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, tags := range p.unconf {
		n += len(tags)
	}
	return n
}

// unstick lets the acks through as they are again; tally goes on
// counting.
func (p *nackProxy) unstick() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.stuck = map[uint16]bool{}
}

// tally returns how many publishes reached the client as nacked, and how
// many as acked, since stick.
func (p *nackProxy) tally() (nacked, acked int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.counts.nacked, p.counts.acked
}

// pump copies src to dst frame by frame (after the protocol header, when
// header is set), passing each frame through f and writing what it
// returns in its place, until either side fails.
func (p *nackProxy) pump(dst, src net.Conn, header bool, f func(frame []byte) [][]byte) {
	defer dst.Close()
	defer src.Close()
	if header {
		h := make([]byte, 8)
		if _, err := io.ReadFull(src, h); err != nil {
			return
		}
		if _, err := dst.Write(h); err != nil {
			return
		}
	}
	for {
		head := make([]byte, 7) // type, channel, size
		if _, err := io.ReadFull(src, head); err != nil {
			return
		}
		frame := make([]byte, 7+int(binary.BigEndian.Uint32(head[3:]))+1) // payload and frame end
		copy(frame, head)
		if _, err := io.ReadFull(src, frame[7:]); err != nil {
			return
		}
		for _, out := range f(frame) {
			p.wmu.Lock()
			_, err := dst.Write(out)
			p.wmu.Unlock()
			if err != nil {
				return
			}
		}
	}
}

// method returns the channel, class and method of a method frame.
func method(frame []byte) (ch, class, id uint16, ok bool) {
	if frame[0] != 1 || len(frame) < 11 {
		return 0, 0, 0, false
	}
	return binary.BigEndian.Uint16(frame[1:]), binary.BigEndian.Uint16(frame[7:]), binary.BigEndian.Uint16(frame[9:]), true
}

// methodFrame returns a method frame on channel ch with args.
func methodFrame(ch, class, id uint16, args []byte) []byte {
	f := binary.BigEndian.AppendUint16([]byte{1}, ch)
	f = binary.BigEndian.AppendUint32(f, uint32(4+len(args)))
	f = binary.BigEndian.AppendUint16(f, class)
	f = binary.BigEndian.AppendUint16(f, id)
	return append(append(f, args...), 0xce)
}

// clientFrame numbers the client's publishes, per channel, as the server
// does in confirm mode, and keeps track of the channels it opens.
func (p *nackProxy) clientFrame(frame []byte) [][]byte {
	ch, class, id, ok := method(frame)
	pass := [][]byte{frame}
	if !ok {
		return pass
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case class == 20 && id == 10: // channel.open
		if f := p.onOpen; p.stuck != nil && f != nil {
			p.mu.Unlock()
			before, forward := f()
			p.mu.Lock()
			if !forward {
				return before
			}
			pass = append(before, frame)
		}
		p.open[ch] = true
		p.maxOpen = max(p.maxOpen, len(p.open))
	case class == 85 && id == 10: // confirm.select
		if p.txSelect != nil && p.stuck != nil && !p.stuck[ch] {
			p.txSelect[ch] = true
			pass = [][]byte{methodFrame(ch, 90, 10, nil), frame}
		}
	case class == 20 && id == 41: // channel.close-ok, to a close by the server
		delete(p.open, ch)
	case class == 60 && id == 40: // basic.publish
		p.seq[ch]++
		if p.unconf[ch] == nil {
			p.unconf[ch] = map[uint64]bool{}
		}
		p.unconf[ch][p.seq[ch]] = true
	}
	return pass
}

// serverFrame turns a basic.ack on a stuck channel into a basic.nack,
// which has the same arguments (a delivery tag and a byte of bits), and
// counts the publishes it confirms; it holds them back if told to (hold).
// It also lowers the channel_max of connection.tune (channelMax), and
// keeps track of the channels closed.
func (p *nackProxy) serverFrame(frame []byte) [][]byte {
	ch, class, id, ok := method(frame)
	pass := [][]byte{frame}
	if !ok {
		return pass
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case class == 10 && id == 30: // connection.tune: channel-max first
		if m := binary.BigEndian.Uint16(frame[11:]); p.chanMax > 0 && (m == 0 || m > p.chanMax) {
			binary.BigEndian.PutUint16(frame[11:], p.chanMax)
		}
		return pass
	case class == 20 && id == 41: // channel.close-ok, to a close by the client
		delete(p.open, ch)
		return pass
	case class == 90 && id == 11 && p.txSelect[ch]: // tx.select-ok
		return nil
	case class != 60 || (id != 80 && id != 120): // not basic.ack, basic.nack
		return pass
	}
	tag := binary.BigEndian.Uint64(frame[11:])
	multiple := frame[19]&1 != 0
	var tags []uint64
	for t := range p.unconf[ch] {
		if t == tag || multiple && t < tag {
			delete(p.unconf[ch], t)
			tags = append(tags, t)
		}
	}
	n := int64(len(tags))
	if p.stuck == nil {
		return pass
	}
	if id == 80 && p.stuck[ch] {
		binary.BigEndian.PutUint16(frame[9:], 120)
		id = 120
	}
	if p.holding[ch] {
		slices.Sort(tags)
		for _, t := range tags {
			f := slices.Clone(frame)
			binary.BigEndian.PutUint64(f[11:], t)
			f[19] &^= 1 // not multiple
			p.held = append(p.held, f)
		}
		// In the order of their tags, which the client's library keeps.
		slices.SortFunc(p.held, func(a, b []byte) int {
			return cmp.Compare(binary.BigEndian.Uint64(a[11:]), binary.BigEndian.Uint64(b[11:]))
		})
		return nil
	}
	if id == 120 {
		p.counts.nacked += n
	} else {
		p.counts.acked += n
	}
	return pass
}

// A queue that nacks every publish for a reason of its own (here: at its
// length limit, with overflow reject-publish) costs at most one new
// publish channel per replaceInterval, whatever the rate of publishes;
// each publish is nacked, and the session goes on.
func TestRabbitMQReplacementsAreBoundedOnALegitimateNack(t *testing.T) {
	ctx := testContext(t, time.Minute)
	logs := fixtures.NewLogRecorder(t)
	tr := newAMQPTransport(testenv.RabbitMQURL(t), Options{Logger: slog.New(logs)}.resolve())
	s, err := tr.Dial(ctx, "rabbitmw test bounded replacements")
	require.NoError(t, err, "dial")
	defer s.Close()
	q := queueName(t)
	require.NoError(t, s.Declare(ctx, []queueSpec{{Name: q, Args: amqp.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"}}}), "declare")
	defer func() { assert.NoError(t, s.Delete(context.Background(), []string{q}), "delete") }()

	const span = 3 * replaceInterval
	began := time.Now()
	publishes := 0
	for time.Since(began) < span {
		err := s.Publish(ctx, "", q, amqp.Publishing{Body: []byte("x")})
		require.ErrorIs(t, err, ErrNacked, "publish %d to a full queue", publishes+1)
		publishes++
	}
	took := time.Since(began)
	replaced := logs.Count("publish channel replaced")
	t.Logf("%d publishes nacked in %v; publish channel replaced %d times", publishes, took.Round(time.Millisecond), replaced)
	assert.GreaterOrEqual(t, replaced, 1, "replacements")
	assert.LessOrEqual(t, replaced, int(took/replaceInterval)+1, "replacements in %v, at most one per %v", took, replaceInterval)
	requireOpen(t, s)
}

// RabbitMQ may nack a publish (here: to a queue at its length limit,
// with overflow reject-publish) before it acks the publishes sent before
// it, and then ack them with one multiple ack whose range spans the
// nacked tag. amqp091 (v1.16.0) hands such a nack, received out of order,
// to NotifyPublish as an ack: a message the server discarded would be
// reported confirmed. Every publish to the full queue must stay an
// ErrNacked. The order comes from the server's timing: on this machine
// (go test -race), about one round in 40 of 10 publishes at once (76 and
// 77 of 3000 rounds in two runs before the fix); 1000 rounds make it
// near certain.
func TestRabbitMQNackBeforeAMultipleAckStaysANack(t *testing.T) {
	ctx := testContext(t, 2*time.Minute)
	tr := newAMQPTransport(testenv.RabbitMQURL(t), Options{}.resolve())
	s, err := tr.Dial(ctx, "rabbitmw test nack before a multiple ack")
	require.NoError(t, err, "dial")
	defer s.Close()
	// Transient queues, as in the runs that first showed it.
	conn, err := amqp.Dial(testenv.RabbitMQURL(t))
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	full, open := queueName(t)+".full", queueName(t)+".open"
	_, err = ch.QueueDeclare(full, false, true, false, false, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	_, err = ch.QueueDeclare(open, false, true, false, false, nil)
	require.NoError(t, err)
	defer func() { assert.NoError(t, s.Delete(context.Background(), []string{full, open}), "delete") }()
	require.NoError(t, s.Publish(ctx, "", full, amqp.Publishing{Body: []byte("fills the queue")}))

	const rounds, batch = 1000, 10
	var confirmed atomic.Int64
	for r := range rounds {
		var wg sync.WaitGroup
		for i := range batch {
			wg.Add(1)
			go func() {
				defer wg.Done()
				// Ids of their own: publishes of one id wait for each
				// other's confirm.
				id := strconv.Itoa(r*batch + i)
				if i > 0 {
					assert.NoError(t, s.Publish(ctx, "", open, amqp.Publishing{MessageId: id, Body: []byte("x")}))
					return
				}
				err := s.Publish(ctx, "", full, amqp.Publishing{MessageId: id, Body: []byte("x")})
				if err == nil {
					confirmed.Add(1)
					return
				}
				assert.ErrorIs(t, err, ErrNacked)
			}()
		}
		wg.Wait()
		if t.Failed() {
			break
		}
	}
	assert.Zero(t, confirmed.Load(), "publishes to the full queue reported confirmed, of %d", rounds)
	ch.QueuePurge(open, false)
}

// A pubResult is the result of one publish of a test.
type pubResult struct {
	id, key string
	err     error
}

// publishAsync publishes a message of id to key on s, in a goroutine of
// its own, and sends its result to results.
func publishAsync(ctx context.Context, s session, id, key string, results chan<- pubResult) {
	go func() {
		err := s.Publish(ctx, "", key, amqp.Publishing{MessageId: id, Body: []byte(id)})
		results <- pubResult{id: id, key: key, err: err}
	}()
}

// next returns the next result, failing t if none comes within 10 s.
func next(t *testing.T, results <-chan pubResult) pubResult {
	t.Helper()
	select {
	case r := <-results:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no publish returned within 10s")
		return pubResult{}
	}
}

// stuckSession dials a session through a nack proxy, declares a queue of
// t's own, publishes one message on the publish channel (channel 1), and
// waits until the channel may be replaced (replaceInterval): from then
// on, px.stick makes the channel's first nack replace it at the next
// publish.
func stuckSession(t *testing.T, ctx context.Context, name string, logs *fixtures.LogRecorder, setup ...func(*nackProxy)) (*nackProxy, session, string) {
	t.Helper()
	return stuckSessionObserved(t, ctx, name, logs, Observer{}, setup...)
}

// stuckSessionObserved is stuckSession with obs as the session's Observer.
func stuckSessionObserved(t *testing.T, ctx context.Context, name string, logs *fixtures.LogRecorder, obs Observer, setup ...func(*nackProxy)) (*nackProxy, session, string) {
	t.Helper()
	px, s := dialViaNackProxy(t, ctx, name, Options{Logger: slog.New(logs), Observer: obs}, setup...)
	t.Cleanup(func() { s.Close() })
	q := queueName(t)
	require.NoError(t, s.Declare(ctx, []queueSpec{{Name: q}}), "declare")
	t.Cleanup(func() {
		// On a session of its own: the test's may have ended.
		s, err := newAMQPTransport(testenv.RabbitMQURL(t), Options{}.resolve()).Dial(context.Background(), "rabbitmw test cleanup")
		if assert.NoError(t, err, "dial for the cleanup") {
			assert.NoError(t, s.Delete(context.Background(), []string{q}), "delete")
			s.Close()
		}
	})
	require.NoError(t, s.Publish(ctx, "", q, amqp.Publishing{MessageId: "before", Body: []byte("before")}), "publish before")
	open, _ := px.openChannels()
	require.Equal(t, []uint16{1, 2}, open, "channels open: the publish and consume channels")
	time.Sleep(replaceInterval)
	return px, s, q
}

// nackWithOneWaiting turns the publish channel of a stuckSession to
// nacks, and publishes a1, nacked, and a2, whose confirm is held back:
// the next publish replaces the channel, with a2 waiting on it. It
// returns the channel a2's result comes to.
func nackWithOneWaiting(t *testing.T, ctx context.Context, px *nackProxy, s session, q string) chan pubResult {
	t.Helper()
	px.stick()
	px.hold()
	results := make(chan pubResult, 8)
	publishAsync(ctx, s, "a1", q, results)
	require.Eventually(t, func() bool { return px.heldCount() == 1 }, 10*time.Second, 5*time.Millisecond, "confirm of a1 held back")
	publishAsync(ctx, s, "a2", q, results)
	require.Eventually(t, func() bool { return px.heldCount() == 2 }, 10*time.Second, 5*time.Millisecond, "confirm of a2 held back")
	px.release(t, 1)
	r := next(t, results)
	require.Equal(t, "a1", r.id)
	require.ErrorIs(t, r.err, ErrNacked, "a1")
	return results
}

// The publishes that wait on a channel when it is replaced get their
// results from it, as they come after the swap: a nack stays ErrNacked, a
// return ErrUnroutable, and a publish of the same message id on the new
// channel waits until the one on the old channel has its result. The old
// channel is closed once nothing waits on it, and not before.
func TestRabbitMQConfirmsOfTheOldChannelComeAfterTheSwap(t *testing.T) {
	ctx := testContext(t, time.Minute)
	logs := fixtures.NewLogRecorder(t)
	px, s, q := stuckSession(t, ctx, "rabbitmw test old channel confirms", logs)
	px.stick()
	px.hold()
	nowhere := q + "-nowhere"
	results := make(chan pubResult, 8)
	// a1 first: the first confirm released is a1's.
	publishAsync(ctx, s, "a1", q, results)
	require.Eventually(t, func() bool { return px.heldCount() == 1 }, 10*time.Second, 5*time.Millisecond, "confirm of a1 held back")
	for _, id := range []string{"a2", "a3"} {
		publishAsync(ctx, s, id, q, results)
	}
	publishAsync(ctx, s, "x", nowhere, results) // returned, then confirmed
	require.Eventually(t, func() bool { return px.heldCount() == 4 }, 10*time.Second, 5*time.Millisecond, "confirms held back")
	got := map[string]error{}
	px.release(t, 1)
	r := next(t, results)
	require.Equal(t, "a1", r.id)
	require.ErrorIs(t, r.err, ErrNacked, "a1")

	// The next publish replaces the channel; the old one still has three
	// publishes waiting.
	require.NoError(t, s.Publish(ctx, "", q, amqp.Publishing{MessageId: "b", Body: []byte("b")}), "publish on the new channel")
	assert.Equal(t, 1, logs.Count("publish channel replaced"), "replacements")
	open, _ := px.openChannels()
	assert.Contains(t, open, uint16(1), "the old channel, while publishes wait on it")
	publishAsync(ctx, s, "x", q, results) // waits for the x on the old channel
	select {
	case r := <-results:
		t.Fatalf("publish %s to %s returned %v while the old channel's confirms were held back", r.id, r.key, r.err)
	case <-time.After(300 * time.Millisecond):
	}

	px.release(t, -1)
	for range 4 {
		r := next(t, results)
		got[r.id+"@"+r.key] = r.err
	}
	for _, id := range []string{"a2", "a3"} {
		assert.ErrorIs(t, got[id+"@"+q], ErrNacked, "publish %s on the old channel", id)
	}
	assert.ErrorIs(t, got["x@"+nowhere], ErrUnroutable, "the unroutable x, on the old channel")
	assert.NoError(t, got["x@"+q], "the routable x, on the new channel")
	require.Eventually(t, func() bool {
		open, _ := px.openChannels()
		return !slices.Contains(open, 1)
	}, 10*time.Second, 5*time.Millisecond, "the old channel closed once no publish waits on it")
	nacked, acked := px.tally()
	assert.Equal(t, int64(4), nacked, "nacks sent to the client")
	assert.Equal(t, int64(2), acked, "acks sent to the client")
	requireOpen(t, s)
}

// sessionGoroutines returns a check that every goroutine started since
// the call, but the proxies' (which end with the test), has ended.
func sessionGoroutines(t *testing.T) func() {
	before := goleak.IgnoreCurrent()
	return func() {
		t.Helper()
		goleak.VerifyNone(t, before, goleak.IgnoreAnyFunction("github.com/rabbitmw/rabbitmw/broker.(*tcpProxy).accept"),
			goleak.IgnoreAnyFunction("github.com/rabbitmw/rabbitmw/broker.(*nackProxy).pump"))
	}
}

// closeWithin closes s, failing t if Close does not return within d.
func closeWithin(t *testing.T, s session, d time.Duration) {
	t.Helper()
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case <-closed:
	case <-time.After(d):
		t.Fatalf("Close did not return within %v", d)
	}
}

// The connection lost while the publish channel is replaced (here: at
// its channel.open) ends the session: the publish that was to go on the
// new channel fails, and so do the publishes that wait on the old one;
// none is reported confirmed, and Close ends every goroutine.
func TestRabbitMQConnectionLostWhileThePublishChannelIsReplaced(t *testing.T) {
	ctx := testContext(t, time.Minute)
	leaks := sessionGoroutines(t)
	logs := fixtures.NewLogRecorder(t)
	px, s, q := stuckSession(t, ctx, "rabbitmw test cut at replacement", logs)
	results := nackWithOneWaiting(t, ctx, px, s, q)

	px.setOnOpen(func() ([][]byte, bool) {
		px.cut()
		return nil, false
	})
	err := s.Publish(ctx, "", q, amqp.Publishing{MessageId: "b", Body: []byte("b")})
	assert.ErrorIs(t, err, ErrConnectionLost, "the publish that replaced the channel")
	r := next(t, results)
	assert.ErrorIs(t, r.err, ErrConnectionLost, "a2, on the old channel")
	select {
	case <-s.Closed():
	case <-time.After(10 * time.Second):
		t.Fatal("the session did not end within 10s")
	}
	assert.ErrorIs(t, s.Publish(ctx, "", q, amqp.Publishing{MessageId: "c", Body: []byte("c")}), ErrConnectionLost, "a publish after the end")
	closeWithin(t, s, 10*time.Second)
	leaks()
}

// Close while the new publish channel is being opened (the server does
// not answer its channel.open) returns, fails the publishes in flight,
// and ends every goroutine.
func TestRabbitMQCloseWhileThePublishChannelIsReplaced(t *testing.T) {
	ctx := testContext(t, time.Minute)
	leaks := sessionGoroutines(t)
	logs := fixtures.NewLogRecorder(t)
	px, s, q := stuckSession(t, ctx, "rabbitmw test close at replacement", logs)
	results := nackWithOneWaiting(t, ctx, px, s, q)

	opening := make(chan struct{})
	px.setOnOpen(func() ([][]byte, bool) {
		close(opening)
		return nil, false // the channel.open is lost
	})
	publishAsync(ctx, s, "b", q, results)
	// A publish given up while the channel is being replaced.
	abandoned, cancel := context.WithCancel(ctx)
	publishAsync(abandoned, s, "c", q, results)
	select {
	case <-opening:
	case <-time.After(10 * time.Second):
		t.Fatal("no channel.open within 10s")
	}
	cancel()
	r := next(t, results)
	assert.Equal(t, "c", r.id, "the publish given up returns first")
	assert.ErrorIs(t, r.err, context.Canceled, "the publish given up")
	closeWithin(t, s, 10*time.Second)
	for range 2 {
		r := next(t, results)
		assert.Error(t, r.err, "publish %s in flight at Close", r.id)
	}
	leaks()
}

// A new publish channel that cannot be had (the connection's channels
// are all in use: channel_max; or the server refuses to put the new one
// in confirm mode) leaves the nacked one in use: each publish on it has
// its own result (a nack stays ErrNacked), the session goes on, a new
// channel is tried once a replaceInterval at most, and one refused is not
// left open.
func TestRabbitMQNoNewPublishChannel(t *testing.T) {
	for _, c := range []struct {
		name   string
		setup  func(px *nackProxy)
		before func(t *testing.T, ctx context.Context, px *nackProxy, s session, q string)
		log    string   // in the records of a replacement tried
		open   []uint16 // the channels open in the end
	}{
		{
			name:  "channel_max",
			setup: func(px *nackProxy) { px.channelMax(3) },
			before: func(t *testing.T, ctx context.Context, px *nackProxy, s session, q string) {
				// The third channel, for basic.get, stays open.
				_, ok, err := s.Get(ctx, q)
				require.NoError(t, err, "get")
				require.True(t, ok, "get of the message published before")
			},
			log:  "channel id space exhausted",
			open: []uint16{1, 2, 3},
		},
		{
			name:   "confirm mode refused",
			setup:  func(*nackProxy) {},
			before: func(_ *testing.T, _ context.Context, px *nackProxy, _ session, _ string) { px.refuseConfirms() },
			log:    "PRECONDITION_FAILED",
			open:   []uint16{1, 2},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := testContext(t, time.Minute)
			logs := fixtures.NewLogRecorder(t)
			var events recorded[PublishChannelEvent]
			px, s, q := stuckSessionObserved(t, ctx, "rabbitmw test no new publish channel", logs, Observer{PublishChannel: events.add}, c.setup)
			c.before(t, ctx, px, s, q)
			px.stick()

			const span = 3 * replaceInterval
			began := time.Now()
			publishes := 0
			for time.Since(began) < span {
				err := s.Publish(ctx, "", q, amqp.Publishing{MessageId: "m" + strconv.Itoa(publishes), Body: []byte("m")})
				require.ErrorIs(t, err, ErrNacked, "publish %d", publishes+1)
				publishes++
			}
			took := time.Since(began)
			tries := logs.Count("a new one cannot be opened", c.log)
			t.Logf("%d publishes nacked in %v; %d replacements tried", publishes, took.Round(time.Millisecond), tries)
			assert.GreaterOrEqual(t, tries, 1, "replacements tried")
			assert.LessOrEqual(t, tries, int(took/replaceInterval)+1, "replacements tried in %v, at most one per %v", took, replaceInterval)
			assert.Zero(t, logs.Count("publish channel replaced"), "replacements")
			failed := events.all()
			assert.Len(t, failed, tries, "Observer.PublishChannel events: one per replacement tried")
			for _, e := range failed {
				assert.ErrorContains(t, e.Err, c.log, "event of a replacement that failed")
				assert.Positive(t, e.Nacks, "nacks on the channel kept")
			}
			nacked, acked := px.tally()
			assert.Equal(t, int64(publishes), nacked, "nacks sent to the client")
			assert.Zero(t, acked, "acks sent to the client")
			require.Eventually(t, func() bool {
				open, _ := px.openChannels()
				return slices.Equal(open, c.open)
			}, 10*time.Second, 5*time.Millisecond, "channels open")
			requireOpen(t, s)
		})
	}
}

// Many publishers to a queue that refuses every publish (at its length
// limit with overflow reject-publish): the session never has more than two
// publish channels open (the one in use and the one it replaced), and
// closes the ones it replaced.
func TestRabbitMQReplacedChannelsAreClosed(t *testing.T) {
	ctx := testContext(t, time.Minute)
	logs := fixtures.NewLogRecorder(t)
	px, s := dialViaNackProxy(t, ctx, "rabbitmw test replaced channels closed", Options{Logger: slog.New(logs)})
	defer s.Close()
	q := queueName(t)
	require.NoError(t, s.Declare(ctx, []queueSpec{{Name: q, Args: amqp.Table{"x-max-length": int32(0), "x-overflow": "reject-publish"}}}), "declare")
	defer func() { assert.NoError(t, s.Delete(context.Background(), []string{q}), "delete") }()
	px.resetMaxOpen()

	const (
		publishers = 8
		span       = 3 * replaceInterval
	)
	began := time.Now()
	var wg sync.WaitGroup
	var publishes atomic.Int64
	for i := range publishers {
		wg.Go(func() {
			for n := 0; time.Since(began) < span; n++ {
				id := "p" + strconv.Itoa(i) + "-" + strconv.Itoa(n)
				err := s.Publish(ctx, "", q, amqp.Publishing{MessageId: id, Body: []byte(id)})
				if !assert.ErrorIs(t, err, ErrNacked, "publish %s", id) {
					return
				}
				publishes.Add(1)
			}
		})
	}
	wg.Wait()
	replaced := logs.Count("publish channel replaced")
	open, most := px.openChannels()
	t.Logf("%d publishes nacked by %d publishers in %v; %d replacements; channels open: %v, at most %d at once",
		publishes.Load(), publishers, time.Since(began).Round(time.Millisecond), replaced, open, most)
	assert.GreaterOrEqual(t, replaced, 2, "replacements")
	assert.LessOrEqual(t, most, 3, "channels open at once: consume, publish, and the publish channel replaced")
	require.Eventually(t, func() bool {
		open, _ := px.openChannels()
		return len(open) == 2
	}, 10*time.Second, 5*time.Millisecond, "channels open once the replaced one has its confirms")
}

// The server closing the old publish channel (here: for a passive declare
// of a missing queue, sent on it by the proxy) while the new one is being
// opened ends the session: the publishes that wait on the old channel
// fail, none is reported confirmed that the server did not confirm, and
// Close ends every goroutine.
func TestRabbitMQOldChannelClosedByTheServerWhileReplaced(t *testing.T) {
	ctx := testContext(t, time.Minute)
	leaks := sessionGoroutines(t)
	logs := fixtures.NewLogRecorder(t)
	px, s, q := stuckSession(t, ctx, "rabbitmw test old channel closed at replacement", logs)
	results := nackWithOneWaiting(t, ctx, px, s, q)

	missing := q + "-missing"
	declare := binary.BigEndian.AppendUint16(nil, 0) // reserved
	declare = append(declare, byte(len(missing)))
	declare = append(declare, missing...)
	declare = append(declare, 1)          // passive
	declare = append(declare, 0, 0, 0, 0) // no arguments
	px.setOnOpen(func() ([][]byte, bool) {
		return [][]byte{methodFrame(1, 50, 10, declare)}, true
	})
	err := s.Publish(ctx, "", q, amqp.Publishing{MessageId: "b", Body: []byte("b")})
	_, acked := px.tally()
	if err == nil {
		assert.Equal(t, int64(1), acked, "b returned confirmed: the acks the client received")
	}
	r := next(t, results)
	assert.ErrorIs(t, r.err, ErrConnectionLost, "a2, on the old channel")
	select {
	case <-s.Closed():
		assert.ErrorContains(t, s.Reason(), "NOT_FOUND", "the session's reason")
	case <-time.After(10 * time.Second):
		t.Fatal("the session did not end within 10s")
	}
	closeWithin(t, s, 10*time.Second)
	leaks()
}

// A publish channel is not replaced while the one it replaced still has
// publishes waiting for their confirms (at most two publish channels are
// open): the nacked one stays in use, each of its publishes nacked, until
// the one before has its confirms, and is replaced then.
func TestRabbitMQReplacementWaitsForTheReplacedChannel(t *testing.T) {
	ctx := testContext(t, time.Minute)
	logs := fixtures.NewLogRecorder(t)
	px, s, q := stuckSession(t, ctx, "rabbitmw test replacement waits", logs)
	results := nackWithOneWaiting(t, ctx, px, s, q)
	require.NoError(t, s.Publish(ctx, "", q, amqp.Publishing{MessageId: "b", Body: []byte("b")}), "publish on the second channel")
	require.Equal(t, 1, logs.Count("publish channel replaced"), "replacements")
	open, _ := px.openChannels()
	require.Len(t, open, 3, "channels open: the first publish channel, the consume channel, the second publish channel")
	second := open[2]

	// The second channel turns to nacks too; it is not replaced while a2
	// waits on the first.
	px.stick()
	time.Sleep(replaceInterval)
	began := time.Now()
	for n := 0; time.Since(began) < replaceInterval; n++ {
		err := s.Publish(ctx, "", q, amqp.Publishing{MessageId: "c" + strconv.Itoa(n), Body: []byte("c")})
		require.ErrorIs(t, err, ErrNacked, "publish c%d on the second channel", n)
	}
	assert.Equal(t, 1, logs.Count("publish channel replaced"), "replacements while a2 waits on the first channel")
	open, _ = px.openChannels()
	assert.Len(t, open, 3, "channels open while a2 waits on the first channel")

	px.release(t, -1)
	r := next(t, results)
	require.Equal(t, "a2", r.id)
	require.ErrorIs(t, r.err, ErrNacked, "a2")
	require.Eventually(t, func() bool {
		open, _ := px.openChannels()
		return !slices.Contains(open, 1)
	}, 10*time.Second, 5*time.Millisecond, "the first channel closed once a2 had its nack")
	// The first channel's goroutine ends just after the proxy sees the
	// channel closed: a publish sent in between still goes on the second
	// channel, and is nacked. The next one after it goes on a third.
	deadline := time.Now().Add(replaceInterval)
	for n := 0; ; n++ {
		err := s.Publish(ctx, "", q, amqp.Publishing{MessageId: "d" + strconv.Itoa(n), Body: []byte("d")})
		if err == nil {
			break
		}
		require.ErrorIs(t, err, ErrNacked, "publish d%d", n)
		require.True(t, time.Now().Before(deadline), "no publish confirmed on a third channel within %v of the first channel's close", replaceInterval)
	}
	assert.Equal(t, 2, logs.Count("publish channel replaced"), "replacements")
	require.Eventually(t, func() bool {
		open, _ := px.openChannels()
		return len(open) == 2 && !slices.Contains(open, second)
	}, 10*time.Second, 5*time.Millisecond, "the second channel closed once replaced")
}

// Many publishers, some of which give up on their publishes, while the
// server's acks turn to nacks and back, on the channels in use each time:
// a publish is reported confirmed only as often as the client received
// an ack, and nacked only as often as it received a nack; the session
// goes on, with three channels open at most.
func TestRabbitMQPublishersWhileNacksComeAndGo(t *testing.T) {
	ctx := testContext(t, time.Minute)
	logs := fixtures.NewLogRecorder(t)
	px, s, q := stuckSession(t, ctx, "rabbitmw test nacks come and go", logs)
	px.unstick()
	px.resetMaxOpen()

	const (
		publishers = 16
		span       = 4 * time.Second
	)
	var confirmed, nacked, gaveUp atomic.Int64
	began := time.Now()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(150+i%4*100) * time.Millisecond):
			}
			if i%2 == 0 {
				px.stick()
			} else {
				px.unstick()
			}
		}
	})
	var pubs sync.WaitGroup
	for i := range publishers {
		pubs.Go(func() {
			for n := 0; time.Since(began) < span; n++ {
				id := "p" + strconv.Itoa(i) + "-" + strconv.Itoa(n)
				pctx, cancel := ctx, context.CancelFunc(func() {})
				if (i+n)%5 == 0 {
					// Gives up at about the time of its confirm.
					pctx, cancel = context.WithTimeout(ctx, time.Duration(n%3)*time.Millisecond)
				}
				err := s.Publish(pctx, "", q, amqp.Publishing{MessageId: id, Body: []byte(id)})
				cancel()
				switch {
				case err == nil:
					confirmed.Add(1)
				case errors.Is(err, ErrNacked):
					nacked.Add(1)
				case errors.Is(err, context.DeadlineExceeded):
					gaveUp.Add(1)
				default:
					t.Errorf("publish %s: %v; want a confirm, ErrNacked or the context's error", id, err)
					return
				}
			}
		})
	}
	pubs.Wait()
	close(stop)
	wg.Wait()
	// The publishes given up get their confirms too.
	require.Eventually(t, func() bool { return px.unconfirmed() == 0 }, 10*time.Second, 5*time.Millisecond, "confirms of every publish sent")
	sentNacked, sentAcked := px.tally()
	open, most := px.openChannels()
	t.Logf("%d publishes confirmed, %d nacked, %d given up; the client received %d acks, %d nacks; %d replacements; channels open %v, at most %d at once",
		confirmed.Load(), nacked.Load(), gaveUp.Load(), sentAcked, sentNacked, logs.Count("publish channel replaced"), open, most)
	assert.GreaterOrEqual(t, logs.Count("publish channel replaced"), 1, "replacements")
	assert.GreaterOrEqual(t, nacked.Load(), int64(1), "publishes nacked")
	assert.LessOrEqual(t, confirmed.Load(), sentAcked, "publishes reported confirmed; the acks are")
	assert.LessOrEqual(t, nacked.Load(), sentNacked, "publishes reported nacked; the nacks are")
	assert.GreaterOrEqual(t, confirmed.Load()+gaveUp.Load(), sentAcked, "publishes confirmed or given up; the acks are")
	assert.GreaterOrEqual(t, nacked.Load()+gaveUp.Load(), sentNacked, "publishes nacked or given up; the nacks are")
	assert.LessOrEqual(t, most, 3, "channels open at once")
	requireOpen(t, s)
}

// A publish whose caller gives up as it is handed over returns the
// context's error, or its result if it was sent; never the session's
// internal errAbandoned (of a publish not sent because its caller gave
// up), which reached the caller when both were ready at once.
func TestRabbitMQPublishGivenUpReturnsTheContextsError(t *testing.T) {
	ctx := testContext(t, time.Minute)
	s, err := newAMQPTransport(testenv.RabbitMQURL(t), Options{}.resolve()).Dial(ctx, "rabbitmw test publish given up")
	require.NoError(t, err, "dial")
	defer s.Close()
	q := queueName(t)
	require.NoError(t, s.Declare(ctx, []queueSpec{{Name: q}}), "declare")
	defer func() { assert.NoError(t, s.Delete(context.Background(), []string{q}), "delete") }()

	const (
		publishers = 8
		each       = 400
	)
	var sent, gaveUp atomic.Int64
	var wg sync.WaitGroup
	for i := range publishers {
		wg.Go(func() {
			for n := range each {
				id := "p" + strconv.Itoa(i) + "-" + strconv.Itoa(n)
				pctx, cancel := context.WithCancel(ctx)
				// About as the publish is handed over, or sent.
				stop := time.AfterFunc(time.Duration(n%20)*10*time.Microsecond, cancel)
				err := s.Publish(pctx, "", q, amqp.Publishing{MessageId: id, Body: []byte(id)})
				stop.Stop()
				cancel()
				switch {
				case err == nil:
					sent.Add(1)
				case errors.Is(err, context.Canceled):
					gaveUp.Add(1)
				default:
					t.Errorf("publish %s: %v; want nil or context.Canceled", id, err)
					return
				}
			}
		})
	}
	wg.Wait()
	t.Logf("%d publishes confirmed, %d given up", sent.Load(), gaveUp.Load())
}

// requireOpen stops the test if s has closed.
func requireOpen(t *testing.T, s session) {
	t.Helper()
	select {
	case <-s.Closed():
		t.Fatalf("the session closed: %v", s.Reason())
	default:
	}
}

// A confirm, or a return and its confirm, that comes before send has got
// its publish's deferred confirmation back (the server answered before
// amqp091's Publish returned) is kept on the publish for send to resolve
// it with: a nack stays a nack, a return stays a return, and the publish
// is not resolved yet.
func TestConfirmBeforeTheWriteReturned(t *testing.T) {
	for _, c := range []struct {
		name     string
		returned bool
		ack      bool
		want     error
	}{
		{"acked", false, true, nil},
		{"nacked", false, false, ErrNacked},
		{"returned, then acked", true, true, ErrUnroutable},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &amqpSession{done: make(chan struct{}), byID: map[string]*pendingPublish{}, log: slog.New(slog.DiscardHandler)}
			pc := &pubChannel{
				s:        s,
				closed:   make(chan *amqp.Error, 1),
				returns:  make(chan amqp.Return),
				confirms: make(chan amqp.Confirmation),
				retire:   make(chan struct{}),
				ended:    make(chan struct{}),
				pending:  map[uint64]*pendingPublish{},
				returned: map[string]int{},
			}
			p := &pendingPublish{msg: amqp.Publishing{MessageId: "m"}, done: make(chan error, 1), resolved: make(chan struct{})}
			pc.pending[1] = p // sent, not yet written
			pc.start()
			if c.returned {
				pc.returns <- amqp.Return{MessageId: "m"}
			}
			pc.confirms <- amqp.Confirmation{DeliveryTag: 1, Ack: c.ack}
			close(pc.closed)
			close(pc.confirms)
			<-pc.ended
			s.wg.Wait()

			s.pendMu.Lock()
			defer s.pendMu.Unlock()
			assert.False(t, p.settled, "publish resolved before send had written it")
			require.True(t, p.confirmed, "confirm kept on the publish")
			// What send resolves it with once the write returns.
			assert.Equal(t, c.want, pc.result(p, p.ack), "result")
		})
	}
}
