package broker

import (
	"context"
	"crypto/tls"
	"io"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// nodes starts n in-memory servers, closed at the end of t.
func nodes(t *testing.T, n int) ([]*brokertest.Server, Addresses) {
	var srvs []*brokertest.Server
	var urls Addresses
	for range n {
		m := brokertest.NewServer()
		t.Cleanup(m.Close)
		srvs = append(srvs, m)
		urls = append(urls, m.URL())
	}
	return srvs, urls
}

// Nodes that are down are skipped within one attempt, without a backoff
// wait; only when every node is down is the attempt a failure.
func TestClusterSkipsNodesThatAreDown(t *testing.T) {
	srvs, urls := nodes(t, 3)
	var seen recorded[string]
	var reconnects []ReconnectEvent
	b := NewCluster(urls, Options{Observer: Observer{
		Connect:   func(e ConnectEvent) { seen.add(e.Node) },
		Reconnect: func(e ReconnectEvent) { reconnects = append(reconnects, e) },
	}})
	defer b.Close()
	srvs[0].SetDown(true)
	srvs[2].SetDown(true)
	ctx := testContext(t, 10*time.Second)
	require.NoError(t, b.Declare(ctx, "q", Topology{}))
	assert.Equal(t, []string{urls[1]}, seen.all())
	assert.Empty(t, reconnects, "no backoff wait while a node answers")
	assert.LessOrEqual(t, srvs[0].Stats().Dials+srvs[2].Stats().Dials, 2, "each node that is down tried at most once")

	for _, m := range srvs {
		m.SetDown(true)
	}
	_, err := b.tr.Dial(ctx, "all down")
	require.ErrorIs(t, err, ErrUnreachable)
	for _, u := range urls {
		assert.Contains(t, err.Error(), u, "the error names every node")
	}
}

// Connections spread over the nodes, and the connection that follows one
// never goes to the node of the one before while another is up.
func TestClusterSpreadsConnections(t *testing.T) {
	_, urls := nodes(t, 3)
	b := NewCluster(urls, Options{})
	defer b.Close()
	ctx := testContext(t, 10*time.Second)
	count := map[string]int{}
	last := ""
	for range 60 {
		s, err := b.tr.Dial(ctx, "spread")
		require.NoError(t, err)
		assert.NotEqual(t, last, s.Node(), "the node just connected to is tried last")
		last = s.Node()
		count[last]++
		require.NoError(t, s.Close())
	}
	for _, u := range urls {
		assert.Positive(t, count[u], "connections to %s of 60: %v", u, count)
	}
}

// A consumer whose node goes down moves to another node and consumes
// there; the Observer and the log say which node is in use.
func TestClusterConsumerMovesToAnotherNode(t *testing.T) {
	srvs, urls := nodes(t, 2)
	var seen recorded[string]
	logs := fixtures.NewLogRecorder(t)
	b := NewCluster(urls, Options{
		Observer:     Observer{Connect: func(e ConnectEvent) { seen.add(e.Node) }},
		Logger:       slog.New(logs),
		ReconnectMin: time.Millisecond, ReconnectMax: 10 * time.Millisecond,
	})
	defer b.Close()
	ctx := testContext(t, 20*time.Second)
	top := Topology{Delays: testTiers}
	// The servers are not a cluster: the queue is declared on each.
	for _, u := range urls {
		m := New(u, Options{})
		require.NoError(t, m.Declare(ctx, "q", top))
		require.NoError(t, m.Publish(ctx, "", "q", amqp.Publishing{MessageId: u}))
		m.Close()
	}
	got := make(chan string, 2)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(cctx, "q", rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
			got <- d.MessageId
			return nil
		}), ConsumeOptions{Topology: top})
	}()
	first := <-got
	var firstNode *brokertest.Server
	for i, u := range urls {
		if u == first {
			firstNode = srvs[i]
		}
	}
	require.NotNil(t, firstNode)
	firstNode.SetDown(true)
	firstNode.CloseConnections()
	select {
	case second := <-got:
		assert.NotEqual(t, first, second)
	case <-time.After(10 * time.Second):
		t.Fatal("the consumer did not move to the other node")
	}
	cancel()
	require.NoError(t, <-done)
	consumers := 0
	for _, n := range seen.all() {
		consumers++
		assert.Contains(t, []string(urls), n)
	}
	assert.GreaterOrEqual(t, consumers, 2)
	assert.Positive(t, logs.Count("broker: connected", "node=\""+first+"\"", "role=\"consume q\""))
}

// Against RabbitMQ: a node that refuses connections (a closed port) is
// skipped for the one that answers.
func TestClusterRabbitMQSkipsARefusingNode(t *testing.T) {
	url := testenv.RabbitMQURL(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := "amqp://guest:guest@" + l.Addr().String() + "/"
	require.NoError(t, l.Close()) // nothing listens there now
	var seen recorded[string]
	b := NewCluster(Addresses{closed, url, closed}, Options{Observer: Observer{Connect: func(e ConnectEvent) { seen.add(e.Node) }}, ReconnectMin: 5 * time.Second})
	defer b.Close()
	ctx := testContext(t, 4*time.Second) // less than one backoff wait
	start := time.Now()
	_, err = b.Len(ctx, "rabbitmw-test-cluster-missing-queue")
	require.ErrorIs(t, err, ErrQueueNotFound)
	t.Logf("answered in %v", time.Since(start))
	uri, err := amqp.ParseURI(url)
	require.NoError(t, err)
	assert.Equal(t, []string{net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)) + "/"}, seen.all())
}

// Against RabbitMQ: a node that accepts TCP connections but never answers
// the AMQP handshake (a hung node, a proxy before a dead one) is skipped
// for the one that answers, without waiting out the handshake timeout
// (30 s): every connection, including the ones after the first, when
// the node that answers is the one last connected to, and so tried last.
func TestClusterRabbitMQSkipsAHungNode(t *testing.T) {
	url := testenv.RabbitMQURL(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	serveConns(t, l, func(c net.Conn) { io.Copy(io.Discard, c) }) // never answers
	hung := "amqp://guest:guest@" + l.Addr().String() + "/"
	b := NewCluster(Addresses{hung, url}, Options{})
	defer b.Close()
	for i := range 3 {
		ctx := testContext(t, 60*time.Second)
		start := time.Now()
		s, err := b.tr.Dial(ctx, "hung node")
		took := time.Since(start)
		require.NoError(t, err, "dial %d", i)
		require.NoError(t, s.Close())
		assert.Less(t, took, 5*time.Second, "dial %d", i)
	}
}

// A node whose certificate the client does not trust (its own, expired
// or not renewed, while the other nodes' are fine) is skipped for one
// that answers: each node has a certificate of its own, so the refusal
// says nothing of the others. Only when no node answers is it fatal
// (ErrCertificate), as with New.
func TestClusterSkipsANodeWithAnUntrustedCertificate(t *testing.T) {
	url := testenv.RabbitMQURL(t)
	other := newTestCA(t, "another CA")
	certPEM, keyPEM := other.issue(t, "localhost", true)
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)
	l, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{pair}})
	require.NoError(t, err)
	serveConns(t, l, func(c net.Conn) {
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		_ = c.(*tls.Conn).Handshake()
		c.Close()
	})
	untrusted := "amqps://guest:guest@" + l.Addr().String() + "/"
	trusted := newTestCA(t, "trusted CA")
	good := tlsFront(t, trusted, url)
	opts := Options{TLS: &tls.Config{RootCAs: trusted.pool()}}
	b := NewCluster(Addresses{untrusted, good}, opts)
	defer b.Close()
	for i := range 6 {
		s, err := b.tr.Dial(testContext(t, 10*time.Second), "untrusted node")
		require.NoError(t, err, "dial %d", i)
		require.NoError(t, s.Close())
	}

	alone := NewCluster(Addresses{untrusted, untrusted}, opts)
	defer alone.Close()
	_, err = alone.tr.Dial(testContext(t, 10*time.Second), "untrusted nodes")
	require.ErrorIs(t, err, ErrCertificate)
	assert.False(t, retryable(err), "fatal when no node answers: %v", err)
}

// tlsFront serves TLS on a port of its own, with a certificate of ca for
// localhost, and passes each connection on to the plain AMQP server of
// plainURL: a node of amqps:// without a TLS node of RabbitMQ. It returns
// its URL; its goroutines end with t.
func tlsFront(t *testing.T, ca *testCA, plainURL string) string {
	t.Helper()
	uri, err := amqp.ParseURI(plainURL)
	require.NoError(t, err)
	certPEM, keyPEM := ca.issue(t, "localhost", true)
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	require.NoError(t, err)
	l, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{pair}})
	require.NoError(t, err)
	serveConns(t, l, func(c net.Conn) {
		up, err := net.Dial("tcp", net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
		if err != nil {
			c.Close()
			return
		}
		upstream := make(chan struct{})
		go func() { // ends when c is closed, by either side or by serveConns
			defer close(upstream)
			io.Copy(up, c)
			up.Close()
		}()
		io.Copy(c, up)
		c.Close()
		<-upstream
	})
	_, port, err := net.SplitHostPort(l.Addr().String())
	require.NoError(t, err)
	return "amqps://" + uri.Username + ":" + uri.Password + "@localhost:" + port + "/" + url.PathEscape(uri.Vhost)
}

// serveConns accepts connections on l until t ends, and runs handle on
// each in a goroutine of its own. At the end of t it closes l, then every
// connection it accepted, and waits for the handlers, which must return
// once their connection is closed.
func serveConns(t *testing.T, l net.Listener, handle func(net.Conn)) {
	var (
		handlers sync.WaitGroup
		mu       sync.Mutex
		conns    []net.Conn
	)
	accepting := make(chan struct{})
	go func() { // ends when l is closed
		defer close(accepting)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			handlers.Go(func() { handle(c) })
		}
	}()
	t.Cleanup(func() {
		l.Close()
		<-accepting
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		handlers.Wait()
	})
}
