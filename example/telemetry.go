package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/rabbitmw/rabbitmw/otelmw"
)

// telemetry is the OpenTelemetry of a run: -trace collects its spans to
// print each message's trace as a tree, -metrics serves its metrics to
// Prometheus. Without either, the run has none.
type telemetry struct {
	tel    *otelmw.Telemetry
	spans  *spanTree    // nil without -trace
	server *http.Server // nil without -metrics
	addr   string       // where server listens
	close  func(context.Context) error
}

// openTelemetry returns the telemetry cfg asks for, for the consumers of
// queue, or nil if it asks for none.
func openTelemetry(cfg config, queue string) (*telemetry, error) {
	if !cfg.trace && cfg.metrics == nil {
		return nil, nil
	}
	t := &telemetry{}
	opts := otelmw.Options{
		Queue:      queue,
		Propagator: propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}),
	}
	var closers []func(context.Context) error
	if cfg.trace {
		t.spans = &spanTree{}
		tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(t.spans))
		opts.TracerProvider = tp
		closers = append(closers, tp.Shutdown)
	}
	if cfg.metrics != nil {
		reg := prometheus.NewRegistry()
		exp, err := otelprom.New(otelprom.WithRegisterer(reg))
		if err != nil {
			return nil, fmt.Errorf("prometheus exporter: %w", err)
		}
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp))
		opts.MeterProvider = mp
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		t.server = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		t.addr = cfg.metrics.Addr().String()
		go t.server.Serve(cfg.metrics) // ends at Shutdown
		closers = append(closers, t.server.Shutdown, mp.Shutdown)
	}
	t.tel = otelmw.New(opts)
	t.close = func(ctx context.Context) error {
		var errs []error
		for _, c := range closers {
			if err := c(ctx); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errs = append(errs, err)
			}
		}
		return errors.Join(errs...)
	}
	return t, nil
}

// A spanTree is a span exporter that keeps the spans, to print them as
// one tree per trace.
type spanTree struct {
	mu    sync.Mutex
	spans []sdktrace.ReadOnlySpan
}

func (s *spanTree) ExportSpans(_ context.Context, spans []sdktrace.ReadOnlySpan) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.spans = append(s.spans, spans...)
	return nil
}

func (s *spanTree) Shutdown(context.Context) error { return nil }

// print writes each trace as a tree of its spans, the traces in the
// order of their first span, each span with what it says about its
// message: its outcome, attempt, error type and Dedup's events.
func (s *spanTree) print(w io.Writer) {
	s.mu.Lock()
	spans := slices.Clone(s.spans)
	s.mu.Unlock()
	slices.SortFunc(spans, func(a, b sdktrace.ReadOnlySpan) int { return a.StartTime().Compare(b.StartTime()) })
	children := map[string][]sdktrace.ReadOnlySpan{}
	present := map[string]bool{}
	for _, sp := range spans {
		present[sp.SpanContext().SpanID().String()] = true
	}
	var roots []sdktrace.ReadOnlySpan
	for _, sp := range spans {
		parent := sp.Parent().SpanID().String()
		if sp.Parent().IsValid() && present[parent] {
			children[parent] = append(children[parent], sp)
		} else {
			roots = append(roots, sp)
		}
	}
	fmt.Fprintf(w, "\ntraces (%d spans):\n", len(spans))
	for _, root := range roots {
		fmt.Fprintf(w, "trace %s\n", root.SpanContext().TraceID())
		printSpan(w, root, children, 1)
	}
}

func printSpan(w io.Writer, sp sdktrace.ReadOnlySpan, children map[string][]sdktrace.ReadOnlySpan, depth int) {
	var b strings.Builder
	fmt.Fprintf(&b, "%s%s (%s, %v)", strings.Repeat("  ", depth), sp.Name(), strings.ToLower(sp.SpanKind().String()), sp.EndTime().Sub(sp.StartTime()).Round(10*time.Microsecond))
	for _, kv := range sp.Attributes() {
		switch kv.Key {
		case "messaging.message.id", "rabbitmw.outcome", "rabbitmw.attempt", "error.type", "rabbitmw.retry.delay":
			fmt.Fprintf(&b, " %s=%s", strings.TrimPrefix(strings.TrimPrefix(string(kv.Key), "rabbitmw."), "messaging."), kv.Value.Emit())
		}
	}
	for _, l := range sp.Links() {
		fmt.Fprintf(&b, " link=%s", l.SpanContext.SpanID())
	}
	var events []string
	for _, e := range sp.Events() {
		events = append(events, strings.TrimPrefix(e.Name, "rabbitmw."))
	}
	if len(events) > 0 {
		fmt.Fprintf(&b, " [%s]", strings.Join(events, " "))
	}
	fmt.Fprintln(w, b.String())
	for _, c := range children[sp.SpanContext().SpanID().String()] {
		printSpan(w, c, children, depth+1)
	}
}

// listenMetrics listens on addr for the -metrics server.
func listenMetrics(addr string) (net.Listener, error) {
	if addr == "" {
		return nil, nil
	}
	return net.Listen("tcp", addr)
}
