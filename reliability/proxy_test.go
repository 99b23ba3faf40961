//go:build reliability

package reliability_test

// A TCP proxy that the test can cut: from then on it forwards nothing,
// either way, and answers nothing, but keeps its connections open and
// accepts new ones, as a network partition that drops packets would. Reads
// through it block until the client's own timeouts give up.

import (
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

type proxy struct {
	addr   string
	target string
	l      net.Listener

	mu    sync.Mutex
	cut   bool
	conns map[net.Conn]bool // open connections, both sides
	wg    sync.WaitGroup    // the accept loop and the pumps
	// sent, if set, is called with the bytes a client sent, once they are
	// forwarded. It is called under mu: it must be quick.
	sent func([]byte)
	// lag delays what the server sends, each read of it, before it is
	// forwarded: a slow link, or a slow server.
	lag time.Duration
}

// brokerProxy starts a proxy to the run's RabbitMQ server, and returns it
// and the AMQP URL that reaches the server through it.
func (r *run) brokerProxy() (*proxy, string) {
	r.t.Helper()
	uri, err := amqp.ParseURI(r.amqpURL)
	require.NoError(r.t, err)
	px := startProxy(r.t, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	host, port, _ := net.SplitHostPort(px.addr)
	uri.Host = host
	uri.Port, _ = strconv.Atoi(port)
	return px, uri.String()
}

// startProxy starts a proxy to target on a free loopback port. It is
// closed, and its goroutines ended, when t ends.
func startProxy(t *testing.T, target string) *proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{addr: l.Addr().String(), target: target, l: l, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.accept() // ends when l is closed
	t.Cleanup(func() {
		l.Close()
		p.closeAll()
		p.wg.Wait()
	})
	return p
}

func (p *proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			continue
		}
		p.mu.Lock()
		cut := p.cut
		p.mu.Unlock()
		if cut {
			// Accepted, and never answered: the pump reads and drops.
			p.wg.Add(1)
			go p.pump(nil, c, true)
			continue
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		if !p.track(up) {
			c.Close()
			continue
		}
		p.wg.Add(2)
		go p.pump(up, c, true) // client to server
		go p.pump(c, up, false)
	}
}

// track registers c, unless the proxy is closing (the listener is closed).
func (p *proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conns == nil {
		c.Close()
		return false
	}
	p.conns[c] = true
	return true
}

// pump copies from src to dst until either closes; while the proxy is cut
// (or dst is nil) it reads and drops. Closing one side closes the other.
// fromClient says that src is a client, whose bytes sent sees.
func (p *proxy) pump(dst, src net.Conn, fromClient bool) {
	defer p.wg.Done()
	defer func() {
		src.Close()
		if dst != nil {
			dst.Close()
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && dst != nil {
			p.mu.Lock()
			cut, sent, lag := p.cut, p.sent, p.lag
			p.mu.Unlock()
			if lag > 0 && !fromClient {
				time.Sleep(lag) // the slow link this proxy plays
			}
			if !cut {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					return
				}
				if fromClient && sent != nil {
					p.mu.Lock()
					sent(buf[:n])
					p.mu.Unlock()
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// onSent sets the function that sees what clients send (nil: none).
func (p *proxy) onSent(f func([]byte)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sent = f
}

// slow delays what the server sends by lag from now on (0: none).
func (p *proxy) slow(lag time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lag = lag
}

// partition stops all traffic through the proxy.
func (p *proxy) partition() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
}

// heal lets traffic through again. The connections open during the
// partition are closed, as a client would find them broken; new ones work.
func (p *proxy) heal() {
	p.mu.Lock()
	p.cut = false
	conns := p.conns
	p.conns = map[net.Conn]bool{}
	p.mu.Unlock()
	for c := range conns {
		c.Close()
	}
}

func (p *proxy) closeAll() {
	p.mu.Lock()
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	for c := range conns {
		c.Close()
	}
}
