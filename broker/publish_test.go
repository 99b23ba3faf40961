package broker

import (
	"context"
	"encoding/binary"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// The publishes of one amqp091 session, from 16 goroutines, while its
// connection closes: each returns, none blocks. The close and the confirms
// race; whatever their order, each publish is settled once. (Before, a
// publish waiting for the channel's mutex while the channel shut down was
// resolved by the confirms goroutine and again by its own failed Publish,
// and the second resolution blocked forever, holding the session's locks;
// every publish after it blocked too.)
func TestRabbitMQPublishesSettleWhenTheConnectionCloses(t *testing.T) {
	url := testenv.RabbitMQURL(t)
	b := New(url, Options{})
	t.Cleanup(func() { b.Close() })
	ctx := testContext(t, 2*time.Minute)
	q, top := queueName(t), Topology{Delays: []time.Duration{time.Second}}
	require.NoError(t, b.Declare(ctx, q, top), "Declare")
	t.Cleanup(func() { b.Delete(context.Background(), q, top) })

	tr := newAMQPTransport(url, Options{}.resolve())
	const (
		publishers = 16
		maxTries   = 300
		budget     = 45 * time.Second
	)
	began := time.Now()
	tries, settled := 0, 0
	for ; tries < maxTries && time.Since(began) < budget; tries++ {
		s, err := tr.Dial(ctx, "rabbitmw test publish race")
		require.NoError(t, err, "dial")
		var (
			wg        sync.WaitGroup
			confirmed atomic.Int64
			started   = make(chan struct{})
			once      sync.Once
		)
		for range publishers {
			wg.Go(func() {
				for {
					err := s.Publish(ctx, "", q, amqp.Publishing{Body: []byte("x")})
					if err != nil {
						return
					}
					if confirmed.Add(1) >= publishers {
						once.Do(func() { close(started) })
					}
				}
			})
		}
		select {
		case <-started:
		case <-time.After(20 * time.Second):
			t.Fatalf("try %d: no publish confirmed in 20s", tries+1)
		}
		closed := make(chan error, 1)
		go func() { closed <- s.Close() }()
		returned := make(chan struct{})
		go func() { wg.Wait(); close(returned) }()
		select {
		case <-returned:
		case <-time.After(15 * time.Second):
			t.Fatalf("try %d: publishes still blocked 15s after their connection was closed; want each to return", tries+1)
		}
		select {
		case <-closed:
		case <-time.After(15 * time.Second):
			t.Fatalf("try %d: session close did not return within 15s", tries+1)
		}
		settled += int(confirmed.Load())
	}
	t.Logf("%d tries in %v; %d publishes confirmed", tries, time.Since(began).Round(time.Millisecond), settled)
	require.NoError(t, b.Delete(ctx, q, top), "Delete")
}

// A publish whose socket stops taking bytes (a server that stops reading,
// as under a resource alarm, or a network that stops answering) returns
// when its context is done, and closing the session then ends its
// goroutines. amqp091's Publish, PublishWithContext included, watches no
// context once it has started writing.
func TestRabbitMQPublishHonoursItsContextOnAStalledSocket(t *testing.T) {
	ctx := testContext(t, time.Minute)
	px, s := dialViaStallProxy(t, ctx, "rabbitmw test stalled publish")
	// A round trip before the stall (no queue has the empty name).
	require.ErrorIs(t, s.Publish(ctx, "", "", amqp.Publishing{Body: []byte("x")}), ErrUnroutable, "publish before the stall")

	px.stall()
	// Far more than the socket buffers hold: the write blocks.
	body := make([]byte, 64<<20)
	pctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.Publish(pctx, "", "", amqp.Publishing{Body: body}) }()
	select {
	case err := <-done:
		assert.ErrorIs(t, err, context.DeadlineExceeded, "publish on a stalled socket")
	case <-time.After(10 * time.Second):
		t.Fatal("publish on a stalled socket still blocked 10s after its 1s context ended")
	}
	// A second publish waits behind the first one's write: its context
	// ends it too.
	pctx2, cancel2 := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel2()
	go func() { done <- s.Publish(pctx2, "", "", amqp.Publishing{Body: []byte("y")}) }()
	select {
	case err := <-done:
		assert.ErrorIs(t, err, context.DeadlineExceeded, "second publish on a stalled socket")
	case <-time.After(10 * time.Second):
		t.Fatal("second publish on a stalled socket still blocked 10s after its context ended")
	}
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	select {
	case <-closed:
	case <-time.After(20 * time.Second):
		t.Fatal("closing a session with a write blocked did not return within 20s")
	}
}

// A stallProxy forwards TCP connections to target until stall is called:
// from then on it forwards nothing more from its clients, and reads at
// most one more chunk of each (their writes block once the socket buffers
// are full), and still forwards what the server sends. It closes every
// connection, and ends its goroutines, when the test ends.
type stallProxy struct {
	*tcpProxy

	mu   sync.Mutex
	gate chan struct{} // closed while client bytes flow
	sent []byte        // what clients sent since record, if recording
	rec  bool
}

// record starts keeping what clients send, forgetting what was kept.
func (p *stallProxy) record() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.rec, p.sent = true, nil
}

// headerFrameSize returns the size field of the last content header frame
// (type 2) that a client sent since record. The recording must start at
// a frame's beginning.
func (p *stallProxy) headerFrameSize(t *testing.T) int {
	t.Helper()
	p.mu.Lock()
	b := p.sent
	p.mu.Unlock()
	size := -1
	for len(b) >= 8 {
		n := int(binary.BigEndian.Uint32(b[3:7]))
		if len(b) < 8+n {
			t.Fatalf("recorded a partial frame of %d bytes", n)
		}
		if b[0] == 2 {
			size = n
		}
		b = b[8+n:]
	}
	if size < 0 {
		t.Fatal("no header frame recorded")
	}
	return size
}

// dialViaStallProxy dials a session named name of the RabbitMQ server for
// tests through a stall proxy of t's own, and returns both. The caller
// closes the session.
func dialViaStallProxy(t *testing.T, ctx context.Context, name string) (*stallProxy, session) {
	t.Helper()
	uri, err := amqp.ParseURI(testenv.RabbitMQURL(t))
	require.NoError(t, err, "ParseURI")
	px := startStallProxy(t, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	uri.Host, uri.Port = "127.0.0.1", px.port()
	s, err := newAMQPTransport(uri.String(), Options{}.resolve()).Dial(ctx, name)
	require.NoError(t, err, "dial")
	return px, s
}

func startStallProxy(t *testing.T, target string) *stallProxy {
	t.Helper()
	p := &stallProxy{gate: make(chan struct{})}
	close(p.gate)
	p.tcpProxy = startTCPProxy(t, target,
		func(up, c net.Conn) { p.pump(up, c, true) },
		func(c, up net.Conn) { p.pump(c, up, false) })
	t.Cleanup(p.resume) // before the proxy's: its pumps wait for the gate
	return p
}

func (p *stallProxy) stall() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.gate = make(chan struct{})
}

// resume lets the client bytes held since stall flow again.
func (p *stallProxy) resume() {
	p.mu.Lock()
	defer p.mu.Unlock()
	select {
	case <-p.gate:
	default:
		close(p.gate)
	}
}

// pump copies src to dst until either fails; a gated pump waits for the
// gate before each read.
func (p *stallProxy) pump(dst, src net.Conn, gated bool) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		if gated {
			p.mu.Lock()
			g := p.gate
			p.mu.Unlock()
			<-g
		}
		n, err := src.Read(buf)
		if n > 0 && gated {
			p.mu.Lock()
			if p.rec {
				p.sent = append(p.sent, buf[:n]...)
			}
			p.mu.Unlock()
		}
		if n > 0 && gated {
			// Read before the stall, or as it began: held too.
			p.mu.Lock()
			g := p.gate
			p.mu.Unlock()
			<-g
		}
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}
