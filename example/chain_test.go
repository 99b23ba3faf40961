package main

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// The chain A → outbox → relay → B holds its verdict, on the in-memory
// broker and on RabbitMQ.
func TestChain(t *testing.T) {
	for name, amqpURL := range map[string]func(*testing.T) string{
		"embedded": func(*testing.T) string { return "" },
		"rabbitmq": func(t *testing.T) string { return testenv.RabbitMQURL(t) },
	} {
		t.Run(name, func(t *testing.T) {
			cfg := config{amqpURL: amqpURL(t), postgresURL: testenv.PostgresURL(t), timeout: time.Minute, logger: slog.New(slog.DiscardHandler)}
			rep, err := runChain(context.Background(), cfg)
			require.NoError(t, err)
			var out bytes.Buffer
			rep.print(&out)
			t.Log("\n" + out.String())
			assert.True(t, rep.ok())
			assert.Contains(t, out.String(), "OK: each order took effect once")
			assert.Equal(t, chainOrders+chainDuplicate, rep.deliveries-1, "each order once, the copies, and the failed attempt")
		})
	}
}

// A broken guarantee turns the chain's verdict: a second shipment effect,
// or the rolled-back message delivered.
func TestChainVerdict(t *testing.T) {
	good := func() *chainReport {
		r := &chainReport{aEffects: map[string]int{}, bEffects: map[string]int{}, rolledBack: "x", stats: pgstore.OutboxStats{Sent: chainOrders}}
		for i := 1; i <= chainOrders; i++ {
			o := fmt.Sprintf("order-%d", i)
			r.aEffects[o], r.bEffects[o] = 1, 1
		}
		return r
	}
	require.True(t, good().ok())
	twice := good()
	twice.bEffects["order-2"] = 2
	assert.False(t, twice.ok())
	leaked := good()
	leaked.rolledBackDelivered = true
	assert.False(t, leaked.ok())
	stuck := good()
	stuck.stats.Parked = 1
	assert.False(t, stuck.ok())
}
