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
// How the two cooperate. A message that was never delivered before is
// claimed in the transaction of its effect: Dedup finds that Handler can
// (middleware.ClaimingHandler) and lets it. Handler inserts the key's row
// as a done mark, with the BEGIN, in one round trip; runs the function;
// and commits. One transaction writes the row, once, and the effect (twice
// if the function ran for longer than a second, or a hundredth of Dedup's
// Retention: the mark is written again before the commit, so that its
// retention starts at the success, as on the other path). If
// the key has a row already (done, claimed, abandoned, or left by an
// earlier copy of the message), Handler rolls back and Dedup claims as
// over any store. So does a message that was delivered before
// (Redelivered): its earlier attempt may have died with its consumer,
// and only a claim committed before the function runs leaves a trace of
// such a death.
//
// Under Dedup's claim, Dedup claims the key (a row, with the claim's
// token and lease) and renews the lease while the handler runs; it passes
// the claim to the handler in the context (middleware.ClaimFrom). Handler
// begins a transaction, runs the function, and writes the done mark as
// the transaction's last statement: an UPDATE of the claim's row that
// matches only while the claim's token owns it. Then it commits, and
// tells Dedup (middleware.Claim.MarkedDone) that the mark is written, so
// Dedup does not write a second one. Hence, on either path:
//
//   - a crash before the commit leaves neither effect nor mark. A claim
//     made in the transaction leaves nothing at all: the redelivery is
//     claimed by Dedup, and, finding no row, counts the attempt that left
//     none as a failed one (so does the redelivery of a message whose
//     attempt left nothing otherwise: one that never ran, prefetched by
//     a consumer that stopped, or was cut short by its shutdown; the
//     count is cleared when the message succeeds). A claim of Dedup's is
//     abandoned once its lease ends: the redelivery that finds it counts
//     a failed attempt, and the next one processes the message. Either
//     way a message that kills every consumer is dead-lettered after its
//     attempts;
//   - a crash after it leaves both: the redelivery is a duplicate;
//   - two consumers never commit the same message: a claim made in the
//     transaction holds the key's row, uncommitted, until the commit, and
//     any other claim of the key waits for it a second at most, then is
//     answered busy (or finds it done); a claim of Dedup's that was lost
//     (its lease ended, and perhaps another consumer took the message)
//     matches no row at the done mark, and the transaction is rolled
//     back. The row lock that the mark takes also orders the commit
//     against a takeover: a claim of the row waits for the commit, then
//     finds it done;
//   - a commit whose answer was lost is not counted as a failure and not
//     marked by Dedup; the redelivery finds the key done if the commit took
//     effect, and runs the function again if it did not;
//   - Dedup's renewals never wait for the transaction: it locks the
//     claim's row only from the done mark to the commit, and renewals run
//     on connections of their own, so they are not starved by handlers
//     that hold every connection of the pool in a transaction. A claim
//     made in the transaction needs none: it lasts while its transaction
//     does, and the transaction sets idle_in_transaction_session_timeout
//     to the lease (about 24.8 days at most, the longest PostgreSQL
//     takes), so that the server ends it, and its claim, when its
//     consumer leaves it idle for that long (it stalled, or lost the
//     database, or the function waited that long between two
//     statements). The function's transaction is then rolled back, as
//     for a lost claim, and the message's next delivery is claimed by
//     Dedup, whose renewals let the function take its time; so it is
//     when the connection closed under the function, which dropped the
//     error that said why, a lease or more after the claim. A connection
//     that closes sooner broke, or the database went away: the message is
//     tried again after RetryDelay, not counted, claimed in its
//     transaction again; unless a deadline ended the statement (the
//     delivery's, or one of the function's own, which pgx enforces by
//     closing the connection): that attempt failed, and is counted.
//
// [SQLHandler] is the same on database/sql, through pgx's stdlib driver,
// for code written against *sql.Tx (sqlc, sqlx, GORM), always under
// Dedup's claim.
//
// # Group commit
//
// With [HandlerOptions].GroupCommit, deliveries claimed in the
// transaction share transactions: a group is one transaction, on one
// connection of the pool, whose members run one after the other, each
// in its own goroutine (the one that called the handler), and one
// commit. Up to an eighth of the pool's connections (one at least) serve
// groups at once, side by side: few groups, so that they fill. A
// delivery opens a group of its own if fewer are open; else it joins the
// open group with the fewest members, unless each holds GroupCommit
// members already or is committing, and then waits for a group to end,
// or for its context. A group commits as soon as none of its members
// runs or waits to, so a consumer with nothing else to do commits each
// delivery at once, alone: groups form when deliveries outnumber the
// groups.
//
// Each member keeps its guarantee. It begins with a savepoint, sent with
// its claim, and its function runs within it: a failure or a panic of the
// function rolls the transaction back to it, and the member fails alone,
// with the result it would have had alone; so does a function that
// drops a failed statement's error, or commits or rolls back tx (tx's
// Commit and Rollback send nothing: the member is rolled back and fails
// with [ErrTxSettled], nothing of it committed). A key that has a row
// goes to Dedup's claim, and a key that another transaction holds is
// busy, as alone. A member whose function succeeded returns once the
// commit answered: nil if it committed. If the server refused the commit
// (a deferred constraint, a serialisation failure), nothing of the group
// committed, and any member may be the cause: each runs again, alone, in
// a transaction of its own, and gets that one's result; a member whose
// context ended meanwhile cannot, so whether it was the cause is unknown:
// it is tried again after RetryDelay, not counted. Otherwise each
// gets the commit's error (wrapping middleware.ErrStoreUnavailable if
// its answer was lost, as for a transaction of one). A member whose
// context ends while it waits to join a group, or while its claim waits
// for a row that another transaction holds, returns the context's
// error, having run nothing, marked not counted (rabbitmw.NotCounted)
// and tried again after RetryDelay: the wait was the consumer's
// congestion, not the message's failure.
// Redelivered deliveries are not grouped.
//
// What it costs:
//
//   - latency: a member's result waits for the members of its group
//     after it, and for the commit. A member whose function succeeded
//     waits for the commit whatever its context, as a transaction of one
//     does; if its context ends meanwhile, the group takes no more
//     members;
//   - the functions of a group run one after another, on its connection,
//     so a slow function holds its group-mates, queued or done, for as
//     long as its context (the stack's Timeout) or the lease (the
//     transaction's idle timeout) lets it, and a member whose key another
//     transaction holds, for the second its claim waits; a function
//     whose context ends during one of its statements makes pgx close the
//     connection, which fails the whole group (not counted: the store is
//     unavailable), as does a stalled consumer whose transaction the
//     server ends;
//   - a commit that the server refuses runs every member of the group
//     again, one transaction each; one whose answer is lost fails every
//     member, which are tried again;
//   - each member is a subtransaction (a savepoint, in the round trip of
//     its claim; the server's cache of a transaction's subtransactions
//     holds 64, hence at most 32 members, leaving room for a savepoint of
//     each function); a serialisable or repeatable-read group shares one
//     snapshot, and conflicts as one transaction.
//
// What it saves: the BEGIN and COMMIT of all but one member (two
// statements, one round trip, and one durable flush each), and the
// connections and server processes of concurrent transactions.
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
// A key is the primary key of its row, and PostgreSQL indexes at most
// about 2,700 bytes of it, after compression. A message id cannot come
// near that (AMQP carries at most 255 bytes), but a key made by a Keying
// of one's own may: the store refuses such a key with an error wrapping
// store.ErrKeyRejected, and Dedup dead-letters its message with that
// reason (error type "key_rejected") instead of retrying it; nothing is
// written for it. Hash a long key (its SHA-256, say) in the Keying.
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
