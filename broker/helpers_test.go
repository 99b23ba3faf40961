package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	amqp "github.com/rabbitmq/amqp091-go"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// A backend is a server the behavioural tests run against.
type backend struct {
	name string
	real bool
	// open returns a Broker on a server for t, and the Memory when the
	// server is one (nil for RabbitMQ). Both are closed at the end of t.
	open func(t testing.TB, opts Options) (*Broker, *brokertest.Server)
	// drop closes every connection of the fixture's Broker (they all carry
	// marker, its process name, in their names); other tests' connections
	// to a shared server are left alone.
	drop func(t *testing.T, m *brokertest.Server, marker string)
}

var backends = []backend{
	{
		name: "memory",
		open: func(t testing.TB, opts Options) (*Broker, *brokertest.Server) {
			m := brokertest.NewServer()
			b := New(m.URL(), opts)
			t.Cleanup(m.Close)
			t.Cleanup(func() { b.Close() })
			return b, m
		},
		drop: func(t *testing.T, m *brokertest.Server, _ string) {
			if n := m.CloseConnections(); n == 0 {
				t.Errorf("CloseConnections() = 0; want at least 1")
			}
		},
	},
	{
		name: "rabbitmq",
		real: true,
		open: func(t testing.TB, opts Options) (*Broker, *brokertest.Server) {
			b := New(testenv.RabbitMQURL(t), opts)
			t.Cleanup(func() { b.Close() })
			return b, nil
		},
		drop: func(t *testing.T, _ *brokertest.Server, marker string) {
			if n := testenv.CloseConnections(t, marker, "rabbitmw broker test"); n == 0 {
				t.Errorf("no connection named with %q to close; want at least 1", marker)
			}
		},
	},
}

// fixture is what a behavioural test works with.
type fixture struct {
	t    *testing.T
	be   backend
	b    *Broker
	mem  *brokertest.Server // nil on RabbitMQ
	q    string
	top  Topology
	logs *fixtures.LogRecorder
	// process names the Broker's process in fault headers and in its
	// connections' names; unique to the test.
	process string
}

// testTiers is the delay ladder of the tests.
var testTiers = []time.Duration{50 * time.Millisecond, 200 * time.Millisecond, time.Second}

// setup opens a Broker on be with a fresh queue name for top, declares the
// topology, and deletes it at the end of t.
func setup(t *testing.T, be backend, top Topology) *fixture {
	t.Helper()
	return setupWith(t, be, top, 500*time.Millisecond)
}

// setupWith is setup with a ReconnectMax of its own.
func setupWith(t *testing.T, be backend, top Topology, reconnectMax time.Duration) *fixture {
	t.Helper()
	logs := fixtures.NewLogRecorder(t)
	var r [4]byte
	_, _ = rand.Read(r[:])
	process := "test-process-" + hex.EncodeToString(r[:]) + "[1]"
	b, mem := be.open(t, Options{
		Logger:       slog.New(logs),
		ReconnectMin: min(20*time.Millisecond, reconnectMax),
		ReconnectMax: reconnectMax,
		Host:         "test-host",
		Process:      process,
	})
	f := &fixture{t: t, be: be, b: b, mem: mem, q: queueName(t), top: top, logs: logs, process: process}
	if top.Delays == nil {
		f.top.Delays = testTiers
	}
	ctx := testContext(t, 20*time.Second)
	require.NoError(t, b.Declare(ctx, f.q, f.top), "Declare(%q)", f.q)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		assert.NoError(t, f.b.Delete(ctx, f.q, f.top), "Delete(%q)", f.q)
	})
	return f
}

func queueName(t *testing.T) string {
	var r [4]byte
	_, _ = rand.Read(r[:])
	name := strings.NewReplacer("/", "-", " ", "_").Replace(t.Name())
	if len(name) > 150 {
		name = name[len(name)-150:]
	}
	return "rabbitmw-test-" + name + "-" + hex.EncodeToString(r[:])
}

func testContext(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// publish publishes a message with id and body to the work queue.
func (f *fixture) publish(id string, body []byte, headers amqp.Table) {
	f.t.Helper()
	ctx := testContext(f.t, 30*time.Second)
	err := f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: id, Body: body, Headers: headers, ContentType: "text/plain"})
	require.NoError(f.t, err, "Publish(%q)", id)
}

// length returns the number of ready messages in queue.
func (f *fixture) length(queue string) int {
	f.t.Helper()
	n, err := f.b.Len(testContext(f.t, 20*time.Second), queue)
	require.NoError(f.t, err, "Len(%q)", queue)
	return n
}

// drain takes and acks every message of queue, and returns them.
func (f *fixture) drain(queue string) []*amqp.Delivery {
	f.t.Helper()
	var out []*amqp.Delivery
	for {
		d, ok, err := f.b.Get(testContext(f.t, 20*time.Second), queue)
		require.NoError(f.t, err, "Get(%q)", queue)
		if !ok {
			return out
		}
		require.NoError(f.t, d.Ack(false), "Ack")
		out = append(out, d)
	}
}

// polledLength is length for a condition that require.Eventually polls:
// it runs on a goroutine of its own, where a check must not stop the test
// (FailNow belongs to the test's goroutine). A failed Len is reported and
// reads as -1, which no condition waits for.
func (f *fixture) polledLength(queue string) int {
	n, err := f.b.Len(testContext(f.t, 20*time.Second), queue)
	if !assert.NoError(f.t, err, "Len(%q)", queue) {
		return -1
	}
	return n
}

// polledDrain is drain for a condition that require.Eventually polls: a
// failed Get or Ack is reported and ends the drain.
func (f *fixture) polledDrain(queue string) []*amqp.Delivery {
	var out []*amqp.Delivery
	for {
		d, ok, err := f.b.Get(testContext(f.t, 20*time.Second), queue)
		if !assert.NoError(f.t, err, "Get(%q)", queue) || !ok {
			return out
		}
		if !assert.NoError(f.t, d.Ack(false), "Ack") {
			return out
		}
		out = append(out, d)
	}
}

// onlyDeadLetter takes every message out of the dead-letter queue, fails
// the test unless there was exactly one, and returns it.
func (f *fixture) onlyDeadLetter() *amqp.Delivery {
	f.t.Helper()
	dead := f.drain(f.q + ".dlq")
	if len(dead) != 1 {
		f.t.Fatalf("dead-letter queue holds %d messages; want 1", len(dead))
	}
	return dead[0]
}

// onlyDeath returns the one x-death record of d, and fails t unless d has
// exactly one.
func onlyDeath(t *testing.T, d *amqp.Delivery) amqp.Table {
	t.Helper()
	deaths, _ := d.Headers["x-death"].([]any)
	if len(deaths) != 1 {
		t.Fatalf("x-death = %v; want one record", d.Headers["x-death"])
	}
	death, ok := deaths[0].(amqp.Table)
	if !ok {
		t.Fatalf("x-death record %#v; want a table", deaths[0])
	}
	return death
}

// A run is a Consume call running in the background.
type run struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

// consume starts Consume on the work queue; it is stopped at the end of
// the test if the test did not stop it.
func (f *fixture) consume(h rabbitmw.Handler, opts ConsumeOptions) *run {
	f.t.Helper()
	opts.Topology = f.top
	ctx, cancel := context.WithCancel(context.Background())
	r := &run{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		r.err = f.b.Consume(ctx, f.q, h, opts)
	}()
	f.t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(time.Minute):
			f.t.Errorf("Consume did not return within a minute of its cancellation")
		}
	})
	return r
}

// stop cancels the run and returns Consume's result.
func (r *run) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	return r.wait(t, time.Minute)
}

// wait waits for Consume to return by itself.
func (r *run) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case <-r.done:
		return r.err
	case <-time.After(d):
		t.Fatalf("Consume did not return within %v", d)
		return nil
	}
}

// A journal is an idempotent recording handler's memory: for each message
// id, the deliveries seen and whether its effect was applied. It applies
// each message's effect once, however often the message comes.
type journal struct {
	mu      sync.Mutex
	calls   map[string][]call
	effects map[string]int
}

type call struct {
	at time.Time
	d  amqp.Delivery
}

func newJournal() *journal {
	return &journal{calls: make(map[string][]call), effects: make(map[string]int)}
}

// record notes d, and applies its effect if it was not applied yet. It
// returns the number of calls for d's id so far, this one included.
func (j *journal) record(d *amqp.Delivery) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.calls[d.MessageId] = append(j.calls[d.MessageId], call{at: time.Now(), d: *d})
	if j.effects[d.MessageId] == 0 {
		j.effects[d.MessageId] = 1
	}
	return len(j.calls[d.MessageId])
}

func (j *journal) callsOf(id string) []call {
	j.mu.Lock()
	defer j.mu.Unlock()
	return append([]call(nil), j.calls[id]...)
}

func (j *journal) effected() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	return len(j.effects)
}

func (j *journal) totalCalls() int {
	j.mu.Lock()
	defer j.mu.Unlock()
	n := 0
	for _, c := range j.calls {
		n += len(c)
	}
	return n
}

// recorded holds what an Observer's func was called with, in order, for
// a test to read while the broker's goroutines may still call it.
type recorded[T any] struct {
	mu sync.Mutex
	es []T
}

func (r *recorded[T]) add(e T) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.es = append(r.es, e)
}

func (r *recorded[T]) all() []T {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.es)
}
