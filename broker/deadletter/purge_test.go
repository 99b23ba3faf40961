package deadletter

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/url"
	"slices"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// ackCutter is a TCP proxy to an AMQP server that cuts each connection
// when the client sends its first basic.ack, without passing it on: the
// connection drops after the ack was written and before the server
// processed it.
type ackCutter struct {
	ln     net.Listener
	server string
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
	cuts   int
}

func newAckCutter(t *testing.T, amqpURL string) (*ackCutter, string) {
	u, err := url.Parse(amqpURL)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &ackCutter{ln: ln, server: u.Host}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	u.Host = ln.Addr().String()
	return p, u.String()
}

// accept serves connections until the listener is closed.
func (p *ackCutter) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.server)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { // server to client; ends when either side closes
			defer p.wg.Done()
			io.Copy(c, s)
			c.Close()
		}()
		go func() { // client to server, frame by frame
			defer p.wg.Done()
			defer s.Close()
			defer c.Close()
			p.pipe(c, s)
		}()
	}
}

// pipe passes the client's frames on until the first basic.ack.
func (p *ackCutter) pipe(c, s net.Conn) {
	hdr := make([]byte, 8) // "AMQP" 0 0 9 1
	if _, err := io.ReadFull(c, hdr); err != nil {
		return
	}
	if _, err := s.Write(hdr); err != nil {
		return
	}
	for {
		head := make([]byte, 7) // type, channel, size
		if _, err := io.ReadFull(c, head); err != nil {
			return
		}
		rest := make([]byte, binary.BigEndian.Uint32(head[3:])+1) // payload and frame end
		if _, err := io.ReadFull(c, rest); err != nil {
			return
		}
		// A method frame of class basic (60), method ack (80).
		if head[0] == 1 && len(rest) >= 4 && binary.BigEndian.Uint16(rest) == 60 && binary.BigEndian.Uint16(rest[2:]) == 80 {
			p.mu.Lock()
			p.cuts++
			p.mu.Unlock()
			return
		}
		if _, err := s.Write(slices.Concat(head, rest)); err != nil {
			return
		}
	}
}

func (p *ackCutter) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}

// A message that Purge reports removed is gone, even when the connection
// drops right after its ack was written, before the server processed it.
func TestPurgeReportsOnlyWhatTheServerRemoved(t *testing.T) {
	f := setup(t, backends[1], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "b", "c")
	cutter, via := newAckCutter(t, testenv.RabbitMQURL(t))
	b := broker.New(via, broker.Options{ReconnectMin: 20 * time.Millisecond, ReconnectMax: 100 * time.Millisecond})
	t.Cleanup(func() { b.Close() })

	removed, err := New(b).Purge(ctx, f.q, PurgeOptions{})
	t.Logf("Purge: removed %v, error %v", ids(removed), err)
	cutter.mu.Lock()
	cuts := cutter.cuts
	cutter.mu.Unlock()
	require.Equal(t, 1, cuts, "the proxy cut the connection at an ack")
	require.Eventually(t, func() bool { return f.length(f.q+".dlq") == 3 }, 10*time.Second, 20*time.Millisecond,
		"the server requeues the three messages whose acks it never processed")
	assert.Error(t, err, "Purge with its connection lost")
	assert.Empty(t, ids(removed), "messages reported removed, and still in the dead-letter queue")
}

// Purge removes what it selects and leaves the rest in order.
func testPurgeSelected(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "typed-b", "c", "typed-d")
	removed, err := f.in.Purge(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*deadletter.typedErr"}, DryRun: true})
	require.NoError(t, err, "Purge dry run")
	assert.Equal(t, []string{"typed-b", "typed-d"}, ids(removed), "selected")
	assert.Equal(t, 4, f.length(f.q+".dlq"), "dead-letter queue after a dry run")
	removed, err = f.in.Purge(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*deadletter.typedErr"}})
	require.NoError(t, err, "Purge")
	assert.Equal(t, []string{"typed-b", "typed-d"}, ids(removed), "removed")
	assert.Equal(t, []string{"a", "c"}, deliveryIDs(f.drain(f.q+".dlq")), "left")
	f.assertSettled(t)
}

// A purge whose context ends (the command's Ctrl-C) removes nothing more,
// and returns every message it removed: the dead-letter queue holds the
// others. The context ends as the reading of the queue ends, before the
// first acknowledgement.
func TestPurgeInterrupted(t *testing.T) {
	f := setup(t, backends[1], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	const n = 2 * purgeBatch
	for i := range n {
		require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: fmt.Sprintf("m%d", i),
			Headers: amqp.Table{broker.HeaderOriginalQueue: f.q}}))
	}
	pctx, interrupt := context.WithCancel(ctx)
	defer interrupt()
	removed, err := f.in.Purge(pctx, f.q, PurgeOptions{ScanProgress: func(done, total int) {
		if done == total {
			interrupt()
		}
	}})
	require.ErrorIs(t, err, context.Canceled, "Purge")
	left := len(f.drain(f.q + ".dlq"))
	assert.Equal(t, n, len(removed)+left, "messages returned removed, and left in the dead-letter queue")
	f.assertSettled(t)
}
