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
// is skipped at once for the next; only when none can is the attempt a
// failure, waited out with backoff. A node that refuses the credentials,
// or a URL that is malformed, is a fatal error, as with New.
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
	var errs []error
	for _, u := range urls {
		node := t.node(u)
		s, err := node.Dial(ctx, name)
		if err == nil {
			t.mu.Lock()
			t.last = u
			t.mu.Unlock()
			return s, nil
		}
		if !errors.Is(err, ErrUnreachable) || ctx.Err() != nil {
			return nil, err
		}
		errs = append(errs, err)
		t.cfg.log.LogAttrs(ctx, slog.LevelInfo, "broker: node unreachable; trying the next",
			slog.String("node", node.String()), slog.String("error", err.Error()))
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
