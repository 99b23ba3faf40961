package middleware

import (
	"cmp"
	"fmt"
	"log/slog"
	"time"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// StackOptions configures [Stack]: each layer's options, nested, so that
// every setting of every layer is reached from here. The zero value
// selects the defaults of each layer, and a Timeout of 30 seconds.
type StackOptions struct {
	// Logger receives Log's records; nil discards them.
	Logger *slog.Logger
	// Log sets the levels and attributes of Log's records (see
	// [LogWith]).
	Log LogOptions
	// Keying names each message in the store, for Retry and Dedup alike:
	// Stack puts a [Keys] layer above them.
	Keying Keying
	// Retry configures [Retry]. Its CountByHeader must be false: the
	// stack counts in its store.
	Retry RetryOptions
	// Dedup configures [Dedup]. Its Lease defaults to 5 minutes.
	Dedup DedupOptions
	// Timeout is the deadline of the handler (see [Timeout]). It must be
	// below Dedup's lease. Default 30 seconds.
	Timeout time.Duration
}

// defaultTimeout is StackOptions.Timeout's default.
const defaultTimeout = 30 * time.Second

// Stack returns the recommended stack over st: Log, Retry, Recover, Dedup
// and Timeout, outermost first, each set by its part of opts, with a
// [Keys] layer above Retry when opts.Keying is set. The package
// documentation shows the same chain written out, for another order, and
// says why in this order.
//
// Stack panics if st is nil, on the panics of the layers' constructors,
// and if the Timeout is not below Dedup's lease, so that the deadline, not
// a lost lease, ends a handler that runs too long.
func Stack(st store.Store, opts StackOptions) rabbitmw.Middleware {
	if st == nil {
		panic("middleware: Stack: nil store")
	}
	if opts.Dedup.Lease < 0 {
		panic(fmt.Sprintf("middleware: Stack: negative Dedup.Lease %v", opts.Dedup.Lease))
	}
	if opts.Timeout < 0 {
		panic(fmt.Sprintf("middleware: Stack: negative Timeout %v", opts.Timeout))
	}
	lease := cmp.Or(opts.Dedup.Lease, defaultLease)
	timeout := cmp.Or(opts.Timeout, defaultTimeout)
	if timeout >= lease {
		panic(fmt.Sprintf("middleware: Stack: Timeout %v is not below the lease %v", timeout, lease))
	}
	layers := []rabbitmw.Middleware{LogWith(opts.Logger, opts.Log)}
	if opts.Keying.Key != nil || opts.Keying.Namespace != "" {
		layers = append(layers, Keys(opts.Keying))
	}
	return rabbitmw.Chain(append(layers,
		Retry(st, opts.Retry),
		Recover(),
		Dedup(st, opts.Dedup),
		Timeout(timeout),
	)...)
}
