package deadletter

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// A backend is a server the tests run against.
type backend struct {
	name string
	// open returns a Broker on a server for t, and the server when it is
	// the in-memory one (nil for RabbitMQ). Both are closed at the end of
	// t.
	open func(t testing.TB, opts broker.Options) (*broker.Broker, *brokertest.Server)
}

var backends = []backend{
	{
		name: "memory",
		open: func(t testing.TB, opts broker.Options) (*broker.Broker, *brokertest.Server) {
			m := brokertest.NewServer()
			b := broker.New(m.URL(), opts)
			t.Cleanup(m.Close)
			t.Cleanup(func() { b.Close() })
			return b, m
		},
	},
	{
		name: "rabbitmq",
		open: func(t testing.TB, opts broker.Options) (*broker.Broker, *brokertest.Server) {
			b := broker.New(testenv.RabbitMQURL(t), opts)
			t.Cleanup(func() { b.Close() })
			return b, nil
		},
	},
}

// fixture is what a test works with: a Broker, an Inspector of its
// server, and a work queue of the test's own.
type fixture struct {
	t    *testing.T
	b    *broker.Broker
	in   *Inspector
	mem  *brokertest.Server // nil on RabbitMQ
	q    string
	top  broker.Topology
	logs *fixtures.LogRecorder
	// process names the Broker's process in fault headers; unique to the
	// test.
	process string
}

// setup opens a Broker on be with a fresh queue name for top (with short
// delays unless top has its own), declares the topology, and deletes it
// at the end of t.
func setup(t *testing.T, be backend, top broker.Topology) *fixture {
	t.Helper()
	logs := fixtures.NewLogRecorder(t)
	var r [4]byte
	_, _ = rand.Read(r[:])
	process := "test-process-" + hex.EncodeToString(r[:]) + "[1]"
	b, mem := be.open(t, broker.Options{
		Logger:       slog.New(logs),
		ReconnectMin: 20 * time.Millisecond,
		ReconnectMax: 500 * time.Millisecond,
		Host:         "test-host",
		Process:      process,
	})
	if top.Delays == nil {
		top.Delays = []time.Duration{50 * time.Millisecond, 200 * time.Millisecond, time.Second}
	}
	f := &fixture{t: t, b: b, in: New(b), mem: mem, q: queueName(t), top: top, logs: logs, process: process}
	require.NoError(t, b.Declare(testContext(t, 20*time.Second), f.q, f.top), "Declare(%q)", f.q)
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
	err := f.b.Publish(testContext(f.t, 30*time.Second), "", f.q, amqp.Publishing{MessageId: id, Body: body, Headers: headers, ContentType: "text/plain"})
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

// assertSettled checks that the work queue and the dead-letter queue are
// empty and that nothing is left unacknowledged or was settled twice.
func (f *fixture) assertSettled(t *testing.T) {
	t.Helper()
	assert.Zero(t, f.length(f.q), "Len(%q)", f.q)
	assert.Zero(t, f.length(f.q+".dlq"), "Len(dlq)")
	if f.mem != nil {
		assert.Zero(t, f.mem.Unacked(f.q), "unacked(%q)", f.q)
		assert.Zero(t, f.mem.Stats().UnknownTags, "settlements with unknown delivery tags")
	}
	assert.Zero(t, f.logs.Count("unknown delivery tag"), "log records about unknown delivery tags")
}

// A run is a Consume call running in the background.
type run struct {
	cancel context.CancelFunc
	done   chan struct{}
	err    error
}

// consume starts Consume on the work queue; it is stopped at the end of
// the test if the test did not stop it.
func (f *fixture) consume(h rabbitmw.Handler, opts broker.ConsumeOptions) *run {
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
	select {
	case <-r.done:
		return r.err
	case <-time.After(time.Minute):
		t.Fatalf("Consume did not return within a minute")
		return nil
	}
}

var errBoom = errors.New("boom")

// A journal is a recording handler's memory: for each message id, the
// deliveries seen.
type journal struct {
	mu    sync.Mutex
	calls map[string][]amqp.Delivery
}

func newJournal() *journal {
	return &journal{calls: make(map[string][]amqp.Delivery)}
}

// record notes d, and returns the number of calls for d's id so far, this
// one included.
func (j *journal) record(d *amqp.Delivery) int {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.calls[d.MessageId] = append(j.calls[d.MessageId], *d)
	return len(j.calls[d.MessageId])
}

func (j *journal) callsOf(id string) []amqp.Delivery {
	j.mu.Lock()
	defer j.mu.Unlock()
	return append([]amqp.Delivery(nil), j.calls[id]...)
}
