//go:build reliability

package reliability_test

// The consumer under test as a real process: built once per test binary
// from ./internal/consumer, started, killed, stopped and waited for by the
// test that owns it.

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/reliability/internal/stats"
	"github.com/stretchr/testify/require"
)

// binDir holds the consumer binary; TestMain creates and removes it.
var binDir string

var build struct {
	once sync.Once
	path string
	err  error
}

// consumerBinary builds the consumer once per test binary, with the race
// detector when the tests have it, so that a data race in the library under
// fault injection fails the suite too.
func consumerBinary(t *testing.T) string {
	t.Helper()
	build.once.Do(func() {
		gotool := filepath.Join(runtime.GOROOT(), "bin", "go")
		if _, err := os.Stat(gotool); err != nil {
			gotool = "go"
		}
		build.path = filepath.Join(binDir, "consumer")
		args := []string{"build", "-o", build.path}
		if raceEnabled {
			args = append(args, "-race")
		}
		args = append(args, "github.com/rabbitmw/rabbitmw/reliability/internal/consumer")
		began := time.Now()
		out, err := exec.Command(gotool, args...).CombinedOutput()
		if err != nil {
			build.err = fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
			return
		}
		t.Logf("built the consumer (race detector: %t) in %v", raceEnabled, time.Since(began).Round(time.Millisecond))
	})
	require.NoError(t, build.err)
	return build.path
}

// consumerOpts are the consumer's flags; zero values leave its defaults.
type consumerOpts struct {
	amqpURL                string // instead of the run's
	storeAddr, storePrefix string
	storeContextTimeouts   bool
	workers, prefetch      int
	lease, busy            time.Duration
	unavailable            time.Duration
	groupCommit            int // the PostgreSQL inbox's HandlerOptions.GroupCommit
	timeout                time.Duration
	maxAttempts            int
	backoffMin, backoffMax time.Duration
	mode                   string
	work, hold             time.Duration
	countDeliveries        bool
	shutdownTimeout        time.Duration
	quorum                 bool
	quorumSupport          bool
	deliveryLimit          int
	reconnectMax           time.Duration
}

func (o consumerOpts) args() []string {
	var a []string
	str := func(name, v string) {
		if v != "" {
			a = append(a, "-"+name, v)
		}
	}
	num := func(name string, v int) {
		if v != 0 {
			a = append(a, "-"+name, strconv.Itoa(v))
		}
	}
	dur := func(name string, v time.Duration) {
		if v != 0 {
			a = append(a, "-"+name, v.String())
		}
	}
	str("amqp", o.amqpURL) // after the run's -amqp: the last one counts
	str("store", o.storeAddr)
	str("store-prefix", o.storePrefix)
	if o.storeContextTimeouts {
		a = append(a, "-store-context-timeouts")
	}
	num("workers", o.workers)
	num("prefetch", o.prefetch)
	dur("lease", o.lease)
	dur("busy", o.busy)
	dur("unavailable", o.unavailable)
	num("group-commit", o.groupCommit)
	dur("timeout", o.timeout)
	num("max-attempts", o.maxAttempts)
	dur("backoff-min", o.backoffMin)
	dur("backoff-max", o.backoffMax)
	str("mode", o.mode)
	dur("work", o.work)
	dur("hold", o.hold)
	if o.countDeliveries {
		a = append(a, "-count-deliveries")
	}
	dur("shutdown-timeout", o.shutdownTimeout)
	if o.quorum {
		a = append(a, "-quorum")
	}
	if o.quorumSupport {
		a = append(a, "-quorum-support")
	}
	num("delivery-limit", o.deliveryLimit)
	dur("reconnect-max", o.reconnectMax)
	return a
}

// A proc is one consumer process. It is killed and waited for when its
// test ends, if it has not ended before.
type proc struct {
	name    string
	stdout  bytes.Buffer // complete once exited is closed
	logPath string       // its standard error
	ours    atomic.Bool  // we signalled it: its end is expected
	*child
}

// startConsumer starts a consumer named name on the run's queue.
func (r *run) startConsumer(name string, o consumerOpts) *proc {
	r.t.Helper()
	if r.topo.Quorum && !o.quorum {
		o.quorum, o.deliveryLimit = true, r.topo.DeliveryLimit
	}
	o.quorumSupport = o.quorumSupport || r.topo.QuorumSupport
	args := append([]string{
		"-amqp", r.amqpURL,
		"-queue", r.queue,
		"-name", name,
		"-effects", r.redisAddr,
		"-effects-prefix", r.prefix,
		"-delays", r.delaysFlag(),
	}, o.args()...)
	if o.storeAddr == "" {
		args = append(args, "-store", r.redisAddr)
	}
	if o.storePrefix == "" {
		args = append(args, "-store-prefix", r.prefix+"store:")
	}
	p := &proc{name: name, logPath: filepath.Join(r.logDir, name+".log")}
	logFile, err := os.Create(p.logPath)
	require.NoError(r.t, err)
	defer logFile.Close() // the process has its own descriptor once started
	cmd := exec.Command(r.bin, args...)
	cmd.Stdout = &p.stdout
	cmd.Stderr = logFile
	if p.child, err = startChild(r.t, cmd, func(c *child) {
		p.ours.Store(true)
		c.kill()
	}); err != nil {
		r.t.Fatalf("starting consumer %s: %v", name, err)
	}
	r.mu.Lock()
	r.procs = append(r.procs, p)
	r.mu.Unlock()
	return p
}

// kill sends SIGKILL and waits for the process to end.
func (p *proc) kill() {
	p.ours.Store(true)
	p.child.kill()
}

// stop sends SIGTERM, waits up to timeout for a graceful exit, and returns
// the statistics the process printed. A process that does not exit in time
// is killed, and an error returned.
func (p *proc) stop(timeout time.Duration) (stats.Consumer, error) {
	p.ours.Store(true)
	p.cmd.Process.Signal(syscall.SIGTERM)
	if !p.wait(timeout) {
		// SIGQUIT makes the Go runtime write every goroutine's stack to the
		// log before it exits: what the stop was waiting for.
		p.cmd.Process.Signal(syscall.SIGQUIT)
		if !p.wait(5 * time.Second) {
			p.child.kill()
		}
		return stats.Consumer{}, fmt.Errorf("consumer %s did not exit within %v of SIGTERM; its log, ending with its goroutines:\n%s", p.name, timeout, p.tail(600))
	}
	var st stats.Consumer
	line := strings.TrimSpace(p.stdout.String())
	if err := json.Unmarshal([]byte(line), &st); err != nil {
		return st, fmt.Errorf("consumer %s: reading its statistics %q: %v (exit: %v)", p.name, line, err, p.waitErr)
	}
	if p.waitErr != nil {
		return st, fmt.Errorf("consumer %s exited with %v after SIGTERM: %s", p.name, p.waitErr, st.Error)
	}
	return st, nil
}

// unexpectedExit returns an error if the process ended without being
// signalled by the test: it crashed or gave up.
func (p *proc) unexpectedExit() error {
	select {
	case <-p.exited:
		if !p.ours.Load() {
			return fmt.Errorf("consumer %s exited by itself (%v)", p.name, p.waitErr)
		}
	default:
	}
	return nil
}

// logProblems returns the lines of the process's log that mean a defect
// whatever the scenario: a data race, or a panic that was not recovered.
func (p *proc) logProblems() []string {
	f, err := os.Open(p.logPath)
	if err != nil {
		return []string{err.Error()}
	}
	defer f.Close()
	var found []string
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	for s.Scan() {
		line := s.Text()
		if strings.Contains(line, "DATA RACE") || strings.HasPrefix(line, "panic: ") || strings.HasPrefix(line, "fatal error: ") {
			found = append(found, line)
		}
	}
	return found
}

// tail returns the last n lines of the process's log.
func (p *proc) tail(n int) string {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = append([]string{fmt.Sprintf("… %d lines before", len(lines)-n)}, lines[len(lines)-n:]...)
	}
	return strings.Join(lines, "\n")
}

// logCount returns the number of lines of the process's log that contain s.
func (p *proc) logCount(s string) int {
	b, err := os.ReadFile(p.logPath)
	if err != nil {
		return 0
	}
	return strings.Count(string(b), s)
}
