// Package middleware provides the layers of a safe RabbitMQ consumer: Dedup
// (each message's effect at most once), Retry (count failures across
// redeliveries, back off, dead-letter at the limit), Recover (a panic is a
// failed attempt), Log (one slog record per delivery) and Timeout (a
// deadline on the handler). Each is a [rabbitmw.Middleware]; [Stack]
// composes them in the recommended order.
//
// # Order
//
// [Stack] builds the recommended stack:
//
//	h := middleware.Stack(st, middleware.StackOptions{Logger: logger})(handler)
//
// It is, written out with [rabbitmw.Chain], outermost first (write it so
// for layers of your own in between, or settings that [StackOptions] does
// not have):
//
//	h := rabbitmw.Chain(
//		middleware.Log(logger),
//		middleware.Retry(st, middleware.RetryOptions{}),
//		middleware.Recover(),
//		middleware.Dedup(st, middleware.DedupOptions{}),
//		middleware.Timeout(30*time.Second),
//	)(handler)
//
// and why:
//
//   - Log is outermost, so it records the final word on each delivery,
//     after Retry has turned a failure into a delay or a dead-letter, and
//     times everything beneath.
//   - Retry is above Recover, so a panic reaches it as an error and counts
//     as a failed attempt; a message that always panics is dead-lettered
//     after MaxAttempts instead of crashing the consumer or cycling.
//   - Recover is above Dedup, so a panic in the handler passes through
//     Dedup first, which releases its claim on the way, and a panic in
//     Dedup or its store is caught too.
//   - Dedup is beneath Retry, so a duplicate or a busy key never counts as
//     an attempt, and an abandoned attempt (a consumer's death) does; it
//     wraps the handler closely, so the claim covers the business effect
//     and nothing else. The other way round, Retry never sees
//     ErrAbandoned, and a message that kills its consumer cycles for ever:
//     Dedup panics on a Retry it can see beneath it.
//   - Timeout is innermost, so its deadline bounds the business handler
//     and never cuts short Dedup's store calls that record the result. It
//     is below Dedup's lease (Stack panics otherwise), so the deadline,
//     not a lost lease, ends a handler that runs too long.
//
// Use one store for Dedup and Retry, and set a [Keying], if any, once, in a
// [Keys] layer above them (StackOptions.Keying): both read it.
//
// # What each layer returns
//
// Layers communicate only through the error they return, read by
// [rabbitmw.Decide]; none of them acknowledges anything. Dedup returns
// errors wrapping rabbitmw.ErrDuplicate (acknowledge), ErrBusy,
// ErrStoreUnavailable or ErrLeaseLost (each inside a rabbitmw.RetryAfter,
// and marked rabbitmw.NotCounted: Retry does not count them as failures),
// or ErrAbandoned (the attempt
// before never finished: its consumer died; Retry counts it). Retry returns
// rabbitmw.RetryAfter or rabbitmw.Permanent, with the attempt count
// attached. Keys returns ErrKeyMismatch, inside rabbitmw.Permanent, when
// it stands beneath a Retry or Dedup that named the message otherwise.
// Recover returns *rabbitmw.PanicError. Timeout wraps ErrTimeout.
//
// # Goroutines
//
// Each goroutine this package starts ends with the work that started it,
// never only with the consumer's context:
//
//   - Dedup renews a claim whose renewal falls due while its handler runs
//     (every Lease/3) on a goroutine of its own, which ends when the store
//     answers (within one renewal interval for a store that honours its
//     context's deadline) and DedupOptions.Observe, if it reports the
//     renewal, has returned; Dedup waits for that call, not for the store.
//   - Dedup and Timeout watch the consumer's context (the ctx given to
//     Handle), so that the contexts they give their handlers end with it.
//     A context of the standard library, one that passes on the Done and
//     Value of one (a type that embeds it), or one with an AfterFunc
//     method, costs no goroutine to watch. Any other (a type whose Done
//     channel the context package does not know) is watched by
//     context.AfterFunc on a goroutine: Dedup shares one among the
//     deliveries under way under that consumer's context, and it ends when
//     the last of them has returned, or when the consumer's context ends,
//     to start again with the next delivery; a Timeout layer's context
//     (and Dedup's, under more than 8 such consumers' contexts at once)
//     has one of its own, which ends with its delivery.
//   - A callback that context.AfterFunc registers on a handler's context
//     runs on a goroutine of its own once the context ends, as it does on
//     the standard library's.
//
// The timers that serve leases and deadlines run their callbacks on the
// runtime's goroutines, and only briefly.
//
// # Guarantees, and where they end
//
// With Dedup over a shared store, a message's handler completes
// successfully at most once per Retention (24 hours by default) across all
// consumers, unless one of these happens, each documented on Dedup: the
// process dies after the handler's effect and before the done mark is
// written (the message is redelivered and, once the lease expires,
// processed again); a handler outlives its lease while ignoring its
// cancelled context; the store loses its data (Redis without persistence,
// restarted); or the store stays unreachable, after the handler succeeded,
// for longer than the lease. The first of these is inherent in any consumer
// whose effect and bookkeeping are not one transaction; make effects
// idempotent where a repeat would be costly. A consumer that stops, and
// cancels its handlers' context at its shutdown deadline, is none of
// these: once a handler has returned, the store calls that record its
// attempt run under a context that the cancellation does not end.
//
// With Retry, a failing message is never acknowledged: it is delayed, then
// dead-lettered with its reason. An attempt whose consumer died (or lost
// the store until its lease ended) counts as a failed attempt, so a message
// that kills its consumer is dead-lettered too, after MaxAttempts deaths;
// a death is counted when the next delivery finds the lease ended, within
// the store's abandoned retention (store.Memory, redisstore.Store). Nothing in
// this package drops a message.
package middleware
