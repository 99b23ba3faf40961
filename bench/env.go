package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
)

// env holds the servers and what bench needs to prepare and clean up after
// each run: a connection for publishing, a Broker for declaring and deleting
// queues, and a Redis client for INFO and for deleting keys.
type env struct {
	cfg     config
	runID   string // prefix of every queue and Redis key of this run
	conn    *amqp.Connection
	admin   *broker.Broker
	rdb     *redis.Client
	machine machine
	// rabbitPID is the local RabbitMQ server's process, for its CPU time;
	// 0 when it is not known.
	rabbitPID int
	// rabbitIdle is the CPU time RabbitMQ spends per second of wall time
	// when this program sends it nothing (measured at start-up): its
	// timers, its management plugin, other users' idle connections. It is
	// subtracted from RabbitMQ's CPU over each consuming window.
	rabbitIdle float64
}

// topology is the topology of every queue bench declares: the broker's
// defaults, so that the plain and hand-written contenders consume from the
// same kind of queue as rabbitmw (a classic durable queue with a
// dead-letter exchange).
var topology = broker.Topology{}

func connect(ctx context.Context, cfg config) (*env, error) {
	e := &env{cfg: cfg, runID: newRunID()}
	if _, err := e.channel(); err != nil {
		return nil, err
	}
	e.admin = broker.New(cfg.amqpURL, broker.Options{})
	e.rdb = redis.NewClient(&redis.Options{Addr: cfg.redisAddr, DialTimeout: 5 * time.Second})
	if err := e.rdb.Ping(ctx).Err(); err != nil {
		e.close()
		return nil, fmt.Errorf("Redis at %s: %w (start it, or set -redis / REDIS_ADDR)", cfg.redisAddr, err)
	}
	if u, err := amqp.ParseURI(cfg.amqpURL); err == nil {
		if ip := net.ParseIP(u.Host); u.Host == "localhost" || (ip != nil && ip.IsLoopback()) {
			e.rabbitPID = listenerPID(u.Port)
			e.rabbitIdle = idleCPU(ctx, e.rabbitPID, idleSample)
		}
	}
	e.machine = describeMachine(ctx, e)
	return e, nil
}

func (e *env) close() {
	if e.admin != nil {
		e.admin.Close()
	}
	if e.conn != nil {
		e.conn.Close()
	}
	if e.rdb != nil {
		e.rdb.Close()
	}
}

// channel opens a channel on the publishing connection, connecting again
// if the connection was closed (by the server, or by someone's
// rabbitmqctl close_all_connections).
func (e *env) channel() (*amqp.Channel, error) {
	if e.conn == nil || e.conn.IsClosed() {
		conn, err := amqp.DialConfig(e.cfg.amqpURL, amqp.Config{
			Dial: func(network, addr string) (net.Conn, error) { return net.DialTimeout(network, addr, 5*time.Second) },
		})
		if err != nil {
			return nil, fmt.Errorf("RabbitMQ at %s: %w (start it, or set -amqp / RABBITMQ_URL)", redact(e.cfg.amqpURL), err)
		}
		e.conn = conn
	}
	ch, err := e.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("open a channel: %w", err)
	}
	return ch, nil
}

// newRunID returns a name prefix unique to this run, free of the characters
// that Redis's MATCH patterns treat specially.
func newRunID() string {
	var b [3]byte
	_, _ = rand.Read(b[:])
	return "rmwbench-" + strconv.FormatInt(time.Now().Unix(), 36) + "-" + hex.EncodeToString(b[:])
}

// redact hides the password of an AMQP URL.
func redact(url string) string {
	u, err := amqp.ParseURI(url)
	if err != nil {
		return "(malformed URL)"
	}
	return u.Scheme + "://" + u.Username + "@" + net.JoinHostPort(u.Host, strconv.Itoa(u.Port)) + "/" + strings.TrimPrefix(u.Vhost, "/")
}

// A batch is one queue filled with messages for one contender's run.
type batch struct {
	queue  string
	prefix string   // Redis key prefix for this run
	ids    []string // message ids in publishing order
	unique int      // distinct ids
}

// messageIDs returns n message ids "m<i>", of which a fraction dup repeat
// the id of an earlier message. A repeated id is at least gap messages
// after the message that first had it, so that the copy arrives after the
// original was settled (a copy that arrived while its original was still
// in flight would be a busy message, delayed for seconds, not a
// duplicate); gap is shrunk to fit a short run.
func messageIDs(n int, dup float64, gap int) (ids []string, unique int) {
	ids = make([]string, n)
	for i := range ids {
		ids[i] = "m" + strconv.Itoa(i)
	}
	d := int(dup*float64(n) + 0.5)
	gap = min(gap, n/2)
	if d == 0 || gap < 1 {
		return ids, n
	}
	// Spread the d copies evenly over [gap, n): deterministic, so every
	// round and every run sees the same pattern.
	span := n - gap
	d = min(d, span)
	for k := range d {
		j := gap + k*span/d
		ids[j] = ids[j-gap]
	}
	return ids, n - d
}

// fill declares queue (with its dead-letter and delay queues) and publishes
// one message per id to it, with confirms, up to 1024 unconfirmed at a time.
func (e *env) fill(ctx context.Context, b batch) error {
	if err := e.admin.Declare(ctx, b.queue, topology); err != nil {
		return err
	}
	ch, err := e.channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return fmt.Errorf("confirm mode: %w", err)
	}
	body := make([]byte, e.cfg.size)
	for i := range body {
		body[i] = 'a' + byte(i%26)
	}
	mode := amqp.Transient
	if e.cfg.persistent {
		mode = amqp.Persistent
	}
	pending := make([]*amqp.DeferredConfirmation, 0, 1024)
	wait := func() error {
		for _, dc := range pending {
			ok, err := dc.WaitContext(ctx)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("publish to %s: nacked by the server", b.queue)
			}
		}
		pending = pending[:0]
		return nil
	}
	for _, id := range b.ids {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", b.queue, false, false, amqp.Publishing{
			MessageId:    id,
			DeliveryMode: mode,
			ContentType:  "application/octet-stream",
			Body:         body,
		})
		if err != nil {
			return fmt.Errorf("publish to %s: %w", b.queue, err)
		}
		if pending = append(pending, dc); len(pending) == cap(pending) {
			if err := wait(); err != nil {
				return err
			}
		}
	}
	if err := wait(); err != nil {
		return err
	}
	// Confirmed messages are in the queue, but make sure: a count that is
	// off would make every figure wrong.
	n, err := e.admin.Len(ctx, b.queue)
	if err != nil {
		return err
	}
	if n != len(b.ids) {
		return fmt.Errorf("queue %s holds %d messages after publishing %d", b.queue, n, len(b.ids))
	}
	return nil
}

// leftovers returns the messages left in the work queue and its dead-letter
// queue after a run: both should be 0.
func (e *env) leftovers(ctx context.Context, queue string) (ready, dead int, err error) {
	if ready, err = e.admin.Len(ctx, queue); err != nil {
		return 0, 0, err
	}
	dead, err = e.admin.Len(ctx, queue+".dlq")
	return ready, dead, err
}

// drop deletes the queues and the Redis keys of b. It uses a context of its
// own, so that it runs even after an interrupt.
func (e *env) drop(b batch) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := e.admin.Delete(ctx, b.queue, topology)
	return errors.Join(err, e.deleteKeys(ctx, b.prefix))
}

// deleteKeys deletes the Redis keys that start with prefix.
func (e *env) deleteKeys(ctx context.Context, prefix string) error {
	var cursor uint64
	for {
		keys, next, err := e.rdb.Scan(ctx, cursor, prefix+"*", 1000).Result()
		if err != nil {
			return fmt.Errorf("scan Redis keys %s*: %w", prefix, err)
		}
		if len(keys) > 0 {
			if err := e.rdb.Unlink(ctx, keys...).Err(); err != nil {
				return fmt.Errorf("delete Redis keys %s*: %w", prefix, err)
			}
		}
		if cursor = next; cursor == 0 {
			return nil
		}
	}
}

// commandStats returns the calls of each command from Redis's INFO
// commandstats (server wide: every client's commands, and the commands that
// Lua scripts run, count). INFO itself is left out.
func (e *env) commandStats(ctx context.Context) (map[string]int64, error) {
	s, err := e.rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return nil, fmt.Errorf("Redis INFO commandstats: %w", err)
	}
	calls := make(map[string]int64)
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		// cmdstat_get:calls=21,usec=175,usec_per_call=8.33,...
		name, rest, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":")
		name, isCmd := strings.CutPrefix(name, "cmdstat_")
		if !ok || !isCmd || name == "info" {
			continue
		}
		for field := range strings.SplitSeq(rest, ",") {
			if v, ok := strings.CutPrefix(field, "calls="); ok {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return nil, fmt.Errorf("Redis INFO commandstats: bad line %q", sc.Text())
				}
				calls[name] = n
			}
		}
	}
	return calls, nil
}

// statsDelta returns after - before, command by command, and the total.
func statsDelta(before, after map[string]int64) (map[string]int64, int64) {
	d := make(map[string]int64)
	var total int64
	for name, n := range after {
		if x := n - before[name]; x > 0 {
			d[name] = x
			total += x
		}
	}
	return d, total
}

// brokerSettings returns the prefetch and workers that broker.Consume uses
// for the given options (0 for its defaults). It asks the broker itself,
// by starting a consumer on the in-memory broker and reading the settings
// from its "consuming" log record, so that the plain and hand-written
// contenders run with exactly what rabbitmw runs with, whatever the
// defaults are.
func brokerSettings(ctx context.Context, prefetch, workers int) (int, int, error) {
	m := brokertest.NewServer()
	defer m.Close()
	h := &settingsHandler{found: make(chan [2]int, 1)}
	b := broker.New(m.URL(), broker.Options{Logger: slog.New(h)})
	defer b.Close()
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 1)
	nop := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	go func() {
		errc <- b.Consume(cctx, "bench-settings-probe", nop, broker.ConsumeOptions{Prefetch: prefetch, Workers: workers})
	}()
	fail := errors.New(`cannot read the consumer settings from the broker's "consuming" log record; pass -prefetch and -workers`)
	select {
	case s := <-h.found:
		cancel()
		<-errc
		return s[0], s[1], nil
	case err := <-errc:
		return 0, 0, errors.Join(fail, err)
	case <-time.After(10 * time.Second):
		return 0, 0, fail
	}
}

// settingsHandler is a slog.Handler that picks the prefetch and workers out
// of the consumer's "broker: consuming" record.
type settingsHandler struct{ found chan [2]int }

func (h *settingsHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *settingsHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *settingsHandler) WithGroup(string) slog.Handler            { return h }

func (h *settingsHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message != "broker: consuming" {
		return nil
	}
	var s [2]int
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "prefetch":
			s[0] = int(a.Value.Int64())
		case "workers":
			s[1] = int(a.Value.Int64())
		}
		return true
	})
	if s[0] > 0 && s[1] > 0 {
		select {
		case h.found <- s:
		default:
		}
	}
	return nil
}

// machine describes where bench ran.
type machine struct {
	Date       string `json:"date"` // of the start, UTC
	CPUs       int    `json:"cpus"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	CPUModel   string `json:"cpu_model"`
	MemTotal   string `json:"mem_total"`
	Go         string `json:"go"`
	RabbitMQ   string `json:"rabbitmq"`
	// RabbitPID is the process whose CPU is RabbitMQ's: the one that
	// listens on the AMQP port; 0 when unknown.
	RabbitPID int    `json:"rabbitmq_pid"`
	Redis     string `json:"redis"`
	LoadStart string `json:"load_average_start"`
	LoadEnd   string `json:"load_average_end"`
}

func describeMachine(ctx context.Context, e *env) machine {
	m := machine{
		Date:       time.Now().UTC().Format(time.RFC3339),
		CPUs:       runtime.NumCPU(),
		GOMAXPROCS: runtime.GOMAXPROCS(0),
		CPUModel:   procField("/proc/cpuinfo", "model name"),
		MemTotal:   procField("/proc/meminfo", "MemTotal"),
		Go:         runtime.Version(),
		LoadStart:  loadAverage(),
		RabbitPID:  e.rabbitPID,
	}
	if v, ok := e.conn.Properties["version"].(string); ok {
		m.RabbitMQ = v
	}
	if s, err := e.rdb.Info(ctx, "server").Result(); err == nil {
		for line := range strings.SplitSeq(s, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
				m.Redis = v
			}
		}
	}
	return m
}

func (m machine) print(w io.Writer) {
	fmt.Fprintf(w, "machine: %d CPUs (%s), GOMAXPROCS %d, %s RAM, %s, RabbitMQ %s, Redis %s\n",
		m.CPUs, m.CPUModel, m.GOMAXPROCS, m.MemTotal, m.Go, m.RabbitMQ, m.Redis)
	fmt.Fprintf(w, "load average at start: %s; RabbitMQ's process (listening on the AMQP port): %d\n", m.LoadStart, m.RabbitPID)
}

// procField returns the value of the first "name: value" line of a /proc
// file, or "?".
func procField(path, name string) string {
	f, err := os.Open(path)
	if err != nil {
		return "?"
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == name {
			return strings.Join(strings.Fields(v), " ")
		}
	}
	return "?"
}

// loadNow returns the 1-minute load average, or -1.
func loadNow() float64 {
	f := strings.Fields(loadAverage())
	if len(f) == 0 {
		return -1
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return -1
	}
	return v
}

// loadAverage returns the 1, 5 and 15 minute load averages, or "?".
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
