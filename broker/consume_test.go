package broker

import (
	"context"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
)

func TestOptionsDefaults(t *testing.T) {
	c := Options{}.resolve()
	assert.Equal(t, defaultReconnectMin, c.rmin, "ReconnectMin")
	assert.Equal(t, defaultReconnectMax, c.rmax, "ReconnectMax")
	assert.Equal(t, defaultHeartbeat, c.heartbeat, "Heartbeat")
	if c.log == nil || c.log.Handler().Enabled(context.Background(), slog.LevelError) {
		t.Error("default logger is not a discarding one")
	}
	if !regexp.MustCompile(`^.+\[\d+\]$`).MatchString(c.process) {
		t.Errorf("default Process = %q; want name[pid]", c.process)
	}
	assert.Equal(t, 10*time.Millisecond, Options{ReconnectMax: 10 * time.Millisecond}.resolve().rmin, "ReconnectMin below a small ReconnectMax")
	opts := Options{}
	New("amqp://localhost/", opts)
	assert.Equal(t, Options{}, opts, "caller's Options after New")
	for _, bad := range []Options{{ReconnectMin: -1}, {ReconnectMin: time.Second, ReconnectMax: time.Millisecond}, {Heartbeat: -time.Second}} {
		func() {
			defer func() {
				if r := recover(); r == nil || !strings.HasPrefix(fmt.Sprint(r), "broker: ") {
					t.Errorf("New(%+v) panicked with %v; want a broker: panic", bad, r)
				}
			}()
			New("amqp://localhost/", bad)
		}()
	}
}

func TestConsumeBadOptions(t *testing.T) {
	m := brokertest.NewServer()
	defer m.Close()
	b := New(m.URL(), Options{})
	h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	ctx := testContext(t, 5*time.Second)
	for _, o := range []ConsumeOptions{{Workers: -1}, {Prefetch: 70000}, {ShutdownTimeout: -1}, {Topology: Topology{Delays: []time.Duration{-1}}}, {Topology: Topology{Quorum: true, Declare: DeclareSupport}}} {
		assert.Error(t, b.Consume(ctx, "q", h, o), "Consume(%+v) = nil; want an error", o)
	}
	assert.Error(t, b.Consume(ctx, "", h, ConsumeOptions{}), "Consume of an empty queue name = nil; want an error")
	defer func() {
		if r := recover(); r == nil {
			t.Error("Consume with a nil handler did not panic")
		}
	}()
	_ = b.Consume(ctx, "q", nil, ConsumeOptions{})
}

func TestMalformedURL(t *testing.T) {
	b := New("http://a b/", Options{})
	defer b.Close()
	err := b.Consume(testContext(t, 5*time.Second), "q", rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }), ConsumeOptions{})
	if err == nil || !strings.Contains(err.Error(), "malformed AMQP URL") {
		t.Errorf("Consume on a malformed URL = %v; want a malformed URL error", err)
	}
}
