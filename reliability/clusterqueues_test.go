//go:build reliability

package reliability_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/rabbitnode"
)

// TestClusterSupportQueuesOutliveANode kills the node that holds the
// dead-letter queue (its home, or its leader) of a topology with a quorum
// work queue. The queue keeps its majority, so a consumer must carry on:
// its reconnect declares the topology, and its settlements store
// dead-letter and delay copies.
func TestClusterSupportQueuesOutliveANode(t *testing.T) {
	requireCtl(t)
	c := startCluster(t)
	queue := "rmw-support-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	topo := broker.Topology{Quorum: true, QuorumSupport: true, Delays: []time.Duration{time.Second}}
	qs, err := topo.Queues(queue)
	require.NoError(t, err)
	b := broker.NewCluster(broker.Addresses(c.urls), broker.Options{})
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	require.NoError(t, b.Declare(ctx, queue, topo))

	n := c.homeOf(t, qs.DeadLetter)
	n.Kill()
	t.Logf("SIGKILL %s, which holds %s", n.Name, qs.DeadLetter)

	// Once the queues have a leader on a live node, a dead-letter copy
	// and a delayed retry, as a settlement publishes them, are each
	// stored, and the delayed one reaches the work queue. (A classic queue
	// keeps its dead home.) The delay tier was declared on the same
	// connection, so its leader may have died too; a publish to a queue
	// whose leader is dead can leave the channel nacked until the session
	// replaces it (see RELIABILITY.md, scenario 18).
	for _, q := range []string{qs.DeadLetter, qs.Delays[0]} {
		assert.Eventually(t, func() bool {
			home, err := c.tryHomeOf(q)
			return err == nil && home != n
		}, 30*time.Second, 500*time.Millisecond, "%s on a live node", q)
	}
	publish := func(key string) error {
		// RabbitMQ nacks what reaches a quorum queue during an election;
		// a settlement publishes its copy again.
		deadline := time.Now().Add(10 * time.Second)
		for {
			err := b.Publish(ctx, "", key, amqp.Publishing{Body: []byte(key)})
			if !errors.Is(err, broker.ErrNacked) || time.Now().After(deadline) {
				return err
			}
			time.Sleep(500 * time.Millisecond) // the election, on the servers
		}
	}
	assert.NoError(t, publish(qs.DeadLetter), "dead-letter copy")
	assert.NoError(t, publish(qs.Delays[0]), "delay copy")
	var lenErr error
	stored := assert.Eventually(t, func() bool {
		dead, err := b.Len(ctx, qs.DeadLetter)
		if err != nil {
			lenErr = err
			return false
		}
		work, err := b.Len(ctx, queue)
		if err != nil {
			lenErr = err
			return false
		}
		lenErr = nil
		return dead == 1 && work == 1
	}, 30*time.Second, 200*time.Millisecond, "the dead-letter copy in %s and the delayed one back in %s", qs.DeadLetter, queue)
	if !stored {
		t.Logf("the last count's error: %v", lenErr)
	}

	// What each consumer's reconnect does first.
	dctx, dcancel := context.WithTimeout(ctx, 30*time.Second)
	defer dcancel()
	assert.NoError(t, b.Declare(dctx, queue, topo), "declare with %s down", n.Name)
}

// homeOf returns the node that holds queue: a classic queue's only node,
// a quorum queue's leader.
func (c *cluster) homeOf(t *testing.T, queue string) *rabbitnode.Node {
	t.Helper()
	n, err := c.tryHomeOf(queue)
	require.NoError(t, err)
	return n
}

// tryHomeOf is homeOf, returning an error instead of failing.
func (c *cluster) tryHomeOf(queue string) (*rabbitnode.Node, error) {
	live := c.live()
	if live == nil {
		return nil, errors.New("no node runs")
	}
	out, err := live.TryCtl("list_queues", "name", "pid", "-q", "--no-table-headers")
	if err != nil {
		return nil, fmt.Errorf("list_queues: %w: %s", err, out)
	}
	for _, line := range strings.Split(out, "\n") {
		name, pid, ok := strings.Cut(line, "\t")
		if !ok || name != queue {
			continue
		}
		// A classic queue's pid is <name@host.N.N.N>; a quorum queue's
		// is its leader's {Name, 'name@host'}.
		pid = strings.TrimSpace(pid)
		var node string
		if strings.HasPrefix(pid, "<") {
			node, _, _ = strings.Cut(strings.TrimPrefix(pid, "<"), ".")
		} else if _, rest, ok := strings.Cut(pid, ","); ok {
			node = strings.Trim(rest, " '}")
		}
		if n := c.byName(node); n != nil {
			return n, nil
		}
	}
	return nil, fmt.Errorf("no node holds %s in:\n%s", queue, out)
}
