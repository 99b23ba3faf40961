package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// A Resolver returns the AMQP URLs of the nodes of a cluster, for
// [NewCluster]. It is asked again before each attempt to connect, so
// that it can follow a cluster whose members change (from DNS, a service
// registry). Resolve must be safe for concurrent use; an error is a
// failure to connect that may be temporary: the broker tries again with
// backoff.
type Resolver interface {
	Resolve(ctx context.Context) ([]string, error)
}

// ResolverFunc is a Resolver that calls f.
type ResolverFunc func(ctx context.Context) ([]string, error)

// Resolve returns f(ctx).
func (f ResolverFunc) Resolve(ctx context.Context) ([]string, error) { return f(ctx) }

// Addresses is a Resolver of a fixed list of AMQP URLs.
type Addresses []string

// Resolve returns a copy of a.
func (a Addresses) Resolve(context.Context) ([]string, error) {
	return append([]string(nil), a...), nil
}

// NewCluster returns a Broker for a cluster of RabbitMQ nodes, whose AMQP
// URLs r returns; otherwise it is [New]. Each connection (the one that
// Publish and the inspection methods share, each Consume call's, each
// dead-letter operation's) goes to one node: the nodes are tried in a
// random order, so that a fleet of consumers spreads over the cluster,
// with the node last connected to tried last, so that the connection
// that replaces a lost one goes elsewhere. A node that cannot be reached
// is skipped at once for the next, and a node that has not answered
// within 2 s (one that accepts TCP but never completes the handshake) has
// the next tried beside it, the first to answer taken; only when none can
// be reached is the attempt a failure, waited out with backoff. A node
// that refuses the credentials, or a URL that is malformed, is a fatal
// error, as with New. A node whose certificate is refused is skipped, as
// each node has its own; only if no node answers is that refusal the
// fatal error (ErrCertificate).
//
// The node in use is in the log record "broker: connected" (attribute
// node) and in [Observer.Connect].
//
// A queue lives on its nodes: a classic queue on one, a quorum queue
// (Topology.Quorum) on a majority. A consumer connected to any node
// consumes from it, and carries on through the loss of a node only if
// the queue does: declare the work queue a quorum queue.
func NewCluster(r Resolver, opts Options) *Broker {
	if r == nil {
		panic("broker: NewCluster: nil Resolver")
	}
	cfg := opts.resolve()
	return newBroker(&clusterTransport{r: r, cfg: cfg}, cfg)
}

// clusterTransport connects to one of the nodes a Resolver returns.
type clusterTransport struct {
	r   Resolver
	cfg config

	mu   sync.Mutex
	last string // the URL last connected to
}

func (t *clusterTransport) String() string {
	if a, ok := t.r.(Addresses); ok {
		return "cluster of " + strconv.Itoa(len(a)) + " nodes"
	}
	return "cluster"
}

// Dial tries the nodes in turn (see NewCluster).
func (t *clusterTransport) Dial(ctx context.Context, name string) (session, error) {
	urls, err := t.r.Resolve(ctx)
	switch {
	case err != nil:
		return nil, fmt.Errorf("%w: resolve the nodes: %w", ErrUnreachable, err)
	case len(urls) == 0:
		return nil, fmt.Errorf("%w: the resolver returned no node", ErrUnreachable)
	}
	// A URL that no dial can use is refused whichever node this
	// connection would go to: a typo in one of them would otherwise show
	// only when a reconnect happened to pick it.
	for _, u := range urls {
		if a, ok := t.node(u).(*amqpTransport); ok {
			if err := a.check(); err != nil {
				return nil, err
			}
		}
	}
	t.mu.Lock()
	last := t.last
	t.mu.Unlock()
	rand.Shuffle(len(urls), func(i, j int) { urls[i], urls[j] = urls[j], urls[i] })
	for i, u := range urls[:len(urls)-1] {
		if u == last {
			urls[i], urls[len(urls)-1] = urls[len(urls)-1], urls[i]
			break
		}
	}
	return t.race(ctx, name, urls)
}

// clusterStagger is how long a node has to answer before the next is
// tried beside it. A node that accepts TCP but never answers (a hung
// node, a proxy before a dead one) would otherwise hold a connection for
// the whole handshake timeout, and for every connection once the node
// that answers is the one last used, tried last.
const clusterStagger = 2 * time.Second

// dialResult is the outcome of one node's dial, for race.
type dialResult struct {
	url string
	s   session
	err error
}

// race dials the nodes of urls in their order, each once the one before
// failed or has not answered within clusterStagger, and returns the first
// session opened. A dial still running then is cancelled, and its
// session, if it opens all the same, closed. A fatal error of a node
// (credentials refused, a malformed URL) is returned at once, as is ctx's
// end.
func (t *clusterTransport) race(ctx context.Context, name string, urls []string) (session, error) {
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	results := make(chan dialResult, len(urls))
	next, pending := 0, 0
	start := func() {
		u := urls[next]
		next++
		pending++
		go func() { // ends when the dial does; dctx bounds it
			s, err := t.node(u).Dial(dctx, name)
			results <- dialResult{u, s, err}
		}()
	}
	// finish cancels the dials still running and closes what they open;
	// its goroutine ends with the last of them.
	finish := func() {
		cancel()
		if n := pending; n > 0 {
			go func() {
				for range n {
					if r := <-results; r.err == nil {
						r.s.Close()
					}
				}
			}()
		}
	}
	start()
	stagger := time.NewTimer(clusterStagger)
	defer stagger.Stop()
	var errs []error
	var certErr error // the first ErrCertificate
	for pending > 0 {
		select {
		case r := <-results:
			pending--
			if r.err == nil {
				finish()
				t.mu.Lock()
				t.last = r.url
				t.mu.Unlock()
				return r.s, nil
			}
			switch {
			case errors.Is(r.err, ErrCertificate) && ctx.Err() == nil:
				// Each node has a certificate of its own: the others may
				// be trusted. Fatal only if no node answers.
				if certErr == nil {
					certErr = r.err
				}
				t.cfg.log.LogAttrs(ctx, slog.LevelError, "broker: node's certificate refused; trying the next",
					slog.String("node", t.node(r.url).String()), slog.String("error", r.err.Error()))
			case !errors.Is(r.err, ErrUnreachable) || ctx.Err() != nil:
				finish()
				return nil, r.err
			default:
				errs = append(errs, r.err)
				t.cfg.log.LogAttrs(ctx, slog.LevelInfo, "broker: node unreachable; trying the next",
					slog.String("node", t.node(r.url).String()), slog.String("error", r.err.Error()))
			}
			if next < len(urls) {
				start()
				stagger.Reset(clusterStagger)
			}
		case <-stagger.C:
			if next < len(urls) {
				t.cfg.log.LogAttrs(ctx, slog.LevelInfo, "broker: node slow to answer; trying the next beside it",
					slog.String("node", t.node(urls[next-1]).String()), slog.Duration("waited", clusterStagger))
				start()
				stagger.Reset(clusterStagger)
			}
		}
	}
	if certErr != nil {
		return nil, certErr
	}
	return nil, errors.Join(errs...)
}

// node returns the transport of the node at url: a brokertest server
// for a "memory://" URL (so that tests can make a cluster of them), else
// RabbitMQ.
func (t *clusterTransport) node(url string) transport.Transport {
	if strings.HasPrefix(url, transport.MemoryScheme) {
		return transport.Lookup(url)
	}
	return newAMQPTransport(url, t.cfg)
}

// dial opens a session for role (empty for the shared connection), and
// says which node it is on.
func (b *Broker) dial(ctx context.Context, queue, role string) (session, error) {
	name := b.cfg.connName
	if role != "" {
		name += " " + role
	}
	s, err := b.tr.Dial(ctx, name+" ("+b.cfg.process+")")
	if err != nil {
		return nil, err
	}
	b.cfg.obs.connect(queue, s.Node())
	b.cfg.log.LogAttrs(ctx, slog.LevelInfo, "broker: connected",
		slog.String("node", s.Node()), slog.String("queue", queue), slog.String("role", role))
	return s, nil
}
