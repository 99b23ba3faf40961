package broker

import (
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A connection that the network cuts during the AMQP handshake is a lost
// connection, retried, and not a refusal. amqp091 reports a socket closed
// after connection.start-ok as ErrCredentials and one closed after
// connection.open as ErrVhost, although nothing was refused. (RabbitMQ
// closes the socket after start-ok without a word on wrong credentials
// too: TestRabbitMQWrongPassword checks that they stay fatal at once.)
func TestRabbitMQHandshakeCut(t *testing.T) {
	for _, tc := range []struct {
		name   string
		method uint16 // the client's connection method whose frame the cut drops
	}{
		{"after start-ok", 11},
		{"after open", 40},
	} {
		t.Run(tc.name, func(t *testing.T) {
			uri, err := amqp.ParseURI(testenv.RabbitMQURL(t))
			require.NoError(t, err)
			px := startHandshakeCutter(t, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)), tc.method)
			uri.Host, uri.Port = "127.0.0.1", px.port()
			tr := newAMQPTransport(uri.String(), Options{}.resolve())
			ctx := testContext(t, 20*time.Second)

			// Dial may retry the handshake itself; if it fails, it is a
			// lost connection.
			s, err := tr.Dial(ctx, "handshake cut")
			if err == nil {
				s.Close()
			} else {
				assert.ErrorIs(t, err, ErrUnreachable, "a handshake cut is a lost connection")
				assert.NotErrorIs(t, err, ErrAccessRefused, "a handshake cut refuses nothing")
			}
			require.Equal(t, 1, px.cuts(), "handshakes cut")

			s, err = tr.Dial(ctx, "after the cut")
			require.NoError(t, err, "the next dial, not cut")
			s.Close()
		})
	}
}

// handshakeCutter forwards connections to target, except that on its
// first connection it closes both sides instead of forwarding the client's
// frame of the given connection method (class 10).
type handshakeCutter struct {
	px     *tcpProxy
	method uint16
	mu     sync.Mutex
	first  bool
	cut    int // handshakes cut
}

func (p *handshakeCutter) cuts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cut
}

func startHandshakeCutter(t *testing.T, target string, method uint16) *handshakeCutter {
	t.Helper()
	p := &handshakeCutter{method: method, first: true}
	p.px = startTCPProxy(t, target, p.clientToServer, func(c, up net.Conn) {
		defer c.Close()
		io.Copy(c, up)
	})
	return p
}

func (p *handshakeCutter) port() int { return p.px.port() }

// clientToServer copies the protocol header, then frame by frame; on
// the proxy's first connection, the frame of p.method closes both sides
// instead.
func (p *handshakeCutter) clientToServer(up, c net.Conn) {
	defer up.Close()
	defer c.Close()
	p.mu.Lock()
	cut := p.first
	p.first = false
	p.mu.Unlock()
	header := make([]byte, 8)
	if _, err := io.ReadFull(c, header); err != nil {
		return
	}
	if _, err := up.Write(header); err != nil {
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
		if cut && head[0] == 1 && len(rest) >= 4 &&
			binary.BigEndian.Uint16(rest[0:]) == 10 && binary.BigEndian.Uint16(rest[2:]) == p.method {
			p.mu.Lock()
			p.cut++
			p.mu.Unlock()
			return // the deferred closes cut both sides
		}
		if _, err := up.Write(append(head, rest...)); err != nil {
			return
		}
	}
}
