package pgstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
)

// An OutboxMessage is a pending row of an [Outbox], as [Outbox.Dispatch]
// hands it to a relay's send function.
type OutboxMessage struct {
	ID       int64  // the row's id: the order in which rows were written
	Exchange string // where to publish it
	Key      string // the routing key
	// Publishing is the message as written, with its MessageId and body;
	// its timestamps (Timestamp, and those of the headers) are in UTC, as
	// AMQP carries no location.
	Publishing amqp.Publishing
	// Trace is the writer's trace context (see OutboxOptions.Inject), or
	// nil.
	Trace map[string]string
	// Created is when the row was written, by the database's clock.
	Created time.Time
	// Attempts counts the earlier sends of the row that ended without a
	// confirm.
	Attempts int
}

// An OutboxResult is what became of the send of one [OutboxMessage]. The
// zero value means not sent (the send was not tried, or its confirm did
// not come): the row stays pending, to be sent again.
type OutboxResult struct {
	// Sent: RabbitMQ confirmed the message. The row is marked sent (or
	// deleted).
	Sent bool
	// Park, if not nil, is why RabbitMQ will not take the message as it
	// is: it was returned (no queue is bound for it), or refused in a way
	// that sending it again cannot mend. The row is parked with this
	// reason, out of the relay's way, until an operator retries it.
	Park error
	// Failed, if not nil and the row is neither sent nor parked, is why
	// the send ended without a confirm (a nack, a lost connection, a
	// timeout): it is counted in the row's attempts and kept as its last
	// error, and the row stays pending.
	Failed error
	// RetryAfter, with Failed, is how long the row is left out of the
	// dispatches that follow (its retry_at), so that a row that keeps
	// failing (a queue that stays full) is not taken again in each
	// batch, ahead of the rows written after it. 0 leaves it to the next
	// dispatch.
	RetryAfter time.Duration
}

// DispatchOptions configures one [Outbox.Dispatch]. The zero value selects
// the defaults.
type DispatchOptions struct {
	// Limit is the most rows taken. Default 100.
	Limit int
	// After, if positive, takes only the rows whose id is greater: a
	// relay walks on past rows that failed, so that they do not hold
	// back the rows written after them.
	After int64
	// DeleteSent deletes the rows sent instead of marking them.
	DeleteSent bool
	// HoldFor, if positive, bounds how long the dispatch may hold its rows
	// while send runs: past it, PostgreSQL ends the dispatch's session
	// (idle_in_transaction_session_timeout, for this transaction), its
	// rows go back to pending for another dispatch to send, and this one's
	// results are not recorded (Dispatch returns an error). So a relay
	// that stalls (a frozen process, a network that stops answering) does
	// not hold its rows for ever. Choose it above the longest send. A
	// HoldFor over PostgreSQL's limit (2³¹-1 ms, about 24.8 days) is
	// held that long.
	HoldFor time.Duration
}

// A DispatchResult counts the rows of one [Outbox.Dispatch].
type DispatchResult struct {
	Taken, Sent, Parked, Failed int
}

// ErrCorruptRow is the reason, wrapped, of a row parked by Dispatch
// because its properties could not be read back (a row written by hand,
// or by another version).
var ErrCorruptRow = errors.New("pgstore: outbox row cannot be read")

// The statements of Dispatch. Rows are taken in id order, FOR UPDATE SKIP
// LOCKED, but for those whose retry_at has not come: rows that another
// dispatch holds are skipped, not waited for,
// so several relays share the rows without taking one twice while it is
// held. The lock is held until the dispatch's commit, after the send:
// a relay that dies mid-send releases its rows (PostgreSQL ends the
// transaction with the connection), and another sends them again.
func (o *Outbox) takeSQL() string {
	return `SELECT id, message_id, exchange, routing_key, properties, body, trace, created_at, attempts
FROM ` + o.n.qualified + `
WHERE state = 'pending' AND id > $2 AND (retry_at IS NULL OR retry_at <= statement_timestamp())
ORDER BY id
LIMIT $1
FOR UPDATE SKIP LOCKED`
}

func (o *Outbox) markSentSQL(del bool) string {
	if del {
		return `DELETE FROM ` + o.n.qualified + ` WHERE id = ANY($1)`
	}
	return `UPDATE ` + o.n.qualified + ` SET state = 'sent', sent_at = clock_timestamp(), retry_at = NULL WHERE id = ANY($1)`
}

// markSQL records rows parked or failed: $3 is each row's RetryAfter in
// microseconds, 0 for none.
func (o *Outbox) markSQL(state string) string {
	return `UPDATE ` + o.n.qualified + ` AS t SET state = '` + state + `', attempts = t.attempts + 1, error = x.error,
  retry_at = CASE WHEN x.wait > 0 THEN clock_timestamp() + x.wait * interval '1 microsecond' END
FROM unnest($1::bigint[], $2::text[], $3::bigint[]) AS x (id, error, wait) WHERE t.id = x.id`
}

// Dispatch takes up to opts.Limit pending rows in id order (past
// opts.After), skipping those
// that another Dispatch holds, calls send with them and a results slice of
// the same length, and records the results: rows sent are marked sent (or
// deleted, with DeleteSent), rows parked are parked, the others stay
// pending (those that failed, until their RetryAfter has passed: a
// Dispatch does not take a row before its retry_at). It all happens in one transaction, which holds the rows locked
// from the take to the commit: a send function that publishes with
// confirms therefore marks a row sent only after its confirm, and a
// process that dies before the commit leaves its rows pending, for the
// next Dispatch (of any process) to send again, with the same MessageId.
//
// send gets ctx; it must fill results and return, and must not use the
// outbox's pool meanwhile beyond its spare connections. The results are
// recorded even if ctx is done by then (bounded by a timeout of its own),
// since the messages confirmed by then are sent. A row whose properties
// cannot be read is parked with [ErrCorruptRow] and not handed to send.
//
// Dispatch returns the counts, and an error if the database could not be
// reached. If the commit's answer is lost, the rows sent may be sent
// again: the copies carry the same MessageId. So may they after a crash
// of the database: the results are committed without waiting for the
// write-ahead log's flush (synchronous_commit off, for this transaction
// only), since a lost mark costs a copy that the consumers' Dedup
// absorbs, and the flush would cost each dispatch a disk write's wait.
func (o *Outbox) Dispatch(ctx context.Context, opts DispatchOptions, send func(ctx context.Context, msgs []OutboxMessage, results []OutboxResult)) (DispatchResult, error) {
	var res DispatchResult
	limit, deleteSent := opts.Limit, opts.DeleteSent
	if limit <= 0 {
		limit = 100
	}
	tx, err := o.pool.Begin(ctx)
	if err != nil {
		return res, o.unreachable("dispatch", err)
	}
	// The rollback gives the connection back to the pool on every return
	// from here on; after the commit, it is a no-op.
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		tx.Rollback(rctx)
		cancel()
	}()
	if opts.HoldFor > 0 {
		// PostgreSQL takes at most INT_MAX milliseconds (about 24.8
		// days); a longer hold is held that long.
		ms := strconv.FormatInt(min(max(1, opts.HoldFor.Milliseconds()), math.MaxInt32), 10)
		if _, err := tx.Exec(ctx, `SELECT set_config('idle_in_transaction_session_timeout', $1, true)`, ms); err != nil {
			return res, o.unreachable("dispatch", err)
		}
	}
	rows, err := tx.Query(ctx, o.takeSQL(), limit, opts.After)
	if err != nil {
		return res, o.unreachable("dispatch", err)
	}
	var msgs []OutboxMessage
	var corrupt []int64
	var corruptWhy []string
	for rows.Next() {
		var (
			m           OutboxMessage
			props, body []byte
			trace       []byte
		)
		if err := rows.Scan(&m.ID, &m.Publishing.MessageId, &m.Exchange, &m.Key, &props, &body, &trace, &m.Created, &m.Attempts); err != nil {
			rows.Close()
			return res, o.unreachable("dispatch", err)
		}
		p, err := decodeProperties(props)
		if err == nil && trace != nil {
			err = json.Unmarshal(trace, &m.Trace)
		}
		if err != nil {
			corrupt = append(corrupt, m.ID)
			corruptWhy = append(corruptWhy, reason(fmt.Errorf("%w: %w", ErrCorruptRow, err)))
			continue
		}
		p.MessageId, p.Body = m.Publishing.MessageId, body
		m.Publishing = p
		msgs = append(msgs, m)
	}
	if err := rows.Err(); err != nil {
		return res, o.unreachable("dispatch", err)
	}
	res.Taken = len(msgs) + len(corrupt)
	if res.Taken == 0 {
		return res, nil
	}
	results := make([]OutboxResult, len(msgs))
	if len(msgs) > 0 {
		send(ctx, msgs, results)
	}

	var sent, parked, failed []int64
	var parkedWhy, failedWhy []string
	var failedWait []int64 // microseconds
	for i, r := range results {
		switch {
		case r.Sent:
			sent = append(sent, msgs[i].ID)
		case r.Park != nil:
			parked = append(parked, msgs[i].ID)
			parkedWhy = append(parkedWhy, reason(r.Park))
		case r.Failed != nil:
			failed = append(failed, msgs[i].ID)
			failedWhy = append(failedWhy, reason(r.Failed))
			failedWait = append(failedWait, max(0, r.RetryAfter.Microseconds()))
		}
	}
	parked, parkedWhy = append(parked, corrupt...), append(parkedWhy, corruptWhy...)
	res.Sent, res.Parked, res.Failed = len(sent), len(parked), len(failed)
	if len(sent)+len(parked)+len(failed) == 0 {
		return res, nil // nothing to record: the rollback frees the rows
	}
	// The confirmed messages are sent whatever happens to ctx now: record
	// them, in one round trip, and commit.
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	var b pgx.Batch
	// The commit does not wait for its WAL flush: a crash of the database
	// can lose the last marks, and their rows are then sent again, as
	// after a relay's crash. Nothing is lost (the rows were written by
	// commits of their own), and the flush is what a dispatch would wait
	// for most.
	b.Queue(`SET LOCAL synchronous_commit TO off`)
	if len(sent) > 0 {
		b.Queue(o.markSentSQL(deleteSent), sent)
	}
	if len(parked) > 0 {
		b.Queue(o.markSQL("parked"), parked, parkedWhy, make([]int64, len(parked)))
	}
	if len(failed) > 0 {
		b.Queue(o.markSQL("pending"), failed, failedWhy, failedWait)
	}
	if err := tx.SendBatch(wctx, &b).Close(); err != nil {
		return res, o.unreachable("dispatch: record the results", err)
	}
	if err := tx.Commit(wctx); err != nil {
		return res, o.unreachable("dispatch: commit (the messages confirmed may be sent again)", err)
	}
	return res, nil
}

// reason returns err's text as the error column can hold it: PostgreSQL's
// text refuses bytes that are not UTF-8 (a server's reason that RabbitMQ
// cut in the middle of a character) and NUL, and one reason it refuses
// would fail the record of the whole dispatch, for ever.
func reason(err error) string {
	return strings.ReplaceAll(strings.ToValidUTF8(err.Error(), "\uFFFD"), "\x00", `\x00`)
}

// DeleteSent deletes up to limit rows sent more than retention ago, and
// returns how many it deleted. The relay calls it; call it yourself if
// you run none. It finds the rows through the index on sent_at, skips
// rows that another statement holds, and holds the others for one
// statement.
func (o *Outbox) DeleteSent(ctx context.Context, retention time.Duration, limit int) (int64, error) {
	tag, err := o.pool.Exec(ctx, `DELETE FROM `+o.n.qualified+` WHERE id IN (
  SELECT id FROM `+o.n.qualified+` WHERE state = 'sent' AND sent_at <= statement_timestamp() - $1::interval
  LIMIT $2 FOR UPDATE SKIP LOCKED)`, retention, limit)
	if err != nil {
		return 0, o.unreachable("delete sent rows", err)
	}
	return tag.RowsAffected(), nil
}
