package broker

import (
	"net"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A tcpProxy accepts connections on a loopback port of its own and
// connects each to target; the proxies of the tests (handshakeCutter,
// stallProxy, nackProxy) are made of it, each with its own way of
// copying.
type tcpProxy struct {
	l      net.Listener
	target string
	wg     sync.WaitGroup

	mu    sync.Mutex
	conns []net.Conn
}

// startTCPProxy starts a proxy to target. For each client c it connects
// to target (up) and runs toServer(up, c) and toClient(c, up), each on a
// goroutine of its own, which must return once either connection is
// closed. When the test ends, it closes every connection and waits for
// those goroutines: cleanups that unblock them must be registered after
// startTCPProxy (cleanups run last registered first).
func startTCPProxy(t *testing.T, target string, toServer, toClient func(dst, src net.Conn)) *tcpProxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err, "listen")
	p := &tcpProxy{l: l, target: target}
	p.wg.Add(1)
	go p.accept(toServer, toClient) // ends when l is closed
	t.Cleanup(func() {
		l.Close()
		p.cut()
		p.wg.Wait()
	})
	return p
}

func (p *tcpProxy) port() int { return p.l.Addr().(*net.TCPAddr).Port }

// cut closes every connection the proxy holds, as a network that drops
// them would: the server and the clients see them closed.
func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.Close()
	}
}

func (p *tcpProxy) accept(toServer, toClient func(dst, src net.Conn)) {
	defer p.wg.Done()
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		p.wg.Add(2)
		go func() {
			defer p.wg.Done()
			toServer(up, c)
		}()
		go func() {
			defer p.wg.Done()
			toClient(c, up)
		}()
	}
}
