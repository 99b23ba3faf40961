package pgstore

import (
	"context"
	"fmt"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
)

// inspectSQL reads the claims row and the failures row of key $1 in one
// statement, so from one snapshot and by one clock. Rows that are
// forgotten (forget_at, expires_at passed) join as absent. It answers the
// status (0 absent, 2 processing, 3 done, 4 abandoned, as Claim's numbers
// go), the token, the microseconds left before the claim's entry ends (its
// lease, its done mark's retention, or the abandoned claim's forget_at),
// the failure count and the microseconds left before it expires. A time
// left is NULL for an infinite timestamp, which the store never writes.
func (n names) inspectSQL() string {
	left := func(t string) string {
		return `CASE WHEN isfinite(` + t + `) THEN ((extract(epoch FROM ` + t + `) - extract(epoch FROM statement_timestamp())) * 1000000)::bigint END`
	}
	return `SELECT
  CASE
    WHEN c.lease_until > statement_timestamp() AND c.token IS NULL THEN 3
    WHEN c.lease_until > statement_timestamp() THEN 2
    WHEN c.token IS NOT NULL THEN 4
    ELSE 0
  END,
  c.token,
  ` + left(`CASE WHEN c.lease_until > statement_timestamp() THEN c.lease_until ELSE c.forget_at END`) + `,
  f.count,
  ` + left(`f.expires_at`) + `
FROM (VALUES ($1::bytea)) AS k (key)
LEFT JOIN ` + n.claims + ` AS c ON c.key = k.key AND c.forget_at > statement_timestamp()
LEFT JOIN ` + n.failures + ` AS f ON f.key = k.key AND f.expires_at > statement_timestamp()`
}

// Inspect implements [store.Inspector]: one SELECT, one round trip, which
// reads the claim and the failure counter of key at the same instant of
// the database's clock.
func (s *Store) Inspect(ctx context.Context, key string) (store.KeyState, error) {
	var (
		k            store.KeyState
		status       int
		token        []byte
		left         *int64
		count        *int64
		failuresLeft *int64
	)
	if err := s.pool.QueryRow(ctx, s.inspectSQL, []byte(key)).Scan(&status, &token, &left, &count, &failuresLeft); err != nil {
		return k, s.fail("inspect", key, err)
	}
	switch status {
	case 0:
	case 2:
		k.Status, k.Token, k.TTL = store.Processing, string(token), microseconds(left)
	case 3:
		k.Status, k.TTL = store.Done, microseconds(left)
	case 4:
		k.Status, k.Token, k.TTL = store.Abandoned, string(token), microseconds(left)
	default:
		return k, s.fail("inspect", key, fmt.Errorf("unexpected status %d", status))
	}
	if count != nil {
		k.Failures, k.FailuresTTL = *count, microseconds(failuresLeft)
	}
	return k, nil
}

// microseconds returns the duration of *us microseconds, or -1 (no
// expiry) if us is nil.
func microseconds(us *int64) time.Duration {
	if us == nil {
		return -1
	}
	return time.Duration(*us) * time.Microsecond
}

var _ store.Inspector = (*Store)(nil)
