package otelmw_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/errtest"
	"github.com/rabbitmw/rabbitmw/internal/text"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/otelmw"
)

const (
	traceID     = "4bf92f3577b34da6a3ce929d0e0e4736"
	parentID    = "00f067aa0ba902b7"
	traceparent = "00-" + traceID + "-" + parentID + "-01"
)

// The creation context is read from string and []byte header values, with
// its baggage; the span is its child, or with NewRoot a root linked to it.
func TestCreationContext(t *testing.T) {
	for _, c := range []struct {
		name    string
		value   any
		newRoot bool
	}{
		{"string", traceparent, false},
		{"bytes", []byte(traceparent), false},
		{"bytes/NewRoot", []byte(traceparent), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, otelmw.Options{Queue: "q", NewRoot: c.newRoot})
			var member string
			h := r.tel.Middleware()(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				member = baggage.FromContext(ctx).Member("tenant").Value()
				return nil
			}))
			d := &amqp.Delivery{Headers: amqp.Table{"traceparent": c.value, "baggage": []byte("tenant=acme")}, RoutingKey: "q"}
			require.NoError(t, h.Handle(context.Background(), d))
			spans := r.spans.Ended()
			if len(spans) != 1 {
				t.Fatalf("%d spans; want 1", len(spans))
			}
			s := spans[0]
			if member != "acme" {
				t.Errorf("baggage tenant in the handler = %q; want acme", member)
			}
			links := s.Links()
			if len(links) != 1 || links[0].SpanContext.TraceID().String() != traceID || links[0].SpanContext.SpanID().String() != parentID {
				t.Errorf("links = %v; want one, to the creation context", links)
			}
			gotParent := s.Parent().SpanID().String()
			if c.newRoot {
				if s.Parent().IsValid() || s.SpanContext().TraceID().String() == traceID {
					t.Errorf("NewRoot: parent %v, trace %v; want a root of a new trace", gotParent, s.SpanContext().TraceID())
				}
			} else if gotParent != parentID || s.SpanContext().TraceID().String() != traceID {
				t.Errorf("parent %v in trace %v; want %v in %v", gotParent, s.SpanContext().TraceID(), parentID, traceID)
			}
		})
	}
}

// messaging.destination.name and the span name, from the exchange, the
// routing key and the queue.
func TestDestination(t *testing.T) {
	for _, c := range []struct {
		exchange, key, queue string
		want                 string
	}{
		{"", "orders", "orders", "orders"},
		{"shop", "order.created", "orders", "shop:order.created:orders"},
		{"shop", "", "orders", "shop:orders"},
		{"shop", "order.created", "", "shop:order.created"},
		{"", "", "", ""},
	} {
		r := newRig(t, otelmw.Options{Queue: c.queue})
		h := r.tel.Middleware()(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }))
		h.Handle(context.Background(), &amqp.Delivery{Exchange: c.exchange, RoutingKey: c.key})
		s := r.spans.Ended()[0]
		wantName := strings.TrimSpace("process " + c.want)
		if got := attr(s, "messaging.destination.name").AsString(); got != c.want || s.Name() != wantName {
			t.Errorf("(%q, %q, %q): destination %q, span %q; want %q, %q", c.exchange, c.key, c.queue, got, s.Name(), c.want, wantName)
		}
	}
}

// A panic through the layer ends the span as an error, counts the handler
// as no longer active, and goes on.
func TestPanicGoesThrough(t *testing.T) {
	r := newRig(t, otelmw.Options{Queue: "q"})
	h := r.tel.Middleware()(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { panic("boom") }))
	func() {
		defer func() {
			if v := recover(); v != "boom" {
				t.Errorf("recovered %v; want the handler's panic", v)
			}
		}()
		h.Handle(context.Background(), &amqp.Delivery{})
	}()
	s := r.spans.Ended()
	if len(s) != 1 || s[0].Status().Code != codes.Error || attr(s[0], "error.type").AsString() != "panic" {
		t.Fatalf("spans %v; want one, ended with status Error and error.type panic", s)
	}
	if n := count(r.metrics(t), "rabbitmw.handlers.active"); n != 0 {
		t.Errorf("rabbitmw.handlers.active = %d after the panic; want 0", n)
	}
}

// A failure's span carries the error.type of rabbitmw.ErrorType, the name
// the fault headers and the command give it too.
func TestErrorType(t *testing.T) {
	jsonErr := json.Unmarshal([]byte("{"), new(any))
	for _, c := range []struct {
		err  error
		want string
	}{
		{rabbitmw.RetryAfter(fmt.Errorf("x: %w", middleware.ErrBusy), 1), "busy"},
		{fmt.Errorf("call: %w", context.DeadlineExceeded), "timeout"},
		{rabbitmw.Permanent(&rabbitmw.PanicError{Value: 1}), "panic"},
		{rabbitmw.Permanent(fmt.Errorf("decode: %w", jsonErr)), "*json.SyntaxError"},
		{errors.New("plain"), "error"},
	} {
		r := newRig(t, otelmw.Options{Queue: "q"})
		h := r.tel.Middleware()(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return c.err }))
		h.Handle(context.Background(), &amqp.Delivery{})
		s := r.spans.Ended()
		if len(s) != 1 {
			t.Fatalf("%d spans; want 1", len(s))
		}
		if got := attr(s[0], "error.type").AsString(); got != c.want || got != rabbitmw.ErrorType(c.err) {
			t.Errorf("error.type of %v = %q; want %q, as rabbitmw.ErrorType says", c.err, got, c.want)
		}
	}
}

// A handler's error whose Error method panics (a nil pointer returned as
// an error, or a method that panics on any value) is recorded on the span
// with a text that names its type; the layer, which no Recover guards,
// does not panic, and returns the error unchanged.
func TestErrorWhoseTextPanics(t *testing.T) {
	for _, c := range errtest.Cases() {
		for name, result := range map[string]error{"requeued": c.Err, "dead-lettered": rabbitmw.Permanent(c.Err)} {
			t.Run(c.Type+"/"+name, func(t *testing.T) {
				r := newRig(t, otelmw.Options{Queue: "q"})
				h := r.tel.Middleware()(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return result }))
				var err error
				require.NotPanics(t, func() { err = h.Handle(context.Background(), &amqp.Delivery{}) })
				require.Equal(t, result, err, "the layer changed the result")
				s := r.spans.Ended()
				require.Len(t, s, 1)
				require.Equal(t, codes.Error, s[0].Status().Code)
				require.Equal(t, c.Text, s[0].Status().Description)
				require.Equal(t, c.Type, attr(s[0], "error.type").AsString())
				if name == "dead-lettered" {
					require.Equal(t, c.Text, attr(s[0], "rabbitmw.dead_letter.reason").AsString())
				}
			})
		}
	}
}

// An error of a megabyte (one that wraps a response body, say) makes no
// span attribute or status of that size, which an exporter may drop: its
// text is cut to text.MaxError bytes, as the fault headers cut it, keeping
// its beginning and marking the cut.
func TestErrorTextIsCapped(t *testing.T) {
	huge := "GET /orders/17: 502: " + strings.Repeat("<html>", 1<<20/6)
	r := newRig(t, otelmw.Options{Queue: "q"})
	h := r.tel.Middleware()(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		return rabbitmw.Permanent(errors.New(huge))
	}))
	h.Handle(context.Background(), &amqp.Delivery{})
	s := r.spans.Ended()
	require.Len(t, s, 1)
	for what, got := range map[string]string{
		"status description": s[0].Status().Description,
		"reason":             attr(s[0], "rabbitmw.dead_letter.reason").AsString(),
	} {
		if len(got) > text.MaxError || len(got) < text.MaxError/2 || !strings.HasSuffix(got, "…") || !strings.HasPrefix(huge, strings.TrimSuffix(got, "…")) {
			t.Errorf("%s of %d bytes, ending %q; want the error's first bytes, at most %d, ending in …", what, len(got), got[max(0, len(got)-10):], text.MaxError)
		}
	}
}

// Inject writes the context into a copy of the headers; HeaderCarrier
// reads it back.
func TestInject(t *testing.T) {
	r := newRig(t, otelmw.Options{})
	ctx, span := r.tp.Tracer("t").Start(context.Background(), "client")
	defer span.End()
	shared := amqp.Table{"custom": "kept"}
	msg := amqp.Publishing{Headers: shared}
	r.tel.Inject(ctx, &msg)
	if len(shared) != 1 {
		t.Errorf("shared headers = %v after Inject; want them untouched", shared)
	}
	if msg.Headers["custom"] != "kept" {
		t.Errorf("headers = %v; want the caller's kept", msg.Headers)
	}
	got := w3c.Extract(context.Background(), otelmw.HeaderCarrier(msg.Headers))
	if sc := trace.SpanContextFromContext(got); sc.SpanID() != span.SpanContext().SpanID() {
		t.Errorf("extracted span %v; want %v", sc.SpanID(), span.SpanContext().SpanID())
	}
}

// The core packages do not link OpenTelemetry: only a program that
// imports otelmw does.
func TestCoreDoesNotLinkOpenTelemetry(t *testing.T) {
	core := []string{"github.com/rabbitmw/rabbitmw", "github.com/rabbitmw/rabbitmw/middleware",
		"github.com/rabbitmw/rabbitmw/store/...", "github.com/rabbitmw/rabbitmw/broker/...", "github.com/rabbitmw/rabbitmw/rabbitmwtest"}
	out, err := exec.Command("go", append([]string{"list", "-deps"}, core...)...).CombinedOutput()
	require.NoError(t, err, "go list -deps: %s", out)
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "go.opentelemetry.io/") || strings.Contains(p, "prometheus") || strings.HasSuffix(p, "/otelmw") {
			t.Errorf("go list -deps of the core lists %s", p)
		}
	}
}

// The broker's events count by queue: reconnects (the shared connection
// without a queue), delay copies (with error.type when not published),
// dead-letters by the copy's error type (when published); publish
// channels replaced by node, with error.type when none could be opened.
func TestBrokerEvents(t *testing.T) {
	r := newRig(t, otelmw.Options{Queue: "q"})
	obs := r.tel.Broker()
	ctx := context.Background()
	obs.Reconnect(broker.ReconnectEvent{Queue: "q", Err: broker.ErrConnectionLost})
	obs.Reconnect(broker.ReconnectEvent{Err: broker.ErrUnreachable})
	obs.Republish(ctx, broker.RepublishEvent{Outcome: rabbitmw.Delay, Queue: "q", To: "q.delay.1s"})
	obs.Republish(ctx, broker.RepublishEvent{Outcome: rabbitmw.Delay, Queue: "q", To: "q.delay.1s", Err: context.DeadlineExceeded})
	obs.Republish(ctx, broker.RepublishEvent{Outcome: rabbitmw.DeadLetter, Queue: "q", To: "q.dlq", ErrorType: "*json.SyntaxError"})
	obs.Republish(ctx, broker.RepublishEvent{Outcome: rabbitmw.DeadLetter, Queue: "q", To: "q.dlq", ErrorType: "*json.SyntaxError", Err: broker.ErrNacked})
	obs.PublishChannel(broker.PublishChannelEvent{Node: "rabbit-1:5672/", Connection: "c", Nacks: 3})
	obs.PublishChannel(broker.PublishChannelEvent{Node: "rabbit-1:5672/", Connection: "c", Nacks: 5})
	obs.PublishChannel(broker.PublishChannelEvent{Node: "rabbit-1:5672/", Connection: "c", Nacks: 1, Err: context.DeadlineExceeded})
	rm := r.metrics(t)
	node := attribute.String("rabbitmw.node", "rabbit-1:5672/")
	dest := attribute.String("messaging.destination.name", "q")
	for _, c := range []struct {
		name string
		kvs  []attribute.KeyValue
		want int64
	}{
		{"rabbitmw.reconnects", nil, 2},
		{"rabbitmw.reconnects", []attribute.KeyValue{dest}, 1},
		{"rabbitmw.delay.republishes", []attribute.KeyValue{dest, attribute.String("rabbitmw.delay.queue", "q.delay.1s")}, 2},
		{"rabbitmw.delay.republishes", []attribute.KeyValue{attribute.String("error.type", "timeout")}, 1},
		{"rabbitmw.dead_letters", []attribute.KeyValue{dest, attribute.String("error.type", "*json.SyntaxError")}, 1},
		{"rabbitmw.publish_channel.replacements", []attribute.KeyValue{node}, 3},
		{"rabbitmw.publish_channel.replacements", []attribute.KeyValue{node, attribute.String("error.type", "timeout")}, 1},
	} {
		if got := count(rm, c.name, c.kvs...); got != c.want {
			t.Errorf("%s%v = %d; want %d", c.name, c.kvs, got, c.want)
		}
	}
}

// A handler's error whose chain is malformed (see
// errtest.MalformedChains) hangs and crashes no span: the layer returns
// it cut, and records it so.
func TestMalformedChain(t *testing.T) {
	for _, c := range errtest.MalformedChains() {
		t.Run(c.Name, func(t *testing.T) {
			r := newRig(t, otelmw.Options{Queue: "q"})
			h := r.tel.Middleware()(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return c.Err }))
			var err error
			errtest.Returns(t, "the layer", func() { err = h.Handle(context.Background(), &amqp.Delivery{}) })
			require.ErrorContains(t, err, "malformed error chain cut")
			s := r.spans.Ended()
			require.Len(t, s, 1)
			require.Equal(t, err.Error(), s[0].Status().Description)
			require.Equal(t, "malformed_chain", attr(s[0], "error.type").AsString())
		})
	}
}
