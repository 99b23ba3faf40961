// Package frameproxy is a TCP proxy to an AMQP 0-9-1 server, for tests: it
// passes the frames of each connection, both ways, through a rule that
// lets a frame through, drops it, or cuts the connection at it.
package frameproxy

import (
	"encoding/binary"
	"io"
	"net"
	"net/url"
	"slices"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A Frame is one AMQP frame.
type Frame struct {
	Type    byte // 1 method, 2 content header, 3 content body, 8 heartbeat
	Channel uint16
	Payload []byte
}

// IsMethod reports whether f is a method frame of class and method: 60,
// 80 for basic.ack.
func (f Frame) IsMethod(class, method uint16) bool {
	return f.Type == 1 && len(f.Payload) >= 4 &&
		binary.BigEndian.Uint16(f.Payload) == class && binary.BigEndian.Uint16(f.Payload[2:]) == method
}

// A Direction says who sent a frame.
type Direction int

const (
	FromClient Direction = iota
	FromServer
)

// A Verdict is what becomes of a frame.
type Verdict int

const (
	Pass Verdict = iota // passed on
	Drop                // left out; the connection goes on
	Cut                 // left out, and the connection closed both ways
)

// A Rule decides the fate of each frame. It is called from the goroutines
// of the proxy's connections, concurrently.
type Rule func(dir Direction, f Frame) Verdict

// Start starts a proxy to the server of amqpURL, and returns the URL that
// reaches the server through it. The proxy stops at the end of t: its
// goroutines (one that accepts, two a connection) have then ended.
func Start(t testing.TB, amqpURL string, rule Rule) string {
	t.Helper()
	u, err := url.Parse(amqpURL)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &proxy{ln: ln, server: u.Host, rule: rule}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	u.Host = ln.Addr().String()
	return u.String()
}

type proxy struct {
	ln     net.Listener
	server string
	rule   Rule
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  []net.Conn
}

// accept serves connections until the listener is closed; each
// connection's goroutines end when either side closes.
func (p *proxy) accept() {
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
		go func() {
			defer p.wg.Done()
			defer c.Close()
			defer s.Close()
			hdr := make([]byte, 8) // "AMQP" 0 0 9 1
			if _, err := io.ReadFull(c, hdr); err != nil {
				return
			}
			if _, err := s.Write(hdr); err != nil {
				return
			}
			p.pipe(FromClient, c, s)
		}()
		go func() {
			defer p.wg.Done()
			defer c.Close()
			defer s.Close()
			p.pipe(FromServer, s, c)
		}()
	}
}

// pipe passes the frames of src on to dst, as the rule says, until either
// side closes or the rule cuts.
func (p *proxy) pipe(dir Direction, src, dst net.Conn) {
	for {
		head := make([]byte, 7) // type, channel, size
		if _, err := io.ReadFull(src, head); err != nil {
			return
		}
		rest := make([]byte, binary.BigEndian.Uint32(head[3:])+1) // payload and frame end
		if _, err := io.ReadFull(src, rest); err != nil {
			return
		}
		f := Frame{Type: head[0], Channel: binary.BigEndian.Uint16(head[1:]), Payload: rest[:len(rest)-1]}
		switch p.rule(dir, f) {
		case Drop:
			continue
		case Cut:
			return
		}
		if _, err := dst.Write(slices.Concat(head, rest)); err != nil {
			return
		}
	}
}

func (p *proxy) close() {
	p.ln.Close()
	p.mu.Lock()
	for _, c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
