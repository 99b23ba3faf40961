package redisstore_test

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/logging"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// go-redis's own line about a server it cannot dial reaches the slog
// logger, as a warning, and nothing else.
func TestLogging(t *testing.T) {
	var buf bytes.Buffer
	redis.SetLogger(redisstore.Logging(slog.New(slog.NewTextHandler(&buf, nil))))
	t.Cleanup(logging.Enable)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	ln.Close() // nothing answers there now
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.Error(t, c.Ping(ctx).Err())

	out := buf.String()
	assert.Contains(t, out, "level=WARN")
	assert.Contains(t, out, `msg="connection pool: failed to dial`)
	assert.Contains(t, out, "component=go-redis")
}

// A nil logger discards go-redis's lines.
func TestLoggingNil(t *testing.T) {
	assert.NotPanics(t, func() { redisstore.Logging(nil).Printf(context.Background(), "redis: %s", "x") })
}
