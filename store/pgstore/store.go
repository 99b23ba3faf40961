package pgstore

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/rabbitmw/rabbitmw/internal/text"
	"github.com/rabbitmw/rabbitmw/store"
)

// Options configures a [Store]. The zero value selects the defaults.
type Options struct {
	// Table is the name of the table of claims and done marks; the failure
	// counters are in Table + "_failures". A lower-case SQL identifier of
	// at most 43 characters, optionally schema-qualified ("inbox.claims").
	// Default [DefaultTable].
	Table string
	// AbandonedRetention is how long a claim whose lease ended without
	// Complete or Release is remembered after the lease, for Claim to
	// report it Abandoned (see [store.Store]); then its row is forgotten,
	// and Prune may delete it. Each row carries its own (its forget_at), so
	// stores with different settings can share a table. Zero means
	// [store.DefaultAbandonedRetention].
	AbandonedRetention time.Duration
	// PruneEvery: every PruneEvery-th Claim on this Store also deletes up
	// to 2*PruneEvery forgotten rows (see [Store.Prune]) before it returns.
	// Default 1000; negative turns it off, for a deployment that calls
	// Prune on a schedule of its own.
	PruneEvery int
	// DurableClaims makes each claim wait, as it commits, until
	// PostgreSQL has flushed it to disk. By default a claim commits
	// asynchronously (synchronous_commit off for its own transaction
	// only): it is visible to every other consumer at once, as any
	// commit, but a crash of the server (not a clean shutdown) may forget
	// the claims committed in the last moments before it (at most three
	// times wal_writer_delay, 600 ms by default). Done marks, releases and
	// the transactions of [Handler] always commit durably, and a durable
	// commit flushes every claim committed before it.
	//
	// What an asynchronous claim costs: with [Handler], nothing; its
	// effect and done mark commit together, durably. Without it, a
	// handler that was running when the server crashed may find its claim
	// gone when the server is back: Dedup then stops it (its lease is
	// lost) and the redelivery runs it again, so an effect outside the
	// database may happen twice, as when a consumer dies between its
	// effect and the done mark. A claim forgotten that way is not
	// reported abandoned either.
	DurableClaims bool
}

// Store is a [store.Store] in PostgreSQL, over a [pgxpool.Pool]. It keeps
// the claims and done marks of message keys in one table, one row per key,
// and the failure counters in a second; [Schema] gives their SQL. Put it in
// the database that holds the effects of the messages, and use [Handler]:
// the effect and its done mark then commit in one transaction.
//
// Every state change is one SQL statement, one round trip: a claim is an
// INSERT … ON CONFLICT … DO UPDATE that takes the row only where it has
// been forgotten, makes an abandoned claim forgotten, and reads the status
// of a row it did not change in the same statement. Claims that arrive
// while another is in flight wait for it, and are then sent together, in
// one such statement of many rows, with one commit: a Store has at most
// one statement of claims in flight, and a claim waits at most for the
// one before its own. A statement does not wait for a row of its keys
// that another transaction holds locked (another consumer's claim or
// done mark, until it commits; the transaction of [SQLHandler] holds its
// key's row between the mark and the commit, longer if its consumer stops
// answering): it locks its existing rows with SKIP LOCKED first, and a
// claim whose row it could not lock takes nothing and is answered from
// the row as the statement found it, processing (done if it was an
// unexpired done mark); Dedup retries a processing key later. So a locked
// row holds up neither the statement nor the claims queued behind it, and
// the statement holds the locks it takes only for as long as it runs. Where
// consumers claim the same key at the same moment, one of them may thus
// find it processing rather than abandoned or claimable, and its retry
// gives the answer. A statement still waits for a row that another
// transaction inserted and has not committed (a claim in another
// statement, which commits at once; the claim that [Handler] makes in
// its transaction, which holds its row while the function runs), a
// second at most: then the statement fails, and its claims are sent again
// one by one, the claim of that row to be answered processing after
// another second. A statement sent for others waits 10 seconds at most,
// then fails each of its claims; a claim sent alone waits as long as its
// context lets it. If the server refuses such a statement, its claims
// are sent again one by one, so that a claim it refuses (a key too long
// for the primary key's index) fails alone. Extend, Complete and Release
// are an UPDATE or DELETE that checks the token and the lease in its
// WHERE clause; Fail is an upsert that returns the count. Leases,
// retention and counter expiry are measured by the database's clock
// (statement_timestamp), never the consumer's. A claim commits without
// waiting for its flush to disk unless [Options].DurableClaims: a
// delivery that Handler runs under Dedup's claim then waits for one
// flush, its transaction's, instead of two (a claim that Handler makes in
// its transaction is that flush).
//
// Rows are not deleted when they expire. A claim's row is forgotten, as if
// absent, AbandonedRetention after the end of its lease (its forget_at),
// or at once when Claim found the claim abandoned; a done mark at the end
// of its retention; an expired failure counter at its expires_at. Every
// PruneEvery-th Claim runs [Store.Prune], which deletes a bounded batch of
// rows through an index on forget_at. A done mark keeps its claim's
// forget_at unless its retention ends later, so that marking a key done
// rewrites its row in place, with no new index entries (a HOT update):
// Prune may then delete a done mark up to the lease and
// AbandonedRetention after the end of its retention. See Prune for the
// cost.
//
// Extend runs on connections of its own, a second pool of at most two
// connections made from pool's configuration: a lease is renewed even when
// every connection of pool is held by a handler's transaction. Close closes
// them.
//
// Errors from PostgreSQL and from the pool are wrapped with the operation
// and key.
type Store struct {
	pool, leases   *pgxpool.Pool
	table          string // as given in Options
	n              names
	abandoned      time.Duration
	pruneEvery     int
	durableClaims  bool
	claims         atomic.Uint64
	claimSQL       string
	claimManySQL   string
	queue          claimQueue
	extendSQL      string
	completeSQL    string
	releaseSQL     string
	failSQL        string
	resetSQL       string
	pruneClaimsSQL string
	pruneFailsSQL  string
	markSQL        string
	markCommitSQL  string
	markCommitName string
	prepareMark    bool
	rowExistsSQL   string
	inspectSQL     string
	// The claim of Handler in its transaction, and the count of a
	// redelivered message's unrecorded attempt (see claimintx.go).
	claimInTxSQL       string
	countUnrecordedSQL string
	forgottenSQL       string
	markAgainSQL       string
}

// New returns a Store that keeps its state in pool, which the caller keeps
// and closes; Close the Store before pool. New does not reach the database:
// call [Store.Migrate] or [Store.Check] at start-up. It panics if pool is
// nil or opts.Table is not a valid name.
func New(pool *pgxpool.Pool, opts Options) *Store {
	if pool == nil {
		panic("pgstore: New: nil pool")
	}
	n, err := parseTable(opts.Table)
	if err != nil {
		panic("pgstore: New: " + err.Error())
	}
	if opts.AbandonedRetention < 0 {
		panic("pgstore: New: negative AbandonedRetention")
	}
	cfg := pool.Config()
	cfg.MaxConns, cfg.MinConns = 2, 0
	leases, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		panic("pgstore: New: a pool for lease renewals: " + err.Error())
	}
	s := &Store{
		pool:       pool,
		leases:     leases,
		table:      opts.Table,
		n:          n,
		abandoned:  opts.AbandonedRetention,
		pruneEvery: opts.PruneEvery,

		durableClaims: opts.DurableClaims,
	}
	if s.abandoned == 0 {
		s.abandoned = store.DefaultAbandonedRetention
	}
	if s.pruneEvery == 0 {
		s.pruneEvery = 1000
	}
	s.prepare()
	return s
}

// Close closes the connections that the Store opened for lease renewals.
// It does not close the pool given to New.
func (s *Store) Close() { s.leases.Close() }

// The statements. $1 is always the key; now is statement_timestamp(), the
// time PostgreSQL received the statement, constant within it; never now(),
// which is the start of the transaction and would stand still in
// Handler's long transactions.
func (s *Store) prepare() {
	c, f := s.n.claims, s.n.failures
	// A claim returns a store.Status's number (1 claimed, 2 processing,
	// 3 done, 4 abandoned). It first locks the key's existing row, skipping
	// it if another transaction holds it locked: then the row is busy, the
	// INSERT (which depends on busy, so runs after the lock) inserts
	// nothing and so never waits for the lock, and the answer is read from
	// the statement's snapshot below (processing, or done). Otherwise the
	// statement holds the row, and ON CONFLICT does not wait for it.
	// It takes the row (claimed) if it is absent or
	// forgotten. It turns an abandoned claim (a token whose
	// lease has ended, its forget_at not yet passed) into a forgotten row
	// (token NULL, lease_until and forget_at -infinity) and takes nothing
	// (abandoned). ON CONFLICT waits for a concurrent claim of the row and
	// then judges its newest version, so of concurrent claims of an
	// abandoned row the first reports it abandoned and the next takes it.
	// A row that the claim did not take is a done mark (token NULL,
	// unexpired) or someone else's claim: it is read from the statement's
	// snapshot, which differs from the version judged only if a concurrent
	// statement changed the row meanwhile, and then the key was processing
	// during this statement (the other statement took it), the answer
	// given; or it was done by this statement's clock.
	// Unless DurableClaims, set_config makes the statement's own
	// transaction commit asynchronously: the setting is read at commit,
	// and ends with the transaction.
	// A row is forgotten once its forget_at has passed, and a done mark
	// (token NULL) once its retention (lease_until) has: a done mark's
	// forget_at may be later (see completeSQL).
	forgotten := "(c.forget_at <= statement_timestamp() OR (c.token IS NULL AND c.lease_until <= statement_timestamp()))"
	commitMode := "\nFROM (SELECT set_config('synchronous_commit', 'off', true)) AS commit_mode"
	if s.durableClaims {
		commitMode = ""
	}
	// The INSERT of a claim waits for a row of its key that another
	// transaction inserted and has not committed (or locked after the
	// statement's SKIP LOCKED) lockWait at most: then the statement fails,
	// lock_not_available, and the claim answers processing. The
	// transaction of Handler holds its row, uncommitted, while its
	// function runs. The setting is
	// made in the condition of the INSERT's rows, so before the first row
	// is inserted, and ends with the statement's transaction.
	lockWaitSQL := `set_config('lock_timeout', '` + lockWaitSetting + `', true) IS NOT NULL`
	onConflict := `
  ON CONFLICT (key) DO UPDATE SET
    token = CASE WHEN ` + forgotten + ` THEN excluded.token END,
    lease_until = CASE WHEN ` + forgotten + ` THEN excluded.lease_until ELSE '-infinity' END,
    forget_at = CASE WHEN ` + forgotten + ` THEN excluded.forget_at ELSE '-infinity' END
  WHERE ` + forgotten + ` OR (c.token IS NOT NULL AND c.lease_until <= statement_timestamp())`
	s.claimSQL = `WITH locked AS (
  SELECT key FROM ` + c + ` WHERE key = $1::bytea FOR UPDATE SKIP LOCKED
), busy AS (
  SELECT EXISTS (SELECT FROM ` + c + ` WHERE key = $1::bytea) AND NOT EXISTS (SELECT FROM locked) AS busy
), taken AS (
  INSERT INTO ` + c + ` AS c (key, token, lease_until, forget_at)
  SELECT $1::bytea, $2::bytea, statement_timestamp() + $3::interval, statement_timestamp() + $3::interval + $4::interval
  WHERE NOT (SELECT busy FROM busy) AND ` + lockWaitSQL + onConflict + `
  RETURNING c.token IS NOT NULL AS claimed
)
SELECT COALESCE(
  (SELECT CASE WHEN claimed THEN 1 ELSE 4 END FROM taken),
  CASE WHEN EXISTS (SELECT FROM ` + c + ` WHERE key = $1 AND token IS NULL AND lease_until > statement_timestamp()) THEN 3 ELSE 2 END)` + commitMode
	// The claims of several keys (claimMany), each as claimSQL: $1 the
	// keys, all different, $2 the tokens, $3 the leases in microseconds,
	// $4 the abandoned retention. It answers the statuses in the order of
	// the keys. As claimSQL, it first locks the existing rows of its keys
	// with SKIP LOCKED; the keys of rows held by other transactions (busy,
	// an array evaluated once, before the INSERT's first row) are left out
	// of the INSERT and answered from the snapshot, so that a locked row
	// holds up neither the statement nor the other claims in it. The rows
	// are locked and inserted in the order of their keys, so that two
	// statements that claim some of the same keys lock their rows in the
	// same order, and do not deadlock.
	if commitMode != "" {
		commitMode = ",\n  (SELECT set_config('synchronous_commit', 'off', true)) AS commit_mode"
	}
	s.claimManySQL = `WITH req AS (
  SELECT * FROM unnest($1::bytea[], $2::bytea[], $3::bigint[]) WITH ORDINALITY AS r (key, token, lease_us, i)
), locked AS (
  SELECT key FROM ` + c + ` WHERE key = ANY($1::bytea[]) ORDER BY key FOR UPDATE SKIP LOCKED
), busy AS (
  SELECT COALESCE(array_agg(key), '{}') AS keys FROM ` + c + ` WHERE key = ANY($1::bytea[]) AND key NOT IN (SELECT key FROM locked)
), taken AS (
  INSERT INTO ` + c + ` AS c (key, token, lease_until, forget_at)
  SELECT key, token, statement_timestamp() + lease_us * interval '1 microsecond', statement_timestamp() + lease_us * interval '1 microsecond' + $4::interval
  FROM req WHERE key <> ALL ((SELECT keys FROM busy)::bytea[]) AND ` + lockWaitSQL + ` ORDER BY key` + onConflict + `
  RETURNING c.key, c.token IS NOT NULL AS claimed
)
SELECT COALESCE(
  (SELECT CASE WHEN claimed THEN 1 ELSE 4 END FROM taken WHERE taken.key = req.key),
  CASE WHEN EXISTS (SELECT FROM ` + c + ` AS d WHERE d.key = req.key AND d.token IS NULL AND d.lease_until > statement_timestamp()) THEN 3 ELSE 2 END)
FROM req` + commitMode + `
ORDER BY req.i`
	s.extendSQL = `UPDATE ` + c + `
SET lease_until = statement_timestamp() + $3::interval, forget_at = statement_timestamp() + $3::interval + $4::interval
WHERE key = $1 AND token = $2 AND lease_until > statement_timestamp()`
	// A done mark keeps the claim's forget_at unless its retention ends
	// later: the row is forgotten at the end of the retention all the
	// same, and an UPDATE that leaves every indexed column as it was
	// rewrites the row in its page (a HOT update) without new entries in
	// the two indexes. Prune deletes the row at its forget_at.
	s.completeSQL = `UPDATE ` + c + `
SET token = NULL, lease_until = statement_timestamp() + $3::interval, forget_at = GREATEST(forget_at, statement_timestamp() + $3::interval)
WHERE key = $1 AND token = $2 AND lease_until > statement_timestamp()`
	// The done mark of Handler: Complete, in the handler's transaction.
	// clock_timestamp: the transaction may have waited on a row lock. It
	// answers 1 if it marked the key done; else 0 if the key has a row
	// (another claim's, or an ended lease), -1 if it has none. CASE looks
	// the row up only when the mark missed.
	s.markSQL = `WITH marked AS (
  UPDATE ` + c + `
  SET token = NULL, lease_until = clock_timestamp() + $3::interval, forget_at = GREATEST(forget_at, clock_timestamp() + $3::interval)
  WHERE key = $1 AND token = $2 AND lease_until > clock_timestamp()
  RETURNING 1
)
SELECT CASE WHEN EXISTS (SELECT FROM marked) THEN 1 WHEN EXISTS (SELECT FROM ` + c + ` WHERE key = $1) THEN 0 ELSE -1 END`
	// The done mark of Handler over pgx, sent with the COMMIT in one round
	// trip: the same UPDATE, whose statement fails (division by zero)
	// when it marks nothing, so that the server skips the COMMIT. count
	// is not a constant: the division happens only then. $3 is the
	// retention in microseconds.
	s.markCommitSQL = `WITH marked AS (
  UPDATE ` + c + `
  SET token = NULL, lease_until = clock_timestamp() + $3::bigint * interval '1 microsecond', forget_at = GREATEST(forget_at, clock_timestamp() + $3::bigint * interval '1 microsecond')
  WHERE key = $1 AND token = $2 AND lease_until > clock_timestamp()
  RETURNING 1
)
SELECT 1 / (SELECT count(*)::int FROM marked)`
	sum := fnv.New64a()
	sum.Write([]byte(s.markCommitSQL))
	s.markCommitName = fmt.Sprintf("rabbitmw_pgstore_mark_%x", sum.Sum64())
	switch s.pool.Config().ConnConfig.DefaultQueryExecMode {
	case pgx.QueryExecModeCacheStatement:
		s.prepareMark = true
	}
	// The claim of Handler in its own transaction, its first statement
	// (see txHandler.HandleClaiming): the key's row, inserted as a done
	// mark of retention $2 (microseconds), unless the key has a row; it
	// affects one row if it claimed the key. The claim lasts while the
	// transaction does, which idle_in_transaction_session_timeout ends
	// when the consumer leaves it idle for the lease $3 (milliseconds): the
	// server then ends the session. As the Store's claims, it waits
	// lockWait at most for a row that another transaction holds: it saves
	// the transaction's lock_timeout, sets lockWait (in the CASE, in that
	// order, before the row is inserted), and, once the row is inserted,
	// sets the saved one back for the rest of the transaction. If it
	// inserts nothing, the transaction is rolled back.
	s.claimInTxSQL = `INSERT INTO ` + c + ` AS c (key, token, lease_until, forget_at)
SELECT $1::bytea, NULL, statement_timestamp() + $2::bigint * interval '1 microsecond', statement_timestamp() + $2::bigint * interval '1 microsecond'
WHERE CASE WHEN set_config('rabbitmw.saved_lock_timeout', current_setting('lock_timeout'), true) IS NULL THEN false
  WHEN set_config('idle_in_transaction_session_timeout', $3::text, true) IS NULL THEN false
  ELSE set_config('lock_timeout', '` + lockWaitSetting + `', true) IS NOT NULL END
ON CONFLICT (key) DO NOTHING
RETURNING set_config('lock_timeout', current_setting('rabbitmw.saved_lock_timeout'), true)`
	// The done mark of a claim made in the transaction, written again
	// before the commit of a function that ran long: its retention $2
	// (microseconds) starts now. clock_timestamp: the statement comes late
	// in a transaction that may have waited.
	s.markAgainSQL = `UPDATE ` + c + `
SET lease_until = clock_timestamp() + $2::bigint * interval '1 microsecond', forget_at = clock_timestamp() + $2::bigint * interval '1 microsecond'
WHERE key = $1`
	// A redelivered message whose key has no row: its earlier attempt,
	// claimed in its transaction, left nothing; count it as Fail does,
	// keeping a later expiry if the counter has one. Whether the key has
	// a row is asked by inserting one, forgotten (as absent: the claim
	// that follows takes it), so that a row that another transaction
	// inserted and has not committed is waited for, lockWait at most, as
	// the claims do: the earlier attempt may still run (only its
	// consumer's channel closed). If it commits, or holds the row for
	// longer, nothing is counted (the statement fails on the lock
	// timeout); if it rolls back, it left nothing, and is counted. A
	// query would not see that row, and would count an attempt that
	// runs.
	s.countUnrecordedSQL = `WITH absent AS (
  INSERT INTO ` + c + ` (key, token, lease_until, forget_at)
  SELECT $1, NULL, '-infinity', '-infinity'
  WHERE ` + lockWaitSQL + `
  ON CONFLICT (key) DO NOTHING
  RETURNING 1
)
INSERT INTO ` + f + ` AS f (key, count, expires_at)
SELECT $1, 1, statement_timestamp() + $2::interval
WHERE EXISTS (SELECT FROM absent)
ON CONFLICT (key) DO UPDATE
  SET count = CASE WHEN f.expires_at > statement_timestamp() THEN f.count + 1 ELSE 1 END, expires_at = GREATEST(f.expires_at, excluded.expires_at)`
	// The row that sends a key's next delivery to Dedup's claim, after a
	// claim in the transaction ended with its lease: a forgotten one,
	// which the next claim takes, but which no prune deletes before the
	// retention $2 (microseconds) ends: the next delivery may come after
	// many other claims, and one that found no row would be claimed in its
	// transaction again. A row that another transaction holds is waited
	// for lockWait at most: the transaction of the claim that ended, if
	// its connection closed on the consumer's side while the server still
	// runs its statement.
	s.forgottenSQL = `INSERT INTO ` + c + ` (key, token, lease_until, forget_at)
SELECT $1::bytea, NULL, '-infinity', statement_timestamp() + $2::bigint * interval '1 microsecond'
WHERE ` + lockWaitSQL + `
ON CONFLICT DO NOTHING`
	s.rowExistsSQL = `SELECT EXISTS (SELECT FROM ` + c + ` WHERE key = $1)`
	s.releaseSQL = `DELETE FROM ` + c + ` WHERE key = $1 AND token = $2 AND lease_until > statement_timestamp()`
	s.failSQL = `INSERT INTO ` + f + ` AS f (key, count, expires_at) VALUES ($1, 1, statement_timestamp() + $2::interval)
ON CONFLICT (key) DO UPDATE
  SET count = CASE WHEN f.expires_at > statement_timestamp() THEN f.count + 1 ELSE 1 END, expires_at = excluded.expires_at
RETURNING count`
	s.resetSQL = `DELETE FROM ` + f + ` WHERE key = $1`
	s.inspectSQL = s.n.inspectSQL()
	// SKIP LOCKED: a prune never waits for, nor blocks, a claim of the
	// same row; FOR UPDATE re-checks forget_at on the newest version.
	s.pruneClaimsSQL = `DELETE FROM ` + c + ` WHERE key IN (
  SELECT key FROM ` + c + ` WHERE forget_at <= statement_timestamp() LIMIT $1 FOR UPDATE SKIP LOCKED)`
	s.pruneFailsSQL = `DELETE FROM ` + f + ` WHERE key IN (
  SELECT key FROM ` + f + ` WHERE expires_at <= statement_timestamp() LIMIT $1 FOR UPDATE SKIP LOCKED)`
}

// Migrate creates the store's tables and indexes if they do not exist (the
// SQL of [Schema]), then checks them as [Store.Check] does. Where they
// are all there, it changes nothing and takes no lock on them, so that a
// consumer may call it at each start beside running ones. Concurrent
// calls, from several processes, are serialised by an advisory lock.
func (s *Store) Migrate(ctx context.Context) error {
	var schemaErr error
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, "rabbitmw pgstore "+s.n.claims); err != nil {
			return err
		}
		// A table made by something else is reported, not altered.
		if schemaErr = s.checkSchema(ctx, tx, true); schemaErr != nil {
			return schemaErr
		}
		// The schema's CREATE INDEX IF NOT EXISTS takes its table's SHARE
		// lock before it finds the index there, which waits for every
		// delivery's transaction that wrote the table (a claim made in
		// it holds it while the function runs), and every claim waits
		// behind it: the schema runs only where something is missing.
		if complete, err := s.complete(ctx, tx); complete || err != nil {
			return err
		}
		_, err := tx.Exec(ctx, s.n.schemaSQL())
		return err
	})
	switch {
	case schemaErr != nil:
		return schemaErr
	case err != nil:
		return s.unreachable("migrate", err)
	}
	return s.checkSchema(ctx, s.pool, false)
}

// complete reports whether the store's tables and their indexes are all
// there, its tables' columns checked already.
func (s *Store) complete(ctx context.Context, tx pgx.Tx) (bool, error) {
	var tables, indexes int
	err := tx.QueryRow(ctx, `SELECT
  (SELECT count(*) FROM pg_tables WHERE schemaname = COALESCE(NULLIF($1, ''), current_schema()) AND tablename = ANY($2)),
  (SELECT count(*) FROM pg_indexes WHERE schemaname = COALESCE(NULLIF($1, ''), current_schema()) AND indexname = ANY($3))`,
		s.n.schema, []string{s.n.table, s.n.table + "_failures"}, s.n.indexNames()).Scan(&tables, &indexes)
	return tables == 2 && indexes == len(s.n.indexNames()), err
}

// Check reports whether the database answers and the store's tables exist
// with the columns the store needs. Call it (or Migrate) at start-up, so
// that a wrong DSN or a missing migration fails the consumer then, with an
// error that says so, rather than its first message. A schema mismatch
// wraps [ErrSchema].
func (s *Store) Check(ctx context.Context) error {
	if err := s.pool.Ping(ctx); err != nil {
		return s.unreachable("check", err)
	}
	return s.checkSchema(ctx, s.pool, false)
}

// unreachable wraps an error of a call that reached no particular key.
func (s *Store) unreachable(op string, err error) error {
	cfg := s.pool.Config().ConnConfig
	return fmt.Errorf("pgstore: %s: PostgreSQL at %s:%d, database %q: %w", op, cfg.Host, cfg.Port, cfg.Database, err)
}

func (s *Store) fail(op, key string, err error) error {
	if tooLong(err) {
		return fmt.Errorf("pgstore: %s %s: %w: %w", op, text.QuoteKey(key), store.ErrKeyRejected, err)
	}
	return fmt.Errorf("pgstore: %s %s: %w", op, text.QuoteKey(key), err)
}

// tooLong reports whether err is PostgreSQL's program_limit_exceeded: in
// the store's statements, a key too long for the index of its table's
// primary key, after compression (about 2,700 bytes at most).
func tooLong(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "54000"
}

// Claim implements [store.Store]. Claims that arrive while another is in
// flight are sent together, in one statement.
func (s *Store) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	st, err := s.claim(ctx, key, token, lease)
	if err != nil {
		return 0, err
	}
	s.counted(ctx)
	return st, nil
}

// counted counts a claim, of Claim or of [Handler] in its transaction:
// every PruneEvery-th runs Prune. Its errors are dropped: the next prune
// tries again.
func (s *Store) counted(ctx context.Context) {
	if s.pruneEvery > 0 && s.claims.Add(1)%uint64(s.pruneEvery) == 0 {
		s.Prune(ctx, 2*s.pruneEvery)
	}
}

// claimOne claims key alone.
func (s *Store) claimOne(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	var n int
	if err := s.pool.QueryRow(ctx, s.claimSQL, []byte(key), []byte(token), lease, s.abandoned).Scan(&n); err != nil {
		if lockTimedOut(err) {
			// Another transaction held the key's row for lockWait: the
			// key is processing.
			return store.Processing, nil
		}
		return 0, s.fail("claim", key, err)
	}
	return s.status(key, n)
}

// claimMany claims the keys of batch, all different, in one statement,
// and sets each one's answer. If the server refuses the statement, each
// claim is sent again alone, so that a claim the server refuses fails
// alone.
func (s *Store) claimMany(ctx context.Context, batch []*claimReq) {
	keys, tokens, leases := make([][]byte, len(batch)), make([][]byte, len(batch)), make([]int64, len(batch))
	for i, r := range batch {
		keys[i], tokens[i], leases[i] = []byte(r.key), []byte(r.token), r.lease.Microseconds()
	}
	rows, err := s.pool.Query(ctx, s.claimManySQL, keys, tokens, leases, s.abandoned)
	i := 0
	if err == nil {
		for rows.Next() && i < len(batch) {
			var n int
			if err = rows.Scan(&n); err != nil {
				break
			}
			r := batch[i]
			r.status, r.err = s.status(r.key, n)
			i++
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
		if err == nil && i < len(batch) {
			err = fmt.Errorf("%d answers to %d claims", i, len(batch))
		}
	}
	if err != nil && refused(err) && ctx.Err() == nil {
		// The server refused the statement, which committed nothing. One
		// claim may be the cause (a key too long for the index, say):
		// each is sent alone, for an answer of its own.
		for _, r := range batch {
			r.status, r.err = s.claimOne(ctx, r.key, r.token, r.lease)
		}
		return
	}
	if err != nil {
		// The statement's outcome is unknown: none of its answers count.
		for _, r := range batch {
			r.status, r.err = 0, s.fail("claim", r.key, err)
		}
	}
}

// status converts a claim statement's answer n for key.
func (s *Store) status(key string, n int) (store.Status, error) {
	if st := store.Status(n); st.Valid() {
		return st, nil
	}
	return 0, s.fail("claim", key, fmt.Errorf("unexpected status %d", n))
}

// Extend implements [store.Store].
func (s *Store) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	return s.owned(ctx, s.leases, "extend", s.extendSQL, key, token, lease, s.abandoned)
}

// Complete implements [store.Store].
func (s *Store) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return s.owned(ctx, s.pool, "complete", s.completeSQL, key, token, retention)
}

// Release implements [store.Store].
func (s *Store) Release(ctx context.Context, key, token string) error {
	return s.owned(ctx, s.pool, "release", s.releaseSQL, key, token)
}

func (s *Store) owned(ctx context.Context, pool *pgxpool.Pool, op, sql, key, token string, args ...any) error {
	tag, err := pool.Exec(ctx, sql, append([]any{[]byte(key), []byte(token)}, args...)...)
	if err != nil {
		return s.fail(op, key, err)
	}
	if tag.RowsAffected() == 0 {
		return store.ErrLostClaim
	}
	return nil
}

// Fail implements [store.Store].
func (s *Store) Fail(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	var n int64
	if err := s.pool.QueryRow(ctx, s.failSQL, []byte(key), ttl).Scan(&n); err != nil {
		return 0, s.fail("fail", key, err)
	}
	return n, nil
}

// ResetFailures implements [store.Store].
func (s *Store) ResetFailures(ctx context.Context, key string) error {
	if _, err := s.pool.Exec(ctx, s.resetSQL, []byte(key)); err != nil {
		return s.fail("reset failures", key, err)
	}
	return nil
}

// Prune deletes up to limit forgotten rows from each of the store's tables
// (done marks past their forget_at, lapsed claims past AbandonedRetention,
// expired failure counters) and returns how many it deleted. Claim calls
// it every PruneEvery claims; call it yourself on a schedule if you set
// PruneEvery negative.
//
// Cost: two DELETE statements, two round trips. Each finds its rows through
// an index range scan (forget_at, expires_at), skips rows that another
// statement holds locked, and deletes at most limit rows, so it holds row
// locks on those rows only and for one statement. Deleted rows leave dead
// tuples for autovacuum, as any DELETE does; the two indexes on forget_at
// and expires_at cost one more index entry per write (claims and renewals
// are not HOT updates, since they change forget_at; done marks mostly
// are).
func (s *Store) Prune(ctx context.Context, limit int) (int64, error) {
	var total int64
	for _, sql := range []string{s.pruneClaimsSQL, s.pruneFailsSQL} {
		tag, err := s.pool.Exec(ctx, sql, limit)
		if err != nil {
			return total, s.unreachable("prune", err)
		}
		total += tag.RowsAffected()
	}
	return total, nil
}

var _ store.Store = (*Store)(nil)

// refused reports whether err is an error of the server that ended the
// statement's transaction uncommitted: any but the errors of a connection
// that ends (class 08, 57P, a server shutting down, a terminated backend),
// which may come after the commit.
func refused(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && !strings.HasPrefix(pe.Code, "08") && !strings.HasPrefix(pe.Code, "57P")
}

// isPgError reports whether err is an error that PostgreSQL sent, as
// opposed to one of the connection or the client.
func isPgError(err error) bool {
	var pe interface{ SQLState() string }
	return errors.As(err, &pe)
}
