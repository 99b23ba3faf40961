package middleware_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
)

func TestLog(t *testing.T) {
	tests := []struct {
		name   string
		result error
		header any
		want   map[string]any // attributes that must be present, with values
		absent []string       // attributes that must not be present
	}{
		{
			name:   "acked",
			want:   map[string]any{"level": "INFO", "msg": "delivery", "outcome": "acked", "attempt": 1.0, "message_id": "m1", "delivery_tag": 1.0, "redelivered": false, "routing_key": "orders"},
			absent: []string{"error", "delay"},
		},
		{
			name:   "duplicate",
			result: fmt.Errorf("dedup: %w", rabbitmw.ErrDuplicate),
			want:   map[string]any{"level": "INFO", "outcome": "duplicate", "error": "dedup: rabbitmw: duplicate delivery"},
		},
		{
			name:   "requeued",
			result: errBoom,
			want:   map[string]any{"level": "WARN", "outcome": "requeued", "error": "boom"},
		},
		{
			name:   "delayed, with the attempt a layer counted",
			result: rabbitmw.RetryAfter(rabbitmw.WithAttempts(errBoom, 3), 2*time.Second),
			want:   map[string]any{"level": "WARN", "outcome": "delayed", "attempt": 3.0, "delay": float64(2 * time.Second)},
		},
		{
			name:   "dead-lettered",
			result: rabbitmw.Permanent(errBoom),
			header: int32(4),
			want:   map[string]any{"level": "ERROR", "outcome": "dead-lettered", "attempt": 5.0},
		},
		{
			name:   "recovered panic carries its stack",
			result: &rabbitmw.PanicError{Value: "x", Stack: []byte("goroutine 1 [running]")},
			want:   map[string]any{"level": "WARN", "outcome": "requeued", "error": "panic: x", "stack": "goroutine 1 [running]"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			l := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
			h := middleware.Log(l)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return tt.result }))
			d, _ := deliver("m1", "")
			d.RoutingKey = "orders"
			if tt.header != nil {
				d.Headers = amqp.Table{rabbitmw.HeaderAttempts: tt.header}
			}
			if err := h.Handle(context.Background(), d); err != tt.result {
				t.Fatalf("Log changed the result: %v; want %v", err, tt.result)
			}
			rec := decodeOne(t, &buf)
			for k, v := range tt.want {
				if rec[k] != v {
					t.Errorf("record[%q] = %v; want %v (record %v)", k, rec[k], v, rec)
				}
			}
			for _, k := range tt.absent {
				if _, ok := rec[k]; ok {
					t.Errorf("record has %q; want it absent", k)
				}
			}
			if _, ok := rec["duration"]; !ok {
				t.Errorf("record has no duration")
			}
		})
	}
}

func decodeOne(t *testing.T, buf *bytes.Buffer) map[string]any {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 1 {
		t.Fatalf("got %d records; want 1:\n%s", len(lines), buf.String())
	}
	var rec map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &rec); err != nil {
		t.Fatal(err)
	}
	return rec
}

func TestLogPanicIsRecordedAndGoesOn(t *testing.T) {
	var buf bytes.Buffer
	h := middleware.Log(slog.New(slog.NewJSONHandler(&buf, nil)))(panickyHandler("kaboom"))
	d, _ := deliver("m1", "")
	func() {
		defer func() {
			if recover() != "kaboom" {
				t.Error("Log swallowed the panic")
			}
		}()
		h.Handle(context.Background(), d)
	}()
	if rec := decodeOne(t, &buf); rec["outcome"] != "panicked" || rec["level"] != "ERROR" {
		t.Errorf("record = %v; want outcome panicked at ERROR", rec)
	}
}

func TestLogRespectsLevel(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	h := middleware.Log(l)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }))
	d, _ := deliver("m1", "")
	h.Handle(context.Background(), d)
	if buf.Len() != 0 {
		t.Errorf("an acked delivery was logged at level Warn: %s", buf.String())
	}
}

type plainHandler struct{}

func (plainHandler) Handle(context.Context, *amqp.Delivery) error { return nil }

func TestLogNilDiscards(t *testing.T) {
	var h rabbitmw.Handler = plainHandler{}
	if got := middleware.Log(nil)(h); got != h {
		t.Errorf("Log(nil) wrapped the handler in %T; want it returned unchanged", got)
	}
}
