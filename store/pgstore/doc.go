// Package pgstore is a [store.Store] in PostgreSQL, and a transactional
// inbox on it: a handler whose business effect and done mark commit in one
// transaction, so that a consumer that dies at any moment leaves either
// both or neither, and no effect in the database is ever applied twice.
//
// [Store] holds the claims, done marks and failure counters of message
// keys in two tables ([Schema] gives their SQL; [Store.Migrate] creates
// them). Used on its own, it is a drop-in for the Redis store: the
// recommended stack runs over it unchanged, with the guarantees of a
// shared store (a consumer that dies after its effect and before the done
// mark applies the effect again).
//
// # The inbox
//
// [Handler] closes that gap for effects that are rows in the same
// database. It runs as the business handler beneath middleware.Dedup, and
// both use the same Store:
//
//	st := pgstore.New(pool, pgstore.Options{})
//	defer st.Close()
//	if err := st.Migrate(ctx); err != nil { // or st.Check, if you migrate yourself
//		return err
//	}
//	h := middleware.Stack(st, middleware.StackOptions{Logger: logger})(pgstore.Handler(st, func(ctx context.Context, tx pgx.Tx, d *amqp091.Delivery) error {
//		_, err := tx.Exec(ctx, `INSERT INTO charges (order_id, amount) VALUES ($1, $2)`, …)
//		return err
//	}, pgstore.HandlerOptions{}))
//
// How the two cooperate: Dedup claims the key (a row, with the claim's
// token and lease) and renews the lease while the handler runs, as over
// any store; it passes the claim to the handler in the context
// (middleware.ClaimFrom). Handler begins a transaction, runs the function,
// and writes the done mark as the transaction's last statement: an UPDATE
// of the claim's row that matches only while the claim's token owns it.
// Then it commits, and tells Dedup (middleware.Claim.MarkedDone) that the
// mark is written, so Dedup does not write a second one. Hence:
//
//   - a crash before the commit leaves neither effect nor mark: once the
//     lease ends, the claim is abandoned; the redelivery that finds it
//     counts a failed attempt, and the next one processes the message;
//   - a crash after it leaves both: the redelivery is a duplicate;
//   - a claim that was lost (its lease ended, and perhaps another consumer
//     took the message) matches no row: the transaction is rolled back. Of two
//     consumers running the same message, only the owner's commits. The
//     row lock that the UPDATE takes also orders the commit against a
//     takeover: a claim of the row waits for the commit, then finds it
//     done;
//   - a commit whose answer was lost is not counted as a failure and not
//     marked by Dedup; the redelivery finds the key done if the commit took
//     effect, and runs the function again if it did not;
//   - renewals never wait for the transaction: it locks the claim's row
//     only from the done mark to the commit, and renewals run on
//     connections of their own, so they are not starved by handlers that
//     hold every connection of the pool in a transaction.
//
// [SQLHandler] is the same on database/sql, through pgx's stdlib driver,
// for code written against *sql.Tx (sqlc, sqlx, GORM).
//
// # Where the guarantee ends
//
// Only what the function writes in tx is once. An effect outside the
// database, an HTTP call to a payment provider or a message published to
// RabbitMQ, happens before the commit and is repeated when the transaction
// does not commit (a crash, a lost claim, a failure after it): it is at
// least once, as with any store. Give such a call an idempotency key of its
// own (the message's key is a good one), or, for a message, write it into
// the outbox in tx (below).
//
// # The outbox
//
// [Outbox] is the other half: a table of messages written in the caller's
// transaction ([Outbox.Write], [Outbox.WriteSQL]), in Handler's or in any
// other code's, and sent to RabbitMQ after the commit, with confirms, by
// the relay of package github.com/rabbitmw/rabbitmw/store/pgstore/relay:
//
//	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{})
//	h := pgstore.Handler(st, func(ctx context.Context, tx pgx.Tx, d *amqp091.Delivery) error {
//		if _, err := tx.Exec(ctx, `UPDATE orders SET paid = true WHERE id = $1`, …); err != nil {
//			return err
//		}
//		_, err := ob.Write(ctx, tx, "", "shipments", amqp091.Publishing{Body: …})
//		return err
//	}, pgstore.HandlerOptions{})
//
// The effect, the done mark and the message then commit together, or none
// of them. The message is sent at least once, always with the MessageId it
// got when it was written, so that a receiving service's Dedup (an inbox,
// over its own database) makes its effect once: each effect once, from one
// service to the next.
package pgstore
