package middleware

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// StackOptions configures [Stack]. The zero value selects the defaults of
// each layer, and a Timeout of 30 seconds.
type StackOptions struct {
	// Logger receives Log's records; nil discards them.
	Logger *slog.Logger
	// Log sets the levels and attributes of Log's records (see
	// [LogWith]).
	Log LogOptions
	// Keying names each message in st, for Retry and Dedup alike.
	Keying
	// MaxAttempts, Backoff and Permanent are Retry's (see
	// [RetryOptions]).
	MaxAttempts int
	Backoff     func(n int) time.Duration
	Permanent   func(error) bool
	// Lease is Dedup's (see [DedupOptions]). Default 5 minutes.
	Lease time.Duration
	// Timeout is the deadline of the handler (see [Timeout]). It must be
	// below the lease. Default 30 seconds.
	Timeout time.Duration
	// Observe is Dedup's (see [DedupOptions]).
	Observe func(ctx context.Context, e DedupEvent)
}

// defaultTimeout is StackOptions.Timeout's default.
const defaultTimeout = 30 * time.Second

// Stack returns the recommended stack over st: Log, Retry, Recover, Dedup
// and Timeout, outermost first, set by opts. The package documentation
// shows the same chain written out, for another order or for settings that
// StackOptions does not have, and says why in this order. Retry makes each
// message's key, and Dedup uses it (see [Keying]).
//
// Stack panics if st is nil, on a negative duration or MaxAttempts, and if
// the Timeout is not below the lease, so that the deadline, not a lost
// lease, ends a handler that runs too long.
func Stack(st store.Store, opts StackOptions) rabbitmw.Middleware {
	if st == nil {
		panic("middleware: Stack: nil store")
	}
	if opts.Lease < 0 {
		panic(fmt.Sprintf("middleware: Stack: negative Lease %v", opts.Lease))
	}
	if opts.Timeout < 0 {
		panic(fmt.Sprintf("middleware: Stack: negative Timeout %v", opts.Timeout))
	}
	lease := cmp.Or(opts.Lease, defaultLease)
	timeout := cmp.Or(opts.Timeout, defaultTimeout)
	if timeout >= lease {
		panic(fmt.Sprintf("middleware: Stack: Timeout %v is not below the lease %v", timeout, lease))
	}
	return rabbitmw.Chain(
		LogWith(opts.Logger, opts.Log),
		Retry(st, RetryOptions{Keying: opts.Keying, MaxAttempts: opts.MaxAttempts, Backoff: opts.Backoff, Permanent: opts.Permanent}),
		Recover(),
		Dedup(st, DedupOptions{Lease: lease, Observe: opts.Observe}),
		Timeout(timeout),
	)
}
