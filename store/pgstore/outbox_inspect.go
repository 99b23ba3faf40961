package pgstore

import (
	"context"
	"fmt"
	"time"
)

// OutboxStats counts the rows of an [Outbox] by state.
type OutboxStats struct {
	Pending, Parked, Sent int64
	// OldestPending is the age of the first pending row (by id, the order
	// of writing), by the database's clock; 0 when none is pending.
	OldestPending time.Duration
}

// Stats counts the outbox's rows by state, in one statement. Each count
// reads the partial index of its state, so its cost grows with the rows
// in that state (sent rows are kept for the relay's retention).
func (o *Outbox) Stats(ctx context.Context) (OutboxStats, error) {
	var s OutboxStats
	var oldest *float64
	t := o.n.qualified
	err := o.pool.QueryRow(ctx, `SELECT
  (SELECT count(*) FROM `+t+` WHERE state = 'pending'),
  (SELECT count(*) FROM `+t+` WHERE state = 'parked'),
  (SELECT count(*) FROM `+t+` WHERE state = 'sent'),
  (SELECT extract(epoch FROM statement_timestamp() - created_at)::float8 FROM `+t+` WHERE state = 'pending' ORDER BY id LIMIT 1)`).
		Scan(&s.Pending, &s.Parked, &s.Sent, &oldest)
	if err != nil {
		return s, o.unreachable("stats", err)
	}
	if oldest != nil && *oldest > 0 {
		s.OldestPending = time.Duration(*oldest * float64(time.Second))
	}
	return s, nil
}

// An OutboxRow is a row of an outbox as [Outbox.List] shows it.
type OutboxRow struct {
	ID        int64
	MessageID string
	Exchange  string
	Key       string
	State     string // pending, sent or parked
	Created   time.Time
	Attempts  int
	SentAt    time.Time // zero unless sent
	Error     string    // why parked, or the last failed send
	// RetryAt is when a pending row whose send failed is sent again, not
	// before; zero for a row that goes at the next dispatch.
	RetryAt  time.Time
	BodySize int
}

// OutboxFilter selects the rows of [Outbox.List].
type OutboxFilter struct {
	// State selects rows in this state ("pending", "sent", "parked");
	// "" selects all.
	State string
	// AfterID selects rows whose id is greater, for paging.
	AfterID int64
	// Limit is the most rows returned; 0 means 100.
	Limit int
}

// List returns the rows that f selects, in id order.
func (o *Outbox) List(ctx context.Context, f OutboxFilter) ([]OutboxRow, error) {
	switch f.State {
	case "", "pending", "sent", "parked":
	default:
		return nil, fmt.Errorf("pgstore: outbox list: state %q: want pending, sent or parked", f.State)
	}
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := o.pool.Query(ctx, `SELECT id, message_id, exchange, routing_key, state, created_at, attempts, sent_at, COALESCE(error, ''), retry_at, octet_length(body)
FROM `+o.n.qualified+`
WHERE ($1 = '' OR state = $1) AND id > $2
ORDER BY id LIMIT $3`, f.State, f.AfterID, f.Limit)
	if err != nil {
		return nil, o.unreachable("list", err)
	}
	defer rows.Close()
	var out []OutboxRow
	for rows.Next() {
		var r OutboxRow
		var sent, retry *time.Time
		if err := rows.Scan(&r.ID, &r.MessageID, &r.Exchange, &r.Key, &r.State, &r.Created, &r.Attempts, &sent, &r.Error, &retry, &r.BodySize); err != nil {
			return nil, o.unreachable("list", err)
		}
		if sent != nil {
			r.SentAt = *sent
		}
		if retry != nil {
			r.RetryAt = *retry
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, o.unreachable("list", err)
	}
	return out, nil
}

// Retry sends parked rows back to pending, for the relay to send again
// (once their cause is fixed: a queue bound, a limit raised), and wakes
// the relays. It also clears the wait of pending rows whose send failed
// (their retry_at), so that they go at once too (a full queue that was
// drained). ids selects the rows; nil selects every parked or waiting
// row. It returns how many rows it changed; other rows are left as they
// are.
func (o *Outbox) Retry(ctx context.Context, ids []int64) (int64, error) {
	tag, err := o.pool.Exec(ctx, `UPDATE `+o.n.qualified+` SET state = 'pending', retry_at = NULL
WHERE (state = 'parked' OR state = 'pending' AND retry_at > statement_timestamp())
  AND ($1::bigint[] IS NULL OR id = ANY($1))`, ids)
	if err != nil {
		return 0, o.unreachable("retry", err)
	}
	if tag.RowsAffected() > 0 {
		// A relay that misses this only waits for its next poll.
		o.pool.Exec(ctx, `SELECT pg_notify($1, '')`, o.n.channel)
	}
	return tag.RowsAffected(), nil
}
