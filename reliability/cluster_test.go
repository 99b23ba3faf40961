//go:build reliability

package reliability_test

// Scenarios 18a–d on a real RabbitMQ cluster: three nodes of the suite's
// own (internal/rabbitnode: own names, ports, directories and cookie,
// joined with rabbitmqctl join_cluster, removed when the test ends), a
// quorum work queue on all three. Each scenario runs two loads at once,
// one over Redis and one over the PostgreSQL inbox: each has two
// consumers given all three addresses and a publisher that publishes
// with confirms throughout, through the faults:
//
//	a. SIGKILL the node a consumer is connected to, mid-stream; restart it
//	b. SIGKILL the node that leads the quorum queue; restart it once
//	   each load has consumed, and had a publish sent after the SIGKILL
//	   confirmed, which must come within 15 s, the node down
//	c. a rolling restart of the three nodes, one after another
//	d. stop two of the three nodes (the queue loses its majority), start
//	   them again: consumption stops and resumes by itself
//
// Required: nothing confirmed to the publisher is lost (a publish is
// either confirmed or returned to the publisher as an error); nothing is
// applied twice with the inbox; with Redis, twice only in the documented
// gap (a consumer cut between its effect and its done mark: never here,
// since no consumer process dies, and so none is allowed). Measured: the
// time from each fault to the first effect after it.

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/rabbitnode"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A cluster is three RabbitMQ nodes joined into one cluster.
type cluster struct {
	nodes []*rabbitnode.Node
	urls  []string
}

func startCluster(t *testing.T) *cluster {
	t.Helper()
	began := time.Now()
	dir := rabbitnode.Dir(t)
	var cfgs []rabbitnode.Config
	for i := 1; i <= 3; i++ {
		cfgs = append(cfgs, rabbitnode.Config{Name: "rmwc" + strconv.Itoa(i)})
	}
	c := &cluster{nodes: rabbitnode.StartAll(t, dir, cfgs...)}
	for _, n := range c.nodes[1:] {
		n.Ctl("stop_app")
		n.Ctl("join_cluster", c.nodes[0].Name)
		n.Ctl("start_app")
	}
	status := c.nodes[0].Ctl("cluster_status", "--formatter", "json")
	for _, n := range c.nodes {
		if !strings.Contains(status, `"`+n.Name+`"`) {
			t.Fatalf("node %s not in the cluster: %s", n.Name, status)
		}
		c.urls = append(c.urls, n.URL())
	}
	t.Logf("cluster of %d nodes formed in %v", len(c.nodes), time.Since(began).Round(time.Millisecond))
	return c
}

// live returns a node that runs, to ask.
func (c *cluster) live() *rabbitnode.Node {
	for _, n := range c.nodes {
		if n.Running() {
			return n
		}
	}
	return nil
}

func (c *cluster) byName(name string) *rabbitnode.Node {
	for _, n := range c.nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// nodeOf returns the node of the consume connection of consumer (its
// process name).
func (c *cluster) nodeOf(t *testing.T, consumer string) *rabbitnode.Node {
	t.Helper()
	// A connection's pid, <name@host.N.N.N>, names its node.
	out := c.live().Ctl("list_connections", "pid", "client_properties", "-q", "--no-table-headers")
	for _, line := range strings.Split(out, "\n") {
		pid, props, ok := strings.Cut(line, "\t")
		if ok && strings.Contains(props, "consume ") && strings.Contains(props, "("+consumer+")") {
			node, _, _ := strings.Cut(strings.TrimPrefix(pid, "<"), ".")
			if n := c.byName(node); n != nil {
				return n
			}
		}
	}
	t.Fatalf("no consume connection of %s in:\n%s", consumer, out)
	return nil
}

// leaderOf returns the node that leads the quorum queue.
func (c *cluster) leaderOf(t *testing.T, queue string) *rabbitnode.Node {
	t.Helper()
	out := c.live().Ctl("list_queues", "name", "leader", "-q", "--no-table-headers")
	for _, line := range strings.Split(out, "\n") {
		if name, leader, ok := strings.Cut(line, "\t"); ok && name == queue {
			if n := c.byName(strings.TrimSpace(leader)); n != nil {
				return n
			}
		}
	}
	t.Fatalf("no leader of %s in:\n%s", queue, out)
	return nil
}

// A clusterLoad is one store's load in a scenario: a run on the cluster,
// its consumers, and its publisher.
type clusterLoad struct {
	*run
	store   string
	procs   []*proc
	pub     *tracker
	stopPub context.CancelFunc
	pubDone chan struct{}
	// republished is, when measured (scenario b), how long after the
	// fault the first publish sent after it was confirmed.
	republished time.Duration
}

// A tracker records the fate of every publish.
type tracker struct {
	mu        sync.Mutex
	confirmed []string
	failed    map[string]error
	// sent has, for each confirmed publish in confirmed's order, when it
	// was sent; at, when its confirm came.
	sent, at []time.Time
}

// result records the result err of publish id, sent at sent.
func (tr *tracker) result(id string, sent time.Time, err error) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if err == nil {
		tr.confirmed = append(tr.confirmed, id)
		tr.sent = append(tr.sent, sent)
		tr.at = append(tr.at, time.Now())
	} else {
		tr.failed[id] = err
	}
}

// confirmedSince reports how long after since the first confirmed
// publish sent after since was confirmed, if one was.
func (tr *tracker) confirmedSince(since time.Time) (time.Duration, bool) {
	tr.mu.Lock()
	defer tr.mu.Unlock()
	for i, sent := range tr.sent {
		if !sent.Before(since) {
			return tr.at[i].Sub(since), true
		}
	}
	return 0, false
}

const (
	clusterPublishers = 2
	clusterPace       = 25 * time.Millisecond // per publisher: 80 messages a second in all
)

func startClusterLoad(t *testing.T, c *cluster, scenario, store string) *clusterLoad {
	t.Helper()
	topo := broker.Topology{Quorum: true, QuorumSupport: true, Delays: tiers}
	l := &clusterLoad{run: newRunOn(t, scenario+store, topo, c.urls...), store: store,
		pub: &tracker{failed: map[string]error{}}, pubDone: make(chan struct{})}
	opts := consumerOpts{
		workers:      4,
		lease:        2 * time.Second,
		timeout:      time.Second,
		busy:         500 * time.Millisecond,
		unavailable:  500 * time.Millisecond,
		work:         2 * time.Millisecond,
		reconnectMax: time.Second,
	}
	if store == "pg" {
		opts = l.usePostgres(testenv.PostgresURL(t), opts)
	}
	// The publisher runs until stopPub, each publish with a deadline of
	// its own: one that cannot be confirmed by then is returned as an
	// error, and counted as such.
	ctx, cancel := context.WithCancel(context.Background())
	l.stopPub = cancel
	var wg sync.WaitGroup
	var next sync.Mutex
	seq := 0
	for range clusterPublishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(clusterPace)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				next.Lock()
				seq++
				id := fmt.Sprintf("m-%06d", seq)
				next.Unlock()
				pctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				sent := time.Now()
				err := l.b.Publish(pctx, "", l.queue, amqp.Publishing{MessageId: id, Body: []byte(id)})
				cancel()
				l.pub.result(id, sent, err)
			}
		}()
	}
	go func() {
		wg.Wait()
		close(l.pubDone)
	}()
	t.Cleanup(func() { cancel(); <-l.pubDone })
	for i := 1; i <= 2; i++ {
		l.procs = append(l.procs, l.startConsumer(fmt.Sprintf("%s%s-%d", scenario, store, i), opts))
	}
	return l
}

// firstEffectAfter waits until an effect is applied after mark (a total
// count) and returns how long after since that took.
func (l *clusterLoad) firstEffectAfter(ctx context.Context, mark int64, since time.Time) (time.Duration, error) {
	if err := l.waitCount(ctx, "total", mark+1); err != nil {
		return 0, err
	}
	return time.Since(since), nil
}

// finish stops the publisher, waits until the run is quiet and ends it,
// and checks and records the figures.
func (l *clusterLoad) finish(t *testing.T, ctx context.Context, scenario, faults, measuredFrom string, recovery []time.Duration) {
	t.Helper()
	l.stopPub()
	<-l.pubDone
	l.pub.mu.Lock()
	confirmed := slices.Clone(l.pub.confirmed)
	failed := len(l.pub.failed)
	for id, err := range l.pub.failed {
		t.Logf("%s: publish %s returned an error: %v", l.store, id, err)
		break
	}
	l.pub.mu.Unlock()
	require.NoError(t, l.awaitQuiet(ctx, len(confirmed), 3*time.Second), "%s", l.store)
	e := l.end(ctx, confirmed, l.procs...)
	e.wantEachOnce(t)
	var worst time.Duration
	var rs []string
	for _, d := range recovery {
		worst = max(worst, d)
		rs = append(rs, d.Round(10*time.Millisecond).String())
	}
	store := "Redis"
	if l.store == "pg" {
		store = "PostgreSQL inbox"
	}
	note := fmt.Sprintf("%d publishes confirmed, %d returned as errors; %s to the first effect after it: %s (worst %v)",
		len(confirmed), failed, measuredFrom, strings.Join(rs, ", "), worst.Round(10*time.Millisecond))
	if l.republished > 0 {
		note += fmt.Sprintf("; to the first confirm of a publish sent after it: %v", l.republished.Round(10*time.Millisecond))
	}
	record(t, e.v.counted(row{
		Scenario: "18" + scenario + " cluster, " + store,
		Messages: len(confirmed) + failed,
		Faults:   faults,
		Note:     note,
	}))
}

// A clusterScenario injects its faults into a cluster while loads run,
// and returns what it did and, for each fault, how long it took from the
// fault to the first effect after it.
type clusterScenario struct {
	name  string
	fault func(t *testing.T, ctx context.Context, c *cluster, loads []*clusterLoad) (string, []time.Duration)
	// from says where the times fault returns are measured from.
	from string
}

// TestCluster runs the four scenarios on one cluster.
func TestCluster(t *testing.T) {
	requireCtl(t)
	c := startCluster(t)
	for _, sc := range []clusterScenario{
		{"a", killConsumersNode, "from the SIGKILL"},
		{"b", killLeader, "from the SIGKILL"},
		{"c", rollingRestart, "from each node's SIGTERM"},
		{"d", loseMajority, "from the start of the two nodes (their boot included)"},
	} {
		t.Run(sc.name, func(t *testing.T) {
			began := time.Now()
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
			defer cancel()
			loads := []*clusterLoad{startClusterLoad(t, c, "cluster"+sc.name, "redis"), startClusterLoad(t, c, "cluster"+sc.name, "pg")}
			for _, l := range loads {
				require.NoError(t, l.waitCount(ctx, "distinct", 100), "%s: before the fault", l.store)
			}
			faults, recovery := sc.fault(t, ctx, c, loads)
			// Go on a while after the faults, publishing and consuming.
			for _, l := range loads {
				mark := l.count(ctx, "total")
				require.NoError(t, l.waitCount(ctx, "total", mark+50), "%s: after the faults", l.store)
			}
			for _, l := range loads {
				l.finish(t, ctx, sc.name, faults, sc.from, recovery)
			}
			t.Logf("scenario %s took %v", sc.name, time.Since(began).Round(time.Millisecond))
		})
	}
}

// marks returns the loads' effect totals now.
func marks(ctx context.Context, loads []*clusterLoad) []int64 {
	m := make([]int64, len(loads))
	for i, l := range loads {
		m[i] = l.count(ctx, "total")
	}
	return m
}

// recovered returns, for each load, how long after since its first
// effect after mark came.
func recovered(t *testing.T, ctx context.Context, loads []*clusterLoad, m []int64, since time.Time) []time.Duration {
	t.Helper()
	var ds []time.Duration
	for i, l := range loads {
		d, err := l.firstEffectAfter(ctx, m[i], since)
		require.NoError(t, err, "%s: no effect after the fault", l.store)
		ds = append(ds, d)
	}
	return ds
}

// recoveredOrRestarted waits up to 15 s for each load's first effect
// after the SIGKILL or stop of n, then restarts n. A load that had none
// by then (its consumers waited for n: see RELIABILITY.md, scenario 18)
// has its first effect after the restart, and its time counts from the
// fault all the same.
func recoveredOrRestarted(t *testing.T, ctx context.Context, loads []*clusterLoad, m []int64, killed time.Time, n *rabbitnode.Node) []time.Duration {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	ds := make([]time.Duration, len(loads))
	waiting := false
	for i, l := range loads {
		d, err := l.firstEffectAfter(wctx, m[i], killed)
		if err != nil {
			waiting = true
			continue
		}
		ds[i] = d
	}
	cancel()
	if !waiting {
		time.Sleep(2 * time.Second) // consuming without n
	}
	rabbitnode.RestartAll(n)
	t.Logf("%s restarted %v after the fault", n.Name, time.Since(killed).Round(time.Millisecond))
	for i, l := range loads {
		if ds[i] != 0 {
			continue
		}
		d, err := l.firstEffectAfter(ctx, m[i], killed)
		if err != nil {
			t.Fatalf("%s: no effect after the restart of %s: %v", l.store, n.Name, err)
		}
		t.Logf("%s: its consumers waited for %s to come back", l.store, n.Name)
		ds[i] = d
	}
	return ds
}

// a: SIGKILL the node that the Redis load's first consumer is connected
// to, mid-stream, then restart it.
func killConsumersNode(t *testing.T, ctx context.Context, c *cluster, loads []*clusterLoad) (string, []time.Duration) {
	n := c.nodeOf(t, loads[0].procs[0].name)
	m := marks(ctx, loads)
	killed := time.Now()
	n.Kill()
	t.Logf("SIGKILL %s (node of %s)", n.Name, loads[0].procs[0].name)
	ds := recoveredOrRestarted(t, ctx, loads, m, killed, n)
	return "SIGKILL of a consumer's node mid-stream, restart", ds
}

// b: SIGKILL the node that leads the quorum queue. It stays down until
// each load has had an effect and a confirm of a publish sent after the
// SIGKILL, which must come within leaderlessWindow; then it is restarted.
func killLeader(t *testing.T, ctx context.Context, c *cluster, loads []*clusterLoad) (string, []time.Duration) {
	n := c.leaderOf(t, loads[0].queue)
	for _, l := range loads[1:] {
		t.Logf("%s: its queue's leader is %s", l.store, c.leaderOf(t, l.queue).Name)
	}
	m := marks(ctx, loads)
	killed := time.Now()
	n.Kill()
	t.Logf("SIGKILL %s (leader of %s)", n.Name, loads[0].queue)
	wctx, cancel := context.WithTimeout(ctx, leaderlessWindow)
	defer cancel()
	ds := recovered(t, wctx, loads, m, killed)
	for _, l := range loads {
		for {
			d, ok := l.pub.confirmedSince(killed)
			if ok {
				l.republished = d
				break
			}
			if wctx.Err() != nil {
				t.Fatalf("%s: no publish sent after the SIGKILL of %s confirmed within %v of it", l.store, n.Name, leaderlessWindow)
			}
			time.Sleep(10 * time.Millisecond) // the publishers, on the cluster
		}
	}
	t.Logf("new leader %s", c.leaderOf(t, loads[0].queue).Name)
	rabbitnode.RestartAll(n)
	t.Logf("%s restarted %v after the fault", n.Name, time.Since(killed).Round(time.Millisecond))
	return "SIGKILL of the quorum queue's leader (restarted once both loads consumed and published again)", ds
}

// leaderlessWindow is how long after the SIGKILL of a quorum queue's
// leader scenario b waits, its node down, for each load to have an effect
// and a publish confirmed.
const leaderlessWindow = 15 * time.Second

// c: stop and start each node in turn.
func rollingRestart(t *testing.T, ctx context.Context, c *cluster, loads []*clusterLoad) (string, []time.Duration) {
	var ds []time.Duration
	for _, n := range c.nodes {
		m := marks(ctx, loads)
		stopped := time.Now()
		n.Stop()
		t.Logf("stopped %s in %v", n.Name, time.Since(stopped).Round(time.Millisecond))
		ds = append(ds, slices.Max(recoveredOrRestarted(t, ctx, loads, m, stopped, n)))
	}
	return "rolling restart of the 3 nodes", ds
}

// d: stop two nodes (the quorum queue loses its majority), then start them
// again; consumption must stop, and resume by itself.
func loseMajority(t *testing.T, ctx context.Context, c *cluster, loads []*clusterLoad) (string, []time.Duration) {
	down := c.nodes[1:]
	for _, n := range down {
		n.Stop()
	}
	t.Logf("stopped %s and %s", down[0].Name, down[1].Name)
	// Let what was in flight settle, then check that nothing is consumed.
	time.Sleep(3 * time.Second)
	m := marks(ctx, loads)
	time.Sleep(3 * time.Second)
	for i, l := range loads {
		if now := l.count(ctx, "total"); now != m[i] {
			t.Errorf("%s: %d effects applied while the queue had no majority; want none", l.store, now-m[i])
		}
	}
	started := time.Now()
	rabbitnode.RestartAll(down...)
	t.Logf("%s and %s back in %v", down[0].Name, down[1].Name, time.Since(started).Round(time.Millisecond))
	return "2 of 3 nodes stopped (majority lost), then started", recovered(t, ctx, loads, m, started)
}
