// Package rabbitnode starts RabbitMQ nodes of a test's own, apart from the
// machine's node: own node names (name@localhost), ports, data, log and
// configuration files, an Erlang cookie of its own, run in the foreground
// as children of the test in a process group of their own, and removed
// when the test ends (process group killed, directories deleted),
// whatever happens. Tests that need a node to kill, a TLS listener or a
// cluster use it; it skips them (fails them under CI) when RabbitMQ's
// server is not installed.
package rabbitnode

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// binDir holds rabbitmq-server and rabbitmqctl themselves: the scripts
// in /usr/sbin switch to the rabbitmq user, and lose the environment
// that names the node.
const binDir = "/usr/lib/rabbitmq/bin"

// startTimeout bounds a node's start on a slow, shared machine.
const startTimeout = 90 * time.Second

// A Config says what is particular to a node.
type Config struct {
	// Name is the node's short name: the node is Name-<pid>@localhost,
	// pid the test process's.
	Name string
	// Conf is appended to the node's rabbitmq.conf (which sets the
	// listener and the log). "{{port}}" in it is replaced by the node's
	// AMQP port.
	Conf string
	// Plugins are enabled on the node (its own enabled_plugins file).
	Plugins []string
	// TLS makes the AMQP listener a TLS one (listeners.ssl.default);
	// Conf then holds the ssl_options.
	TLS bool
	// Advanced, if set, is the node's advanced.config, for the settings
	// rabbitmq.conf does not take (such as the rabbit application's
	// channel_tick_interval).
	Advanced string
}

// A Node is a RabbitMQ node of the test's own. Its methods are for the
// goroutine of the test.
type Node struct {
	t        testing.TB
	cfg      Config
	Name     string // name@localhost
	Port     int    // AMQP (or AMQPS) port
	DistPort int    // Erlang distribution port
	dir      string
	home     string // HOME: holds the cookie
	logPath  string
	cmd      *exec.Cmd
	exited   chan struct{}
	starts   int
}

// Dir returns a directory of nodes for t, with an Erlang cookie they
// share, removed when t ends (after the nodes it started are stopped).
func Dir(t testing.TB) string {
	t.Helper()
	for _, bin := range []string{"rabbitmq-server", "rabbitmqctl"} {
		if _, err := os.Stat(filepath.Join(binDir, bin)); err != nil {
			testenv.Missing(t, "RabbitMQ's "+bin+" in "+binDir, "install the rabbitmq-server package")
		}
	}
	dir := t.TempDir()
	var c [20]byte
	_, _ = rand.Read(c[:])
	if err := os.WriteFile(filepath.Join(dir, ".erlang.cookie"), []byte(strings.ToUpper(hex.EncodeToString(c[:]))), 0o400); err != nil {
		t.Fatal(err)
	}
	return dir
}

// Start starts a node in dir (from Dir), on spare loopback ports, and
// waits until it runs. It is stopped when t ends.
func Start(t testing.TB, dir string, cfg Config) *Node {
	t.Helper()
	n := prepare(t, dir, cfg)
	n.Start()
	return n
}

// prepare writes a node's files, and arranges its removal.
func prepare(t testing.TB, dir string, cfg Config) *Node {
	t.Helper()
	// The process id in the name keeps two test processes that start a
	// node of the same Config (two runs of the suite at once) apart.
	n := &Node{t: t, cfg: cfg, Name: cfg.Name + "-" + strconv.Itoa(os.Getpid()) + "@localhost", dir: filepath.Join(dir, cfg.Name), home: dir}
	for _, d := range []string{"mnesia", "log"} {
		if err := os.MkdirAll(filepath.Join(n.dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ports := freePorts(t, 2)
	n.Port, n.DistPort = ports[0], ports[1]
	listener := "listeners.tcp.default = 127.0.0.1:" + strconv.Itoa(n.Port) + "\n"
	if cfg.TLS {
		listener = "listeners.tcp = none\nlisteners.ssl.default = 127.0.0.1:" + strconv.Itoa(n.Port) + "\n"
	}
	conf := listener +
		"loopback_users = none\n" +
		"log.file.level = info\n" +
		"log.console = false\n" +
		strings.ReplaceAll(cfg.Conf, "{{port}}", strconv.Itoa(n.Port))
	if err := os.WriteFile(filepath.Join(n.dir, "rabbitmq.conf"), []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	if cfg.Advanced != "" {
		if err := os.WriteFile(filepath.Join(n.dir, "advanced.config"), []byte(cfg.Advanced), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	plugins := "[" + strings.Join(cfg.Plugins, ",") + "].\n"
	if err := os.WriteFile(filepath.Join(n.dir, "enabled_plugins"), []byte(plugins), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.remove)
	return n
}

// StartAll starts a node for each of cfgs in dir (from Dir), at once, and
// waits until they all run.
func StartAll(t testing.TB, dir string, cfgs ...Config) []*Node {
	t.Helper()
	nodes := make([]*Node, len(cfgs))
	for i, cfg := range cfgs {
		nodes[i] = prepare(t, dir, cfg)
		nodes[i].launch()
	}
	for _, n := range nodes {
		n.awaitOrFail()
	}
	return nodes
}

// RestartAll starts nodes, killed or stopped, at once, and waits until
// they all run: a node that was not stopped last waits for its peers
// as it boots.
func RestartAll(nodes ...*Node) {
	for _, n := range nodes {
		n.launch()
	}
	for _, n := range nodes {
		n.awaitOrFail()
	}
}

// env is the environment of the node's server and of rabbitmqctl.
func (n *Node) env() []string {
	env := []string{
		"HOME=" + n.home,
		"PATH=" + os.Getenv("PATH"),
		"LANG=C.UTF-8",
		"RABBITMQ_NODENAME=" + n.Name,
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(n.DistPort),
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(n.dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE=" + filepath.Join(n.dir, "advanced.config"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(n.dir, "enabled_plugins"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(n.dir, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(n.dir, "log"),
		"RABBITMQ_PID_FILE=" + filepath.Join(n.dir, "pid"),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(n.dir, "rabbitmq-env.conf"), // none: not the machine's
		"RUNNING_UNDER_SYSTEMD=1",                                             // exec the VM in the foreground, without -detached
		"ERL_EPMD_ADDRESS=127.0.0.1",
	}
	return env
}

// Start starts the node again after Kill or Stop, on the same ports and
// data, and waits until it runs.
func (n *Node) Start() {
	n.t.Helper()
	n.launch()
	n.awaitOrFail()
}

// launch starts the node's VM, without waiting.
func (n *Node) launch() {
	n.t.Helper()
	n.starts++
	n.logPath = filepath.Join(n.dir, "log", fmt.Sprintf("server-%d.out", n.starts))
	out, err := os.Create(n.logPath)
	if err != nil {
		n.t.Fatal(err)
	}
	defer out.Close()
	cmd := exec.Command(filepath.Join(binDir, "rabbitmq-server"))
	cmd.Dir = n.dir
	cmd.Env = n.env()
	cmd.Stdout, cmd.Stderr = out, out
	// A process group of its own, for Kill; the kernel kills the VM if
	// the test binary dies without its cleanups.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		n.t.Fatalf("start %s: %v", n.Name, err)
	}
	n.cmd = cmd
	exited := make(chan struct{})
	n.exited = exited
	go func() {
		_ = cmd.Wait()
		close(exited)
	}()
}

// awaitOrFail waits until the node runs, and fails the test if it does
// not.
func (n *Node) awaitOrFail() {
	n.t.Helper()
	if err := n.await(); err != nil {
		n.Kill()
		n.t.Fatalf("node %s did not start: %v\n%s", n.Name, err, n.Log())
	}
}

// await waits until the node has booted.
func (n *Node) await() error {
	deadline := time.Now().Add(startTimeout)
	for {
		// An attempt may take until the deadline: rabbitmqctl starts an
		// Erlang VM of its own, which takes seconds (9 s for one that
		// failed at once, on a machine under a load of 9), so that
		// attempts cut at a bound of their own can all fail while the
		// node is up.
		_, err := n.ctl(time.Until(deadline), "await_startup", "--timeout", "10")
		if err == nil {
			return nil
		}
		select {
		case <-n.exited:
			return errors.New("the server exited")
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not up within %v: %v", startTimeout, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// Ctl runs rabbitmqctl on the node and returns its output; it fails the
// test on an error.
func (n *Node) Ctl(args ...string) string {
	n.t.Helper()
	out, err := n.ctl(time.Minute, args...)
	if err != nil {
		n.t.Fatalf("rabbitmqctl -n %s %s: %v\n%s", n.Name, strings.Join(args, " "), err, out)
	}
	return out
}

// TryCtl is Ctl, returning the error instead.
func (n *Node) TryCtl(args ...string) (string, error) { return n.ctl(time.Minute, args...) }

func (n *Node) ctl(timeout time.Duration, args ...string) (string, error) {
	return n.tool(timeout, "rabbitmqctl", args...)
}

// Queues runs rabbitmq-queues on the node.
func (n *Node) Queues(args ...string) (string, error) {
	return n.tool(time.Minute, "rabbitmq-queues", args...)
}

func (n *Node) tool(timeout time.Duration, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, name), append([]string{"-n", n.Name}, args...)...)
	cmd.Env = n.env()
	cmd.Dir = n.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// Kill kills the node's process group with SIGKILL, as a crash does, and
// waits until the VM has exited.
func (n *Node) Kill() {
	if n.cmd == nil {
		return
	}
	_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
	<-n.exited
	n.cmd = nil
}

// Stop stops the node gracefully (SIGTERM: the VM shuts RabbitMQ down),
// and kills it if it has not exited within a minute.
func (n *Node) Stop() {
	if n.cmd == nil {
		return
	}
	_ = n.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-n.exited:
		_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL) // what is left of the group
		n.cmd = nil
	case <-time.After(time.Minute):
		n.Kill()
	}
}

// Running reports whether the node's VM runs.
func (n *Node) Running() bool { return n.cmd != nil }

// URL returns the node's AMQP URL with the guest user ("amqps" for TLS).
func (n *Node) URL() string {
	scheme := "amqp"
	if n.cfg.TLS {
		scheme = "amqps"
	}
	return scheme + "://guest:guest@127.0.0.1:" + strconv.Itoa(n.Port) + "/"
}

// Addr returns the node's host:port/vhost, as the broker's logs name it.
func (n *Node) Addr() string { return "127.0.0.1:" + strconv.Itoa(n.Port) + "/" }

// Log returns the end of the node's output and log file, for a failure
// message.
func (n *Node) Log() string {
	var b strings.Builder
	for _, p := range []string{n.logPath, filepath.Join(n.dir, "log", n.Name+".log")} {
		data, _ := os.ReadFile(p)
		if len(data) > 4000 {
			data = data[len(data)-4000:]
		}
		fmt.Fprintf(&b, "--- %s\n%s\n", p, data)
	}
	return b.String()
}

// remove kills the node; t.TempDir removes its directories after.
func (n *Node) remove() {
	n.Kill()
	if n.t.Failed() {
		n.t.Logf("node %s:\n%s", n.Name, n.Log())
	}
}

// freePorts returns k loopback ports that were free a moment ago, below
// the ephemeral range (see testenv.FreePorts).
func freePorts(t testing.TB, k int) []int {
	ports, err := testenv.FreePorts(k)
	if err != nil {
		t.Fatal(err)
	}
	return ports
}
