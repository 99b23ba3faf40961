package main

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
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
			if err != nil {
				t.Fatalf("run: %v", err)
			}
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
	if rep.ok() {
		t.Fatal("the report is ok with order-1 applied twice; want a failed verdict")
	}
	var out bytes.Buffer
	rep.print(&out)
	if !strings.Contains(out.String(), "order-1: business effect 2 time(s), want 1") {
		t.Errorf("the verdict does not name the double effect:\n%s", out.String())
	}
}
