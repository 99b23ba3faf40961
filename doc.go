// Package rabbitmw makes RabbitMQ consumers safe to run in production, when
// a message processed twice would mean a double charge or a second
// shipment.
//
// RabbitMQ delivers at least once: a consumer that crashes, times out or
// nacks gets the message again, and producers resend. This package composes
// consumers from layers, in the style of net/http: a [Handler] processes a
// delivery and returns an error; a [Middleware] wraps a Handler in another;
// [Chain] composes them. Package middleware provides the layers (Dedup,
// Retry, Recover, Log, Timeout), package store the idempotency state they
// share (Redis, in memory, or yours, checked with package storetest), and
// package broker runs a chain against RabbitMQ, with reconnects, delayed
// retries, a dead-letter queue and graceful shutdown.
//
// # Settlement
//
// A handler's result decides what happens to its message: acknowledged,
// requeued, delayed or dead-lettered. The contract is documented once, on
// [Handler], and implemented once, in [Decide].
//
// Layers never acknowledge anything: the code that owns the channel
// settles each delivery once, from the result. The broker package does
// it with delay queues and a dead-letter queue of its own; a [Settler]
// does it on a plain amqp091 channel.
//
// # The recommended stack
//
//	h := middleware.Stack(st, middleware.StackOptions{Logger: logger})(business)
//
// is Log, Retry, Recover, Dedup and Timeout, outermost first, over one
// store. The order matters; package middleware explains why, layer by
// layer, and shows the same chain written out with [Chain].
//
// # Guarantees
//
// With the recommended stack over a shared store, for each message key:
// its handler succeeds at most once (across consumers, redeliveries and
// producer resends, within Dedup's retention); a failing message is
// retried with growing delays and then dead-lettered with its reason,
// never acknowledged and lost; a panic is a failed attempt, and so is an
// attempt whose consumer died while handling it; an unreachable store
// delays messages instead of letting them through twice.
// Where these end is documented on the layers: chiefly, a process that
// dies between the business effect and the done mark leaves a message that
// is processed again once its lease expires, so an effect that must never
// repeat should itself be idempotent (an upsert, a unique constraint, an
// idempotency key passed on to the payment provider).
package rabbitmw
