package redisstore

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
)

// Logging returns a logger for go-redis that writes its lines to l, at
// level Warn, with the attribute component=go-redis; a nil l discards
// them. go-redis prints its own lines (a pool that fails to dial, a
// connection it drops) to the standard error, past the application's
// logger; pass it the result once at start-up:
//
//	redis.SetLogger(redisstore.Logging(logger))
//
// go-redis holds one logger for the whole process, which is why
// redisstore does not set it itself.
func Logging(l *slog.Logger) interface {
	Printf(ctx context.Context, format string, v ...any)
} {
	if l == nil {
		l = slog.New(slog.DiscardHandler)
	}
	return printer{l}
}

type printer struct{ l *slog.Logger }

func (p printer) Printf(ctx context.Context, format string, v ...any) {
	if ctx == nil {
		ctx = context.Background()
	}
	if !p.l.Enabled(ctx, slog.LevelWarn) {
		return
	}
	msg := strings.TrimSpace(strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: "))
	p.l.LogAttrs(ctx, slog.LevelWarn, msg, slog.String("component", "go-redis"))
}
