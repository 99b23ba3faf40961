//go:build reliability

package reliability_test

// A real Redis Cluster for tests: three primaries on free loopback ports,
// owned by the test that starts them.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// Bounds on the waits while a cluster starts. They are generous because CI
// machines are loaded; a healthy start takes two to three seconds, most of
// them in redis-cli waiting for the nodes to agree.
const (
	nodeStartTimeout     = 10 * time.Second // a redis-server answers on its port
	clusterCreateTimeout = 30 * time.Second // redis-cli --cluster create returns
	clusterReadyTimeout  = 20 * time.Second // every node reports cluster_state:ok
	portAttempts         = 5                // tries per node when a port is taken
)

// A redisCluster is a Redis Cluster of three primaries, no replicas, on
// 127.0.0.1. Its servers are killed and waited for when the test that
// started it ends, and its clients are closed before that.
type redisCluster struct {
	nodes []*redisNode
}

// A redisNode is one redis-server process of a cluster.
type redisNode struct {
	addr string // 127.0.0.1:port, for clients
	log  string // path of the server's log (its stdout and stderr)
	*child
}

// startRedisCluster starts a three-node Redis Cluster for t and returns
// once every node reports cluster_state:ok and knows all 16384 slots. It
// skips t (fails it under CI=true) if redis-server or redis-cli is not
// installed.
func startRedisCluster(t *testing.T) *redisCluster {
	t.Helper()
	server := lookPath(t, "redis-server")
	cli := lookPath(t, "redis-cli")
	// Created before any server, so removed after they were all stopped
	// (cleanups run last-registered first).
	dir := t.TempDir()
	began := time.Now()

	c := new(redisCluster)
	for range 3 {
		c.nodes = append(c.nodes, startNode(t, server, dir))
	}

	ctx, cancel := context.WithTimeout(context.Background(), clusterCreateTimeout)
	defer cancel()
	args := []string{"--cluster", "create"}
	args = append(args, c.addrs()...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	create := exec.CommandContext(ctx, cli, args...)
	create.WaitDelay = time.Second
	if out, err := create.CombinedOutput(); err != nil {
		t.Fatalf("redis-cli %s: %v\n%s%s", strings.Join(args, " "), err, out, c.logs())
	}
	c.waitReady(t)
	t.Logf("Redis Cluster of %s ready in %v", strings.Join(c.addrs(), ", "), time.Since(began).Round(time.Millisecond))
	return c
}

// lookPath returns the path of an installed program, or skips t (fails it
// under CI) if there is none.
func lookPath(t *testing.T, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		testenv.Missing(t, name, "install Redis 7 or later, e.g. apt-get install redis-server ("+err.Error()+")")
	}
	return p
}

// errPortTaken reports that a server could not bind a port it was given:
// another process took it between our choosing it and the server's bind.
var errPortTaken = errors.New("port taken")

// startNode starts one cluster-enabled redis-server in dir on free ports,
// choosing new ports if the chosen ones were taken meanwhile.
func startNode(t *testing.T, server, dir string) *redisNode {
	t.Helper()
	for attempt := 1; ; attempt++ {
		n, err := tryStartNode(t, server, dir)
		if err == nil {
			return n
		}
		if !errors.Is(err, errPortTaken) || attempt == portAttempts {
			t.Fatalf("starting redis-server (attempt %d of %d): %v", attempt, portAttempts, err)
		}
		t.Logf("starting redis-server again on other ports: %v", err)
	}
}

func tryStartNode(t *testing.T, server, dir string) (*redisNode, error) {
	ports, err := freePorts(2)
	if err != nil {
		return nil, err
	}
	port, bus := strconv.Itoa(ports[0]), strconv.Itoa(ports[1])
	n := &redisNode{
		addr: net.JoinHostPort("127.0.0.1", port),
		log:  filepath.Join(dir, "redis-"+port+".log"),
	}
	logFile, err := os.Create(n.log)
	if err != nil {
		return nil, err
	}
	defer logFile.Close() // the server has its own descriptor once started
	// The cluster bus gets a port of its own (--cluster-port, Redis 7.0)
	// rather than the default port+10000, which may be taken or, for a
	// port above 55535, may not exist.
	cmd := exec.Command(server,
		"--port", port,
		"--cluster-enabled", "yes",
		"--cluster-port", bus,
		"--cluster-config-file", filepath.Join(dir, "nodes-"+port+".conf"),
		"--dir", dir,
		"--save", "",
		"--appendonly", "no",
		"--bind", "127.0.0.1",
		"--daemonize", "no",
	)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if n.child, err = startChild(t, cmd, nil); err != nil {
		return nil, fmt.Errorf("%s: %w", server, err)
	}

	deadline := time.Now().Add(nodeStartTimeout)
	for {
		select {
		case <-n.exited:
			log := readLog(n.log)
			for _, line := range strings.Split(log, "\n") {
				if strings.Contains(line, "Address already in use") {
					return nil, fmt.Errorf("%w: redis-server on %s (bus port %s): %s", errPortTaken, n.addr, bus, line)
				}
			}
			return nil, fmt.Errorf("redis-server on %s exited at start (%v):\n%s", n.addr, n.waitErr, log)
		default:
		}
		if servedBy(n.addr, n.cmd.Process.Pid) {
			return n, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("redis-server on %s (pid %d) did not answer within %v:\n%s", n.addr, n.cmd.Process.Pid, nodeStartTimeout, readLog(n.log))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// freePorts returns n distinct loopback ports that were free a moment
// ago, below the ephemeral range (see testenv.FreePorts).
func freePorts(n int) ([]int, error) { return testenv.FreePorts(n) }

// servedBy reports whether the Redis answering at addr is the process pid:
// when the port was taken meanwhile, another server may answer there until
// ours exits with "Address already in use".
func servedBy(addr string, pid int) bool {
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := c.Info(ctx, "server").Result()
	return err == nil && lacking(info, []string{"process_id:" + strconv.Itoa(pid)}) == ""
}

func readLog(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "(no log: " + err.Error() + ")"
	}
	return string(b)
}

// logs returns every node's log, for a failure message.
func (c *redisCluster) logs() string {
	var b strings.Builder
	for _, n := range c.nodes {
		fmt.Fprintf(&b, "\n--- log of %s ---\n%s", n.addr, readLog(n.log))
	}
	return b.String()
}

// addrs returns the nodes' addresses.
func (c *redisCluster) addrs() []string {
	var a []string
	for _, n := range c.nodes {
		a = append(a, n.addr)
	}
	return a
}

// waitReady waits until every node says, in CLUSTER INFO, that the cluster
// is ok, that it knows the three nodes and that all 16384 slots are served:
// right after --cluster create a node may still say cluster_state:fail.
func (c *redisCluster) waitReady(t *testing.T) {
	t.Helper()
	want := []string{"cluster_state:ok", "cluster_slots_ok:16384", "cluster_known_nodes:3"}
	deadline := time.Now().Add(clusterReadyTimeout)
	for _, n := range c.nodes {
		nc := c.node(t, n.addr)
		for {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			info, err := nc.ClusterInfo(ctx).Result()
			cancel()
			missing := ""
			if err == nil {
				missing = lacking(info, want)
			}
			if err == nil && missing == "" {
				break
			}
			if time.Now().After(deadline) {
				if err != nil {
					info = err.Error()
				}
				t.Fatalf("Redis Cluster not ready after %v: node %s lacks %q; its CLUSTER INFO:\n%s%s", clusterReadyTimeout, n.addr, missing, info, c.logs())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// lacking returns the first of want that is not a line of info, or "".
func lacking(info string, want []string) string {
	lines := map[string]bool{}
	for _, l := range strings.Split(info, "\n") {
		lines[strings.TrimSpace(l)] = true
	}
	for _, w := range want {
		if !lines[w] {
			return w
		}
	}
	return ""
}

// client returns a cluster client of c, audited by a (nil for none), that
// is closed when t ends.
func (c *redisCluster) client(t *testing.T, a *slotAudit) *redis.ClusterClient {
	t.Helper()
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: c.addrs()})
	if a != nil {
		cc.AddHook(a)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// node returns a client of the single node at addr, closed when t ends,
// for commands that ask one node about itself (DBSIZE, CLUSTER INFO).
func (c *redisCluster) node(t *testing.T, addr string) *redis.Client {
	t.Helper()
	nc := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { nc.Close() })
	return nc
}

// keysPerNode returns each node's DBSIZE, by address.
func (c *redisCluster) keysPerNode(t *testing.T) map[string]int64 {
	t.Helper()
	got := map[string]int64{}
	for _, n := range c.nodes {
		size, err := c.node(t, n.addr).DBSize(context.Background()).Result()
		require.NoError(t, err, "DBSIZE on %s", n.addr)
		got[n.addr] = size
	}
	return got
}

// perNode formats counts by node address in the nodes' order, for a log.
func (c *redisCluster) perNode(counts map[string]int64) string {
	var parts []string
	for _, n := range c.nodes {
		parts = append(parts, fmt.Sprintf("%s=%d", n.addr, counts[n.addr]))
	}
	return strings.Join(parts, " ")
}

// slotAudit is a redis.Hook that checks, for every command a cluster
// client sends, what the cluster contract asks of a store: each script
// declares exactly one key (so it cannot span hash slots), and no reply is
// a cross-slot refusal.
type slotAudit struct {
	mu         sync.Mutex
	scripts    int      // EVAL and EVALSHA commands sent
	commands   int      // all commands sent
	violations []string // scripts with other than one key, cross-slot errors
}

// DialHook implements redis.Hook.
func (a *slotAudit) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (a *slotAudit) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a.check(cmd)
		err := next(ctx, cmd)
		a.checkErr(cmd, err)
		return err
	}
}

// ProcessPipelineHook implements redis.Hook.
func (a *slotAudit) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			a.check(cmd)
		}
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			a.checkErr(cmd, cmd.Err())
		}
		return err
	}
}

func (a *slotAudit) check(cmd redis.Cmder) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.commands++
	switch strings.ToLower(cmd.Name()) {
	case "eval", "evalsha", "eval_ro", "evalsha_ro":
		a.scripts++
		if args := cmd.Args(); len(args) < 3 || fmt.Sprint(args[2]) != "1" {
			a.violations = append(a.violations, "a script with other than one key: "+brief(args))
		}
	}
}

func (a *slotAudit) checkErr(cmd redis.Cmder, err error) {
	if err == nil {
		return
	}
	msg := err.Error()
	if strings.Contains(msg, "CROSSSLOT") || strings.Contains(msg, "same slot") || strings.Contains(msg, "non local key") {
		a.mu.Lock()
		defer a.mu.Unlock()
		a.violations = append(a.violations, brief(cmd.Args())+": "+msg)
	}
}

// brief returns a command's arguments, cut short for a failure message.
func brief(args []any) string {
	s := fmt.Sprint(args)
	if len(s) > 160 {
		s = s[:160] + "…]"
	}
	return fmt.Sprintf("%q", s)
}

// report returns the counts and violations seen so far.
func (a *slotAudit) report() (commands, scripts int, violations []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.commands, a.scripts, append([]string(nil), a.violations...)
}

// verify fails t if any violation was seen, or if no script was: an audit
// that saw nothing proves nothing.
func (a *slotAudit) verify(t *testing.T) {
	t.Helper()
	commands, scripts, violations := a.report()
	if scripts == 0 {
		t.Errorf("slot audit saw %d commands and no script; want the store's scripts to pass through it", commands)
	}
	const shown = 5
	for _, v := range violations[:min(len(violations), shown)] {
		t.Errorf("slot audit: %s", v)
	}
	if len(violations) > shown {
		t.Errorf("slot audit: %d more violations", len(violations)-shown)
	}
}
