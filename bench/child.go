package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime/pprof"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// Each run of a contender consumes in a process of its own, the child: this
// program started again with -child and a childSpec. The parent fills the
// queue, starts the child and reads the servers' CPU; the child opens its
// store clients, says "ready", waits for "go" on its stdin, consumes, and
// reports on its stdout. So no contender shares a process, a heap or a
// garbage collector with bench's own work or with another contender.
//
// The protocol, one line each: the child writes "ready <childReady>"; the
// parent writes "go"; the child writes "done <childDone>" when the last
// delivery is acked (the parent then reads the servers' CPU), then
// "result <childResult>" once its consumer has stopped.

// childSpec is what a child runs.
type childSpec struct {
	Contender string                `json:"contender"`
	Prefetch  int                   `json:"prefetch"`
	Workers   int                   `json:"workers"`
	Opts      broker.ConsumeOptions `json:"-"`
	OptsP     int                   `json:"opts_prefetch"` // Opts.Prefetch
	OptsW     int                   `json:"opts_workers"`  // Opts.Workers
	Queue     string                `json:"queue"`
	Prefix    string                `json:"prefix"`
	N         int                   `json:"n"` // deliveries to ack
	AMQP      string                `json:"amqp"`
	Redis     string                `json:"redis"`
	Postgres  string                `json:"postgres"`
	Latency   bool                  `json:"latency"`
	Timeout   time.Duration         `json:"timeout"`
}

// childReady tells the parent which PostgreSQL processes serve the child.
type childReady struct {
	PgPIDs []int `json:"pg_pids,omitempty"`
}

// childDone is the timing of the run: its first effect and its last ack,
// in Unix nanoseconds (comparable between processes), and the child's own
// CPU time over the run (from "go" to the last ack: connecting and
// subscribing included, stopping not).
type childDone struct {
	First int64         `json:"first_unix_ns"`
	Last  int64         `json:"last_unix_ns"`
	CPU   time.Duration `json:"cpu_ns"`
}

// childResult is what the child saw, once its consumer stopped.
type childResult struct {
	Effects         int64   `json:"effects"`
	UniqueEffects   int64   `json:"unique_effects"`
	RepeatedEffects int64   `json:"repeated_effects"`
	AckAt           []int64 `json:"ack_at,omitempty"` // -latency: Unix ns per message index
	Err             string  `json:"error,omitempty"`
}

// clients are the connections of one child to the stores it uses.
type clients struct {
	prefix string        // of its Redis keys
	redis  *redis.Client // nil unless the contender uses Redis
	pg     *pgRun        // nil unless the contender uses PostgreSQL
}

// runChild is the child's side: spec is its argument.
func runChild(ctx context.Context, spec string, in io.Reader, out io.Writer) error {
	var s childSpec
	if err := json.Unmarshal([]byte(spec), &s); err != nil {
		return fmt.Errorf("-child: %w", err)
	}
	s.Opts = broker.ConsumeOptions{Prefetch: s.OptsP, Workers: s.OptsW}
	c := newContender(s.Contender, s.Prefetch, s.Workers, s.Opts)
	cl, err := openClients(ctx, c, s)
	if err != nil {
		return err
	}
	defer cl.close()
	var ready childReady
	if cl.pg != nil {
		ready.PgPIDs = cl.pg.pids
	}
	if err := writeLine(out, "ready", ready); err != nil {
		return err
	}
	line, err := bufio.NewReader(in).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "go" {
		return fmt.Errorf("-child: waited for go, read %q (%v)", line, err)
	}

	if path := os.Getenv("BENCH_CHILD_CPUPROFILE"); path != "" {
		// A profile of each child's run, named after its contender.
		f, err := os.Create(path + "." + s.Contender + ".pprof")
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	cnt := newCounter(s.N)
	if s.Latency {
		cnt.ackAt = make([]atomic.Int64, s.N)
	}
	cpu0 := selfCPU()
	rctx, cancel := context.WithTimeout(ctx, s.Timeout)
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- c.consume(rctx, s.AMQP, s.Queue, cl, cnt) }()
	var cerr error
	select {
	case <-cnt.done:
		done := childDone{First: epoch.UnixNano() + cnt.first.Load(), Last: epoch.UnixNano() + cnt.last.Load(), CPU: selfCPU() - cpu0}
		if err := writeLine(out, "done", done); err != nil {
			return err
		}
		cerr = <-errc
	case cerr = <-errc:
		if cerr == nil {
			cerr = errors.New("the consumer returned before every delivery was acked")
		}
		if errors.Is(cerr, context.DeadlineExceeded) {
			cerr = fmt.Errorf("%w: %d of %d deliveries acked within -timeout %v", cerr, cnt.acked.Load(), s.N, s.Timeout)
		}
	}
	var res childResult
	res.Effects, res.UniqueEffects, res.RepeatedEffects = cnt.effectCounts()
	if cnt.ackAt != nil {
		res.AckAt = make([]int64, len(cnt.ackAt))
		for i := range cnt.ackAt {
			res.AckAt[i] = cnt.ackAt[i].Load()
		}
	}
	if cerr != nil {
		res.Err = cerr.Error()
	}
	return writeLine(out, "result", res)
}

func writeLine(w io.Writer, word string, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(w, "%s %s\n", word, b)
	return err
}

// selfCPU is this process's CPU time so far, user and system.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// openClients opens the store clients that c uses, warmed up, the Redis
// keys and PostgreSQL tables named after s.Prefix.
func openClients(ctx context.Context, c contender, s childSpec) (*clients, error) {
	cl := &clients{prefix: s.Prefix}
	if c.redis {
		var err error
		if cl.redis, err = newRedisClient(ctx, s.Redis, c.workers); err != nil {
			return nil, err
		}
		// A consumer that has been running has the store's scripts in
		// Redis's cache; a fresh Redis would charge the first deliveries
		// an extra round trip each (NOSCRIPT, then EVAL).
		if err := redisstore.New(cl.redis, redisstore.Options{}).Load(ctx); err != nil {
			cl.close()
			return nil, err
		}
	}
	if c.pg {
		var err error
		if cl.pg, err = newPgRun(ctx, s.Postgres, s.Prefix, c.workers); err != nil {
			cl.close()
			return nil, err
		}
	}
	return cl, nil
}

func (cl *clients) close() {
	if cl.redis != nil {
		cl.redis.Close()
	}
	if cl.pg != nil {
		cl.pg.close()
	}
}

// newRedisClient returns a client with go-redis's default options and up
// to conns connections open in its pool (a consumer that has been running
// for a while has a warm pool; dialling is not what is measured).
func newRedisClient(ctx context.Context, addr string, conns int) (*redis.Client, error) {
	c := redis.NewClient(&redis.Options{Addr: addr})
	conns = min(conns, c.Options().PoolSize)
	errs := make(chan error, conns)
	for range conns {
		go func() { errs <- c.Ping(ctx).Err() }()
	}
	var err error
	for range conns {
		err = errors.Join(err, <-errs)
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("Redis: %w", err)
	}
	return c, nil
}

// A child is the parent's handle on a running child process.
type child struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
}

// startChild starts a child running s and waits for its "ready".
func startChild(ctx context.Context, s childSpec) (*child, childReady, error) {
	var ready childReady
	exe, err := os.Executable()
	if err != nil {
		return nil, ready, err
	}
	s.OptsP, s.OptsW = s.Opts.Prefetch, s.Opts.Workers
	spec, err := json.Marshal(s)
	if err != nil {
		return nil, ready, err
	}
	cmd := exec.CommandContext(ctx, exe, "-child", string(spec))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, ready, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, ready, err
	}
	if err := cmd.Start(); err != nil {
		return nil, ready, err
	}
	ch := &child{cmd: cmd, stdin: stdin, out: bufio.NewReaderSize(stdout, 1<<20)}
	if err := ch.read("ready", &ready); err != nil {
		ch.stop()
		return nil, ready, err
	}
	return ch, ready, nil
}

// read reads the child's next line, which must start with word, into v.
func (ch *child) read(word string, v any) error {
	line, err := ch.out.ReadString('\n')
	if err != nil {
		return fmt.Errorf("the child ended before %q: %w", word, err)
	}
	rest, ok := strings.CutPrefix(line, word+" ")
	if !ok {
		if r, ok := strings.CutPrefix(line, "result "); ok {
			var res childResult
			if json.Unmarshal([]byte(r), &res) == nil && res.Err != "" {
				return errors.New(res.Err)
			}
		}
		return fmt.Errorf("the child wrote %q; want %q", strings.TrimSpace(line), word)
	}
	return json.Unmarshal([]byte(rest), v)
}

// start tells the child to go.
func (ch *child) start() error {
	_, err := io.WriteString(ch.stdin, "go\n")
	return err
}

// wait waits for the child to exit.
func (ch *child) wait() error {
	ch.stdin.Close()
	return ch.cmd.Wait()
}

// stop ends the child, if it runs still, and waits for it.
func (ch *child) stop() {
	ch.stdin.Close()
	ch.cmd.Process.Kill()
	ch.cmd.Wait()
}
