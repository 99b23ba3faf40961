package middleware_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/internal/errtest"
	"github.com/rabbitmw/rabbitmw/internal/text"
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
			absent: []string{"error", "error_type", "delay"},
		},
		{
			name:   "duplicate",
			result: fmt.Errorf("dedup: %w", rabbitmw.ErrDuplicate),
			want:   map[string]any{"level": "INFO", "outcome": "duplicate", "reason": "dedup: rabbitmw: duplicate delivery"},
			absent: []string{"error", "error_type"}, // an alert on error= must not fire on a success
		},
		{
			name:   "requeued",
			result: errBoom,
			want:   map[string]any{"level": "WARN", "outcome": "requeued", "error": "boom", "error_type": "error"},
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
			want:   map[string]any{"level": "ERROR", "outcome": "dead-lettered", "attempt": 5.0, "error_type": "error"},
		},
		{
			name:   "recovered panic carries its stack",
			result: &rabbitmw.PanicError{Value: "x", Stack: []byte("goroutine 1 [running]")},
			want:   map[string]any{"level": "WARN", "outcome": "requeued", "error": "panic: x", "error_type": "panic", "stack": "goroutine 1 [running]"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			l := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
			h := middleware.Log(l)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return tt.result }))
			d, _ := deliverytest.New("m1", "")
			d.RoutingKey = "orders"
			if tt.header != nil {
				d.Headers = amqp.Table{rabbitmw.HeaderAttempts: tt.header}
			}
			require.Equal(t, tt.result, h.Handle(context.Background(), d), "Log changed the result")
			rec := decodeOne(t, &buf)
			for k, v := range tt.want {
				assert.Equal(t, v, rec[k], "record[%q] (record %v)", k, rec)
			}
			for _, k := range tt.absent {
				assert.NotContains(t, rec, k)
			}
			assert.Contains(t, rec, "duration")
		})
	}
}

func decodeOne(t *testing.T, buf *bytes.Buffer) map[string]any {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	require.Len(t, lines, 1, "records:\n%s", buf.String())
	var rec map[string]any
	require.NoError(t, json.Unmarshal([]byte(lines[0]), &rec))
	return rec
}

func TestLogPanicIsRecordedAndGoesOn(t *testing.T) {
	var buf bytes.Buffer
	h := middleware.Log(slog.New(slog.NewJSONHandler(&buf, nil)))(panickyHandler("kaboom"))
	d, _ := deliverytest.New("m1", "")
	assert.PanicsWithValue(t, "kaboom", func() { h.Handle(context.Background(), d) }, "Log swallowed the panic")
	rec := decodeOne(t, &buf)
	assert.Equal(t, "panicked", rec["outcome"])
	assert.Equal(t, "ERROR", rec["level"])
}

// Log directly above a handler whose error panics when asked for its text
// (a nil pointer, the typed nil of "var err *T; return err", or an Error
// method that panics on any value) logs the failed attempt, naming the
// error's type, and returns the error unchanged for settlement to read as
// Decide does: it must not panic, where no Recover catches it.
func TestLogErrorWhoseTextPanics(t *testing.T) {
	for _, c := range errtest.Cases() {
		t.Run(c.Type, func(t *testing.T) {
			var buf bytes.Buffer
			h := middleware.Log(slog.New(slog.NewJSONHandler(&buf, nil)))(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return c.Err }))
			d, _ := deliverytest.New("m1", "")
			var err error
			require.NotPanics(t, func() { err = h.Handle(context.Background(), d) })
			assert.Equal(t, c.Err, err, "Log changed the result")
			rec := decodeOne(t, &buf)
			assert.Equal(t, "requeued", rec["outcome"])
			assert.Equal(t, "WARN", rec["level"])
			assert.Equal(t, c.Text, rec["error"])
			assert.Equal(t, c.Type, rec["error_type"])
		})
	}
}

// An error of a megabyte (one that wraps a response body, say) makes no
// record of that size: its text is cut to text.MaxError bytes, as the
// fault headers cut it, keeping its beginning and marking the cut.
func TestLogCapsTheErrorText(t *testing.T) {
	huge := "GET /orders/17: 502: " + strings.Repeat("<html>", 1<<20/6)
	for _, c := range []struct {
		result error
		key    string
	}{
		{errors.New(huge), "error"},
		{fmt.Errorf("%s: %w", huge, rabbitmw.ErrDuplicate), "reason"},
	} {
		t.Run(c.key, func(t *testing.T) {
			var buf bytes.Buffer
			h := middleware.Log(slog.New(slog.NewJSONHandler(&buf, nil)))(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return c.result }))
			d, _ := deliverytest.New("m1", "")
			require.Equal(t, c.result, h.Handle(context.Background(), d), "Log changed the result")
			got, _ := decodeOne(t, &buf)[c.key].(string)
			assert.LessOrEqual(t, len(got), text.MaxError, "bytes of %s", c.key)
			assert.True(t, strings.HasSuffix(got, "…"), "%s not marked as cut", c.key)
			assert.True(t, strings.HasPrefix(huge, strings.TrimSuffix(got, "…")), "%s is not the beginning of the error's text", c.key)
			assert.Greater(t, len(got), text.MaxError/2, "bytes of %s", c.key)
		})
	}
}

func TestLogRespectsLevel(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	h := middleware.Log(l)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }))
	d, _ := deliverytest.New("m1", "")
	h.Handle(context.Background(), d)
	assert.Zero(t, buf.Len(), "an acked delivery was logged at level Warn: %s", buf.String())
}

type plainHandler struct{}

func (plainHandler) Handle(context.Context, *amqp.Delivery) error { return nil }

func TestLogNilDiscards(t *testing.T) {
	var h rabbitmw.Handler = plainHandler{}
	if got := middleware.Log(nil)(h); got != h {
		t.Errorf("Log(nil) wrapped the handler in %T; want it returned unchanged", got)
	}
}

// tenant is an AppendAttrs that adds the tenant header of a delivery, and
// counts its calls.
func tenant(calls *int) func([]slog.Attr, *amqp.Delivery) []slog.Attr {
	return func(attrs []slog.Attr, d *amqp.Delivery) []slog.Attr {
		*calls++
		t, _ := d.Headers["tenant"].(string)
		return append(attrs, slog.String("tenant", t))
	}
}

func TestLogWith(t *testing.T) {
	dup := fmt.Errorf("dedup: %w", rabbitmw.ErrDuplicate)
	quiet := middleware.LogOptions{AckLevel: slog.LevelDebug, DuplicateLevel: slog.LevelDebug}
	tests := []struct {
		name      string
		opts      middleware.LogOptions
		level     slog.Level // the handler's
		result    error
		wantLevel string // "" for no record
	}{
		{"duplicate at Debug", middleware.LogOptions{DuplicateLevel: slog.LevelDebug}, slog.LevelDebug, dup, "DEBUG"},
		{"duplicate at Debug, not written at Info", middleware.LogOptions{DuplicateLevel: slog.LevelDebug}, slog.LevelInfo, dup, ""},
		{"acked stays at Info", middleware.LogOptions{DuplicateLevel: slog.LevelDebug}, slog.LevelDebug, nil, "INFO"},
		{"acked at Debug", quiet, slog.LevelDebug, nil, "DEBUG"},
		{"requeued stays at Warn", quiet, slog.LevelDebug, errBoom, "WARN"},
		{"delayed stays at Warn", quiet, slog.LevelDebug, rabbitmw.RetryAfter(errBoom, time.Second), "WARN"},
		{"dead-lettered stays at Error", quiet, slog.LevelDebug, rabbitmw.Permanent(errBoom), "ERROR"},
		{"a level above Error", middleware.LogOptions{DuplicateLevel: slog.LevelError + 4}, slog.LevelError + 4, dup, "ERROR+4"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			l := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: tt.level}))
			calls := 0
			opts := tt.opts
			opts.AppendAttrs = tenant(&calls)
			h := middleware.LogWith(l, opts)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return tt.result }))
			d, _ := deliverytest.New("m1", "")
			d.Headers = amqp.Table{"tenant": "acme"}
			require.Equal(t, tt.result, h.Handle(context.Background(), d), "LogWith changed the result")
			if tt.wantLevel == "" {
				assert.Zero(t, buf.Len(), "wrote %q; want no record", buf.String())
				assert.Zero(t, calls, "AppendAttrs calls")
				return
			}
			rec := decodeOne(t, &buf)
			assert.Equal(t, tt.wantLevel, rec["level"])
			assert.Equal(t, "acme", rec["tenant"])
			assert.Equal(t, "m1", rec["message_id"])
			assert.Equal(t, 1, calls, "AppendAttrs calls")
		})
	}
}

// The attributes a user adds come after the layer's own, in order.
func TestLogWithAttrsOrder(t *testing.T) {
	var buf bytes.Buffer
	l := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey || a.Key == "duration" {
				return slog.Attr{}
			}
			return a
		},
	}))
	many := func(attrs []slog.Attr, d *amqp.Delivery) []slog.Attr {
		for i := range 12 { // beyond any room the layer keeps
			attrs = append(attrs, slog.Int(fmt.Sprint("a", i), i))
		}
		return attrs
	}
	h := middleware.LogWith(l, middleware.LogOptions{AppendAttrs: many})(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return errBoom }))
	h.Handle(context.Background(), &amqp.Delivery{MessageId: "m1", DeliveryTag: 2})
	want := "level=WARN msg=delivery message_id=m1 delivery_tag=2 routing_key=\"\" redelivered=false attempt=1 outcome=requeued error=boom error_type=error" +
		" a0=0 a1=1 a2=2 a3=3 a4=4 a5=5 a6=6 a7=7 a8=8 a9=9 a10=10 a11=11\n"
	assert.Equal(t, want, buf.String())
}

func TestLogWithNilDiscards(t *testing.T) {
	var h rabbitmw.Handler = plainHandler{}
	if got := middleware.LogWith(nil, middleware.LogOptions{DuplicateLevel: slog.LevelDebug})(h); got != h {
		t.Errorf("LogWith(nil, …) wrapped the handler in %T; want it returned unchanged", got)
	}
}
