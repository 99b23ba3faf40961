package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The example's consumers, broker and embedded Redis end with each run.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// The example's scenarios are a test: every verdict must hold, on the
// embedded servers and on real ones.
func TestExample(t *testing.T) {
	runs := []struct {
		name string
		cfg  func(t *testing.T) config
	}{
		{"embedded", func(*testing.T) config { return config{} }},
		{"servers", func(t *testing.T) config {
			return config{amqpURL: testenv.RabbitMQURL(t), redisAddr: testenv.RedisAddr(t)}
		}},
		{"postgres-inbox", func(t *testing.T) config {
			return config{postgresURL: testenv.PostgresURL(t), inbox: true}
		}},
	}
	for _, r := range runs {
		t.Run(r.name, func(t *testing.T) {
			cfg := r.cfg(t)
			cfg.timeout = time.Minute
			cfg.logger = slog.New(slog.DiscardHandler)
			rep, err := run(context.Background(), cfg)
			require.NoError(t, err, "run")
			var out bytes.Buffer
			rep.print(&out)
			t.Log("\n" + out.String())
			for _, c := range rep.checks() {
				if !c.ok {
					t.Errorf("check failed: %s", c.text)
				}
			}
			if !strings.Contains(out.String(), "verdict: OK") {
				t.Errorf("the printed verdict is not OK")
			}
		})
	}
}

// A broken guarantee must turn the verdict: here the business handler
// applies its effect twice for one message, as it would without Dedup.
func TestExampleVerdictCatchesDoubleEffect(t *testing.T) {
	rep := newReport(config{}, "q")
	for _, s := range scenarios {
		for range s.wantEffects() {
			rep.effect(s.key())
		}
	}
	rep.effect("order-1") // a second effect
	require.False(t, rep.ok(), "the report is ok with order-1 applied twice; want a failed verdict")
	var out bytes.Buffer
	rep.print(&out)
	assert.Contains(t, out.String(), "order-1: business effect 2 time(s), want 1", "the verdict does not name the double effect")
}

// -trace prints each message's trace, and -metrics serves the metrics to
// Prometheus: a scrape at the end of the run finds every message counted.
func TestExampleTelemetry(t *testing.T) {
	l, err := listenMetrics("127.0.0.1:0")
	require.NoError(t, err)
	var scraped string
	cfg := config{timeout: time.Minute, logger: slog.New(slog.DiscardHandler), trace: true, metrics: l}
	cfg.serving = func(addr string) {
		resp, err := http.Get("http://" + addr + "/metrics")
		if !assert.NoError(t, err, "scrape") {
			return
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		scraped = string(body)
	}
	rep, err := run(context.Background(), cfg)
	require.NoError(t, err, "run")
	for _, want := range []string{
		`messaging_client_consumed_messages_total{`,
		`messaging_client_sent_messages_total{`,
		`messaging_process_duration_seconds_bucket{`,
		`rabbitmw_dedup_results_total{`,
		`rabbitmw_dedup_result="duplicate"`,
		`rabbitmw_dead_letters_total{error_type="error"`,
		`rabbitmw_delay_republishes_total{`,
		`rabbitmw_handlers_active{`,
		`rabbitmw_message_attempts_bucket{`,
	} {
		if !strings.Contains(scraped, want) {
			t.Errorf("the scrape has no %s", want)
		}
	}
	if t.Failed() {
		t.Log(scraped)
	}
	var out bytes.Buffer
	rep.spans.print(&out)
	for _, want := range []string{"send rabbitmw-example-", "process rabbitmw-example-", "outcome=dead-lettered attempt=5", "[dedup.duplicate]", "dedup.lease_renewed"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the traces printed have no %q:\n%s", want, out.String())
		}
	}
}
