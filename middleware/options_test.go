package middleware_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// Every constructor panics on a programmer error, with a message that
// names the package, the constructor and the setting.
func TestConstructorPanics(t *testing.T) {
	st := store.NewMemory()
	for _, tt := range []struct {
		name string
		f    func()
		want string
	}{
		{"Retry nil store", func() { middleware.Retry(nil, middleware.RetryOptions{}) },
			"middleware: Retry: nil store (set RetryOptions.CountByHeader to count by the attempts header alone)"},
		{"Retry CountByHeader with a store", func() { middleware.Retry(st, middleware.RetryOptions{CountByHeader: true}) },
			"middleware: Retry: RetryOptions.CountByHeader with a store"},
		{"Retry CountByHeader with a TTL", func() { middleware.Retry(nil, middleware.RetryOptions{CountByHeader: true, TTL: time.Hour}) },
			"middleware: Retry: RetryOptions.CountByHeader with a TTL, which only a store uses"},
		{"Retry negative MaxAttempts", func() { middleware.Retry(st, middleware.RetryOptions{MaxAttempts: -1}) },
			"middleware: Retry: negative MaxAttempts -1"},
		{"Retry negative TTL", func() { middleware.Retry(st, middleware.RetryOptions{TTL: -time.Second}) },
			"middleware: Retry: negative TTL -1s"},
		{"Dedup nil store", func() { middleware.Dedup(nil, middleware.DedupOptions{}) },
			"middleware: Dedup: nil store"},
		{"Dedup negative Lease", func() { middleware.Dedup(st, middleware.DedupOptions{Lease: -time.Second}) },
			"middleware: Dedup: negative Lease -1s"},
		{"Dedup negative Retention", func() { middleware.Dedup(st, middleware.DedupOptions{Retention: -time.Hour}) },
			"middleware: Dedup: negative Retention -1h0m0s"},
		{"Dedup negative BusyDelay", func() { middleware.Dedup(st, middleware.DedupOptions{BusyDelay: -time.Millisecond}) },
			"middleware: Dedup: negative BusyDelay -1ms"},
		{"Dedup negative UnavailableDelay", func() { middleware.Dedup(st, middleware.DedupOptions{UnavailableDelay: -2 * time.Second}) },
			"middleware: Dedup: negative UnavailableDelay -2s"},
		{"Timeout zero", func() { middleware.Timeout(0) },
			"middleware: Timeout: non-positive duration 0s"},
		{"Timeout negative", func() { middleware.Timeout(-time.Second) },
			"middleware: Timeout: non-positive duration -1s"},
		{"Stack nil store", func() { middleware.Stack(nil, middleware.StackOptions{}) },
			"middleware: Stack: nil store"},
		{"Stack negative Lease", func() {
			middleware.Stack(st, middleware.StackOptions{Dedup: middleware.DedupOptions{Lease: -time.Minute}})
		},
			"middleware: Stack: negative Dedup.Lease -1m0s"},
		{"Stack negative Timeout", func() { middleware.Stack(st, middleware.StackOptions{Timeout: -time.Minute}) },
			"middleware: Stack: negative Timeout -1m0s"},
		{"Stack Timeout above the default lease", func() { middleware.Stack(st, middleware.StackOptions{Timeout: 6 * time.Minute}) },
			"middleware: Stack: Timeout 6m0s is not below the lease 5m0s"},
		{"Stack Timeout equal to the lease", func() {
			middleware.Stack(st, middleware.StackOptions{Dedup: middleware.DedupOptions{Lease: time.Minute}, Timeout: time.Minute})
		},
			"middleware: Stack: Timeout 1m0s is not below the lease 1m0s"},
		{"Stack default Timeout above the Lease", func() {
			middleware.Stack(st, middleware.StackOptions{Dedup: middleware.DedupOptions{Lease: 10 * time.Second}})
		},
			"middleware: Stack: Timeout 30s is not below the lease 10s"},
		{"Stack negative MaxAttempts", func() { middleware.Stack(st, middleware.StackOptions{Retry: middleware.RetryOptions{MaxAttempts: -3}}) },
			"middleware: Retry: negative MaxAttempts -3"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			assert.PanicsWithValue(t, tt.want, tt.f)
		})
	}
}
