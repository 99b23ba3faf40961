package otelmw_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/otelmw"
	"github.com/rabbitmw/rabbitmw/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var w3c = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// rig is a Telemetry over the SDK, with what it recorded.
type rig struct {
	tel    *otelmw.Telemetry
	tp     *sdktrace.TracerProvider
	spans  *tracetest.SpanRecorder
	reader *sdkmetric.ManualReader
}

func newRig(t *testing.T, opts otelmw.Options) *rig {
	r := &rig{spans: tracetest.NewSpanRecorder(), reader: sdkmetric.NewManualReader()}
	r.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(r.spans))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r.reader))
	t.Cleanup(func() {
		r.tp.Shutdown(context.Background())
		mp.Shutdown(context.Background())
	})
	opts.TracerProvider, opts.MeterProvider, opts.Propagator = r.tp, mp, w3c
	r.tel = otelmw.New(opts)
	return r
}

// ended returns the ended spans named name.
func (r *rig) ended(name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range r.spans.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

// metrics collects what the meter recorded.
func (r *rig) metrics(t *testing.T) metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, r.reader.Collect(context.Background(), &rm), "Collect")
	return rm
}

// has reports whether set holds every one of kvs.
func has(set attribute.Set, kvs []attribute.KeyValue) bool {
	for _, kv := range kvs {
		if v, ok := set.Value(kv.Key); !ok || v != kv.Value {
			return false
		}
	}
	return true
}

// count returns the sum of the data points of the counter (or the count
// of the histogram) name whose attributes hold every one of kvs.
func count(rm metricdata.ResourceMetrics, name string, kvs ...attribute.KeyValue) int64 {
	var n int64
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			if m.Name != name {
				continue
			}
			switch data := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range data.DataPoints {
					if has(p.Attributes, kvs) {
						n += p.Value
					}
				}
			case metricdata.Histogram[float64]:
				for _, p := range data.DataPoints {
					if has(p.Attributes, kvs) {
						n += int64(p.Count)
					}
				}
			case metricdata.Histogram[int64]:
				for _, p := range data.DataPoints {
					if has(p.Attributes, kvs) {
						n += int64(p.Count)
					}
				}
			}
		}
	}
	return n
}

func attr(s sdktrace.ReadOnlySpan, key string) attribute.Value {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value
		}
	}
	return attribute.Value{}
}

func events(s sdktrace.ReadOnlySpan) []string {
	var out []string
	for _, e := range s.Events() {
		out = append(out, e.Name)
	}
	return out
}

// orderError is the handler's error type for a message it cannot parse.
type orderError struct{ id string }

func (e *orderError) Error() string { return "order " + e.id + " cannot be parsed" }

type flakyError struct{}

func (flakyError) Error() string { return "flaky" }

func queueName(t *testing.T) string {
	var b [4]byte
	rand.Read(b[:])
	return "rabbitmw-test-otel-" + strings.NewReplacer("/", "-").Replace(t.Name()) + "-" + hex.EncodeToString(b[:])
}

// backends open a Broker with opts on each server, memory and RabbitMQ.
var backends = []struct {
	name string
	open func(t *testing.T, opts broker.Options) *broker.Broker
}{
	{"memory", func(t *testing.T, opts broker.Options) *broker.Broker {
		m := brokertest.NewServer()
		b := broker.New(m.URL(), opts)
		t.Cleanup(m.Close)
		t.Cleanup(func() { b.Close() })
		return b
	}},
	{"rabbitmq", func(t *testing.T, opts broker.Options) *broker.Broker {
		b := broker.New(testenv.RabbitMQURL(t), opts)
		t.Cleanup(func() { b.Close() })
		return b
	}},
}

// A message that fails twice and then succeeds, one dead-lettered at once
// and one that comes twice, through the recommended stack on a broker:
// the trace of each links every attempt to its publish across the delay
// queue, the spans say what became of each attempt, and the metrics add
// up.
func TestTraceAndMetrics(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) { testTraceAndMetrics(t, be.open) })
	}
}

func testTraceAndMetrics(t *testing.T, open func(*testing.T, broker.Options) *broker.Broker) {
	q := queueName(t)
	r := newRig(t, otelmw.Options{Queue: q})
	b := open(t, broker.Options{Observer: r.tel.Broker(), ReconnectMax: 500 * time.Millisecond})
	top := broker.Topology{Delays: []time.Duration{50 * time.Millisecond}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.NoError(t, b.Declare(ctx, q, top), "Declare")
	t.Cleanup(func() { b.Delete(context.Background(), q, top) })

	s := store.NewMemory()
	var mu sync.Mutex
	calls := map[string]int{}
	handler := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		calls[d.MessageId]++
		n := calls[d.MessageId]
		mu.Unlock()
		switch {
		case d.MessageId == "flaky" && n <= 2:
			return flakyError{}
		case d.MessageId == "poison":
			return rabbitmw.Permanent(&orderError{d.MessageId})
		}
		return nil
	})
	chain := rabbitmw.Chain(
		r.tel.Middleware(),
		middleware.Retry(s, middleware.RetryOptions{Backoff: func(int) time.Duration { return 50 * time.Millisecond }}),
		middleware.Recover(),
		middleware.Dedup(s, middleware.DedupOptions{Observe: r.tel.Dedup()}),
	)(handler)
	cctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Consume(cctx, q, chain, broker.ConsumeOptions{Topology: top, Workers: 1}) }()
	defer func() {
		stop()
		assert.NoError(t, <-done, "Consume")
	}()

	// One worker: the second copy of dup comes after the first was marked
	// done, so it is a duplicate, never busy.

	// The publisher's own span, around its publishes.
	pctx, client := r.tp.Tracer("client").Start(ctx, "client")
	for _, id := range []string{"flaky", "poison", "dup", "dup"} {
		require.NoError(t, b.Publish(pctx, "", q, amqp.Publishing{MessageId: id, CorrelationId: "conv-" + id}), "Publish(%s)", id)
	}
	client.End()

	processName := "process " + q
	require.EventuallyWithT(t, func(c *assert.CollectT) {
		assert.GreaterOrEqual(c, len(r.ended(processName)), 6, "process spans")
	}, 30*time.Second, 10*time.Millisecond)
	stop()
	assert.NoError(t, <-done, "Consume")
	done <- nil

	sends := r.ended("send " + q)
	if len(sends) != 4 {
		t.Fatalf("%d send spans; want 4", len(sends))
	}
	sendOf := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range sends {
		if s.SpanKind() != trace.SpanKindProducer || s.Parent().SpanID() != client.SpanContext().SpanID() {
			t.Errorf("send span %v of kind %v, parent %v; want a producer, child of the client's span", s.Name(), s.SpanKind(), s.Parent().SpanID())
		}
		id := attr(s, "messaging.message.id").AsString()
		sendOf[id] = append(sendOf[id], s)
	}
	byID := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range r.ended(processName) {
		id := attr(s, "messaging.message.id").AsString()
		byID[id] = append(byID[id], s)
	}

	// flaky: three attempts, each a child of the publish and linked to it.
	flaky := byID["flaky"]
	if len(flaky) != 3 {
		t.Fatalf("%d process spans of flaky; want 3", len(flaky))
	}
	send := sendOf["flaky"][0].SpanContext()
	wantOutcome := []string{"delayed", "delayed", "acked"}
	for i, s := range flaky {
		what := fmt.Sprintf("flaky attempt %d", i+1)
		if s.SpanKind() != trace.SpanKindConsumer {
			t.Errorf("%s: kind %v; want consumer", what, s.SpanKind())
		}
		if s.Parent().SpanID() != send.SpanID() || s.SpanContext().TraceID() != send.TraceID() {
			t.Errorf("%s: parent %v in trace %v; want the send span %v in %v", what, s.Parent().SpanID(), s.SpanContext().TraceID(), send.SpanID(), send.TraceID())
		}
		if l := s.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != send.SpanID() {
			t.Errorf("%s: links %v; want one, to the send span", what, l)
		}
		for key, want := range map[string]attribute.Value{
			"messaging.system":                           attribute.StringValue("rabbitmq"),
			"messaging.operation.name":                   attribute.StringValue("process"),
			"messaging.operation.type":                   attribute.StringValue("process"),
			"messaging.destination.name":                 attribute.StringValue(q),
			"messaging.rabbitmq.destination.routing_key": attribute.StringValue(q),
			"messaging.message.conversation_id":          attribute.StringValue("conv-flaky"),
			"rabbitmw.outcome":                           attribute.StringValue(wantOutcome[i]),
			"rabbitmw.attempt":                           attribute.IntValue(i + 1),
		} {
			if got := attr(s, key); got != want {
				t.Errorf("%s: %s = %v; want %v", what, key, got.Emit(), want.Emit())
			}
		}
		if got := attr(s, "messaging.client.id").AsString(); got == "" {
			t.Errorf("%s: no messaging.client.id", what)
		}
		if got := attr(s, "messaging.rabbitmq.message.delivery_tag").AsInt64(); got == 0 {
			t.Errorf("%s: no delivery tag", what)
		}
		if i < 2 {
			if s.Status().Code != codes.Error || attr(s, "error.type").AsString() != "otelmw_test.flakyError" {
				t.Errorf("%s: status %v, error.type %q; want Error, otelmw_test.flakyError", what, s.Status(), attr(s, "error.type").AsString())
			}
			if got := attr(s, "rabbitmw.retry.delay").AsFloat64(); got < 0.04 {
				t.Errorf("%s: rabbitmw.retry.delay = %v; want about 0.05 s", what, got)
			}
		} else if s.Status().Code == codes.Error {
			t.Errorf("%s: status %v; want not an error", what, s.Status())
		}
		if ev := events(s); len(ev) == 0 || ev[0] != "rabbitmw.dedup.claimed" {
			t.Errorf("%s: events %v; want rabbitmw.dedup.claimed first", what, ev)
		}
	}

	// poison: dead-lettered at once, with its reason.
	if p := byID["poison"]; len(p) != 1 {
		t.Errorf("%d process spans of poison; want 1", len(p))
	} else {
		s := p[0]
		if got := attr(s, "rabbitmw.outcome").AsString(); got != "dead-lettered" {
			t.Errorf("poison: outcome %q; want dead-lettered", got)
		}
		if got := attr(s, "rabbitmw.dead_letter.reason").AsString(); got != "order poison cannot be parsed" {
			t.Errorf("poison: reason %q; want the error's text", got)
		}
		if got := attr(s, "error.type").AsString(); got != "*otelmw_test.orderError" {
			t.Errorf("poison: error.type %q; want *otelmw_test.orderError", got)
		}
	}

	// dup: the second copy is a duplicate, and says so.
	var outcomes, evs []string
	for _, s := range byID["dup"] {
		outcomes = append(outcomes, attr(s, "rabbitmw.outcome").AsString())
		evs = append(evs, events(s)...)
	}
	slices.Sort(outcomes)
	if strings.Join(outcomes, ",") != "acked,duplicate" || !strings.Contains(strings.Join(evs, ","), "rabbitmw.dedup.duplicate") {
		t.Errorf("dup: outcomes %v, events %v; want one acked and one duplicate, with a rabbitmw.dedup.duplicate event", outcomes, evs)
	}

	// The counts add up.
	rm := r.metrics(t)
	outcome := func(o string) attribute.KeyValue { return attribute.String("rabbitmw.outcome", o) }
	for _, c := range []struct {
		name string
		kvs  []attribute.KeyValue
		want int64
	}{
		{"messaging.client.consumed.messages", nil, 6},
		{"messaging.client.consumed.messages", []attribute.KeyValue{outcome("acked")}, 2},
		{"messaging.client.consumed.messages", []attribute.KeyValue{outcome("delayed"), attribute.String("error.type", "otelmw_test.flakyError")}, 2},
		{"messaging.client.consumed.messages", []attribute.KeyValue{outcome("dead-lettered"), attribute.String("error.type", "*otelmw_test.orderError")}, 1},
		{"messaging.client.consumed.messages", []attribute.KeyValue{outcome("duplicate")}, 1},
		{"messaging.process.duration", []attribute.KeyValue{attribute.String("messaging.destination.name", q)}, 6},
		{"messaging.client.sent.messages", []attribute.KeyValue{attribute.String("messaging.destination.name", q)}, 4},
		{"rabbitmw.dedup.results", []attribute.KeyValue{attribute.String("rabbitmw.dedup.result", "claimed")}, 5},
		{"rabbitmw.dedup.results", []attribute.KeyValue{attribute.String("rabbitmw.dedup.result", "duplicate")}, 1},
		{"rabbitmw.message.attempts", []attribute.KeyValue{outcome("acked")}, 2},
		{"rabbitmw.message.attempts", []attribute.KeyValue{outcome("dead-lettered")}, 1},
		{"rabbitmw.dead_letters", []attribute.KeyValue{attribute.String("error.type", "*otelmw_test.orderError")}, 1},
		{"rabbitmw.delay.republishes", []attribute.KeyValue{attribute.String("rabbitmw.delay.queue", q+".delay.50ms")}, 2},
		{"rabbitmw.handlers.active", nil, 0},
		{"rabbitmw.dedup.leases.lost", nil, 0},
	} {
		if got := count(rm, c.name, c.kvs...); got != c.want {
			t.Errorf("%s%v = %d; want %d", c.name, c.kvs, got, c.want)
		}
	}
}
