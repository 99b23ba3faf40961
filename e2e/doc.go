// Package e2e holds the module's whole-stack tests, and no code: the
// recommended stack (Retry, Recover, Dedup, Timeout) with the broker and
// the stores together, as a user runs them.
//
//   - stack_test.go: the stack delivery by delivery, as on a plain
//     amqp091 channel, over miniredis: duplicates, retries, panics, lost
//     leases, store outages, bad input, a fleet of hand-written consumers
//     on the same Redis;
//   - death_test.go: a message that kills its consumer process is
//     dead-lettered after MaxAttempts;
//   - e2e_test.go: thousands of messages through broker.Consume on
//     RabbitMQ and Redis, and on the in-memory broker with miniredis, with
//     the connections closed mid-stream: each effect exactly once;
//   - migration_test.go: hand-written consumers and rabbitmw consumers
//     sharing one queue and one Redis, on real servers;
//   - bench_test.go: BenchmarkChain, the whole stack per delivery.
//
// They live apart from package rabbitmw so that `go test .` there runs the
// core's own tests in a few seconds; `go test ./...` runs these too. The
// tests that need RabbitMQ or Redis skip without them, and fail under
// CI=true.
package e2e
