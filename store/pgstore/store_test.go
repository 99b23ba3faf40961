package pgstore_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/storetest"
)

func TestConformance(t *testing.T) {
	pool := newPool(t)
	s := newStore(t, pool, pgstore.Options{})
	storetest.Run(t, func(t *testing.T) store.Store { return s })
}

func TestInspector(t *testing.T) {
	pool := newPool(t)
	s := newStore(t, pool, pgstore.Options{})
	storetest.RunInspector(t, func(t *testing.T) store.Store { return s })

	// An abandoned claim is forgotten AbandonedRetention after its lease.
	s = newStore(t, pool, pgstore.Options{AbandonedRetention: time.Hour})
	ctx := context.Background()
	_, err := s.Claim(ctx, "k", "t1", time.Millisecond)
	require.NoError(t, err)
	time.Sleep(50 * time.Millisecond) // waits for the database's clock
	got, err := s.Inspect(ctx, "k")
	if err != nil || got.Status != store.Abandoned || got.TTL <= 50*time.Minute || got.TTL > time.Hour {
		t.Errorf("Inspect after the lease = %+v, %v; want abandoned, TTL about 1h", got, err)
	}
}

// The piggy-backed prune deletes rows whose retention ended, and only
// those.
func TestPrune(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	s := newStore(t, pool, pgstore.Options{Table: table, PruneEvery: 10, AbandonedRetention: time.Millisecond})
	// The claims' lease is long enough that "done" is completed within it
	// on a loaded machine; the done mark and the failure count are short.
	const lease = 500 * time.Millisecond
	for _, k := range []string{"done", "lapsed"} {
		if st, err := s.Claim(ctx, k, "t1", lease); err != nil || st != store.Claimed {
			t.Fatalf("Claim(%s) = %v, %v", k, st, err)
		}
	}
	require.NoError(t, s.Complete(ctx, "done", "t1", 50*time.Millisecond))
	_, err := s.Fail(ctx, "failed", 50*time.Millisecond)
	require.NoError(t, err)
	if st, err := s.Claim(ctx, "kept", "t1", time.Hour); err != nil || st != store.Claimed {
		t.Fatalf("Claim(kept) = %v, %v", st, err)
	}
	time.Sleep(lease + 200*time.Millisecond) // waits for the database's clock
	for i := range 7 {                       // the 10th claim prunes
		_, err := s.Claim(ctx, "other"+string(rune('a'+i)), "t1", time.Hour)
		require.NoError(t, err)
	}
	var claims, fails int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+table+`), (SELECT count(*) FROM `+table+`_failures)`).Scan(&claims, &fails))
	if claims != 8 || fails != 0 {
		t.Errorf("after the prune: %d claim rows, %d failure rows; want 8 (kept and 7 others), 0", claims, fails)
	}
	if n, err := s.Prune(ctx, 100); err != nil || n != 0 {
		t.Errorf("Prune again = %d, %v; want 0, nil", n, err)
	}
}

func TestBadTableName(t *testing.T) {
	for _, name := range []string{"Inbox", "in-box", `x"; DROP TABLE y; --`, "a.b.c", strings.Repeat("a", 44), "1abc"} {
		func() {
			defer func() {
				r := recover()
				if r == nil || !strings.HasPrefix(r.(string), "pgstore: New: table name") {
					t.Errorf("New(Table %q) panicked with %v; want a pgstore: New: table name panic", name, r)
				}
			}()
			pgstore.New(&pgxpool.Pool{}, pgstore.Options{Table: name})
		}()
	}
}

// A schema-qualified table works: quoting does not put the dot inside the
// name.
func TestSchemaQualifiedTable(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	schema := uniqueTable(t, pool)
	_, err := pool.Exec(ctx, `CREATE SCHEMA `+schema)
	require.NoError(t, err)
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP SCHEMA `+schema+` CASCADE`) })
	s := newStore(t, pool, pgstore.Options{Table: schema + ".inbox"})
	if st, err := s.Claim(ctx, "k", "t1", time.Minute); err != nil || st != store.Claimed {
		t.Fatalf("Claim = %v, %v; want claimed", st, err)
	}
	assert.NoError(t, s.Check(ctx), "Check")
}

// A table of that name made by something else is refused, with the fix.
func TestOtherSchema(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	_, err := pool.Exec(ctx, `CREATE TABLE `+table+` (id serial PRIMARY KEY, body text)`)
	require.NoError(t, err)
	s := pgstore.New(pool, pgstore.Options{Table: table})
	defer s.Close()
	for name, call := range map[string]func(context.Context) error{"Migrate": s.Migrate, "Check": s.Check} {
		err := call(ctx)
		if !errors.Is(err, pgstore.ErrSchema) || !strings.Contains(err.Error(), "id integer, body text") || !strings.Contains(err.Error(), "Options.Table") {
			t.Errorf("%s = %v; want ErrSchema naming the columns found and the fix", name, err)
		}
	}
	// A missing table names the migration.
	s2 := pgstore.New(pool, pgstore.Options{Table: table + "_x"})
	defer s2.Close()
	if err := s2.Check(ctx); !errors.Is(err, pgstore.ErrSchema) || !strings.Contains(err.Error(), "Migrate") {
		t.Errorf("Check of a missing table = %v; want ErrSchema naming Migrate", err)
	}
}

// A DSN where nothing answers: a clear error at start-up, promptly.
func TestUnreachable(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/test?connect_timeout=2")
	require.NoError(t, err)
	defer pool.Close()
	s := pgstore.New(pool, pgstore.Options{})
	defer s.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = s.Check(ctx)
	if err == nil || !strings.Contains(err.Error(), "PostgreSQL at 127.0.0.1:1") {
		t.Errorf("Check = %v; want an error naming the server", err)
	}
}

func TestSchemaSQL(t *testing.T) {
	sql := pgstore.Schema("")
	for _, want := range []string{`CREATE TABLE IF NOT EXISTS "rabbitmw_inbox"`, `"rabbitmw_inbox_failures"`, "forget_at"} {
		if !strings.Contains(sql, want) {
			t.Errorf("Schema(\"\") lacks %q:\n%s", want, sql)
		}
	}
}

// age moves the times of key's row back by d, as if d had passed on the
// database's clock: the tests of the abandoned window need no sleep.
func age(t *testing.T, pool *pgxpool.Pool, table, key string, d time.Duration) {
	t.Helper()
	tag, err := pool.Exec(context.Background(), `UPDATE `+table+` SET lease_until = lease_until - $2::interval, forget_at = forget_at - $2::interval WHERE key = $1`, []byte(key), d)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("ageing %q by %v: %v, %d rows", key, d, err, tag.RowsAffected())
	}
}

// A claim whose lease ended is abandoned for AbandonedRetention after the
// lease: owned by nobody, kept by Prune, reported once by Claim; after
// that window it is forgotten. A done mark is done until its retention
// ends.
func TestAbandonedWindow(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	s := newStore(t, pool, pgstore.Options{Table: table, AbandonedRetention: time.Hour, PruneEvery: -1})
	claim := func(key, token string, want store.Status) {
		t.Helper()
		if got, err := s.Claim(ctx, key, token, time.Minute); err != nil || got != want {
			t.Fatalf("Claim(%q, %q) = %v, %v; want %v", key, token, got, err, want)
		}
	}
	prune := func(want int64) {
		t.Helper()
		if n, err := s.Prune(ctx, 100); err != nil || n != want {
			t.Fatalf("Prune = %d, %v; want %d", n, err, want)
		}
	}

	// Within the window.
	claim("lapsed", "t1", store.Claimed)
	age(t, pool, table, "lapsed", time.Minute+time.Second)
	prune(0)
	for name, err := range map[string]error{
		"Extend":   s.Extend(ctx, "lapsed", "t1", time.Minute),
		"Complete": s.Complete(ctx, "lapsed", "t1", time.Minute),
		"Release":  s.Release(ctx, "lapsed", "t1"),
	} {
		assert.ErrorIs(t, err, store.ErrLostClaim, "%s by the lapsed owner", name)
	}
	claim("lapsed", "t2", store.Abandoned)
	assert.ErrorIs(t, s.Complete(ctx, "lapsed", "t2", time.Minute), store.ErrLostClaim, "Complete by the claimer that found it abandoned")
	prune(1) // the row that Claim left forgotten
	claim("lapsed", "t3", store.Claimed)

	// Past the window: absent, not abandoned.
	claim("old", "t1", store.Claimed)
	age(t, pool, table, "old", time.Minute+time.Hour+time.Second)
	claim("old", "t2", store.Claimed)
	claim("older", "t1", store.Claimed)
	age(t, pool, table, "older", time.Minute+time.Hour+time.Second)
	prune(1)
	claim("older", "t2", store.Claimed)

	// A done mark, with a retention far shorter than the abandoned window.
	claim("done", "t1", store.Claimed)
	require.NoError(t, s.Complete(ctx, "done", "t1", time.Minute))
	age(t, pool, table, "done", time.Minute-time.Second)
	prune(0)
	claim("done", "t2", store.Done)
	age(t, pool, table, "done", 2*time.Second)
	claim("done", "t2", store.Claimed)
}

// Each claim carries its own abandoned window: a store with a short one
// does not forget the claim of a store with a long one.
func TestAbandonedWindowPerClaim(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	long := newStore(t, pool, pgstore.Options{Table: table, AbandonedRetention: time.Hour, PruneEvery: -1})
	short := newStore(t, pool, pgstore.Options{Table: table, AbandonedRetention: time.Minute, PruneEvery: -1})
	if st, err := long.Claim(ctx, "k", "t1", time.Minute); err != nil || st != store.Claimed {
		t.Fatalf("Claim = %v, %v; want claimed", st, err)
	}
	age(t, pool, table, "k", 5*time.Minute)
	if n, err := short.Prune(ctx, 100); err != nil || n != 0 {
		t.Errorf("Prune by the short store = %d, %v; want 0", n, err)
	}
	if st, err := short.Claim(ctx, "k", "t2", time.Minute); err != nil || st != store.Abandoned {
		t.Errorf("Claim by the short store = %v, %v; want abandoned", st, err)
	}
}

// A claim commits asynchronously unless DurableClaims: its statement sets
// synchronous_commit off for its own transaction, and only for it.
func TestClaimCommitMode(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	for _, tc := range []struct {
		durable bool
		want    string
	}{{false, "off"}, {true, "on"}} {
		s := newStore(t, pool, pgstore.Options{DurableClaims: tc.durable})
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		var st int
		require.NoError(t, tx.QueryRow(ctx, pgstore.ClaimSQL(s), []byte("k"), []byte("t1"), time.Minute, time.Hour).Scan(&st))
		var mode string
		require.NoError(t, tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&mode))
		assert.Equal(t, tc.want, mode, "synchronous_commit in the claim's transaction, DurableClaims %v", tc.durable)
		require.NoError(t, tx.Rollback(ctx))
		// The setting ended with the transaction.
		require.NoError(t, pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&mode))
		assert.Equal(t, "on", mode)
	}
}

// A done mark keeps its claim's forget_at unless its retention ends later
// (so that the mark is a HOT update): it lasts for its retention, whether
// that ends before or after the claim's row would have been forgotten,
// and Prune, which deletes by forget_at, deletes neither it nor the claim
// that takes its key once it is forgotten.
func TestDoneMarkRetention(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	s := newStore(t, pool, pgstore.Options{AbandonedRetention: time.Millisecond, PruneEvery: -1})
	const short = time.Second

	// The mark outlives its claim's lease and AbandonedRetention.
	claim(t, s, "outlives", "t1", short, store.Claimed)
	require.NoError(t, s.Complete(ctx, "outlives", "t1", time.Hour))
	// The mark ends before its claim's row would have been forgotten.
	claim(t, s, "ends first", "t1", time.Hour, store.Claimed)
	require.NoError(t, s.Complete(ctx, "ends first", "t1", short))
	claim(t, s, "ends first", "t2", time.Hour, store.Done)

	time.Sleep(2 * short) // waits for the database's clock
	_, err := s.Prune(ctx, 1000)
	require.NoError(t, err)
	claim(t, s, "outlives", "t2", time.Hour, store.Done)
	got, err := s.Inspect(ctx, "outlives")
	require.NoError(t, err)
	assert.Equal(t, store.Done, got.Status)
	assert.Greater(t, got.TTL, 50*time.Minute, "the mark's TTL")

	claim(t, s, "ends first", "t3", time.Hour, store.Claimed)
	_, err = s.Prune(ctx, 1000)
	require.NoError(t, err)
	claim(t, s, "ends first", "t4", time.Hour, store.Processing)
}

func claim(t *testing.T, s *pgstore.Store, key, token string, lease time.Duration, want store.Status) {
	t.Helper()
	st, err := s.Claim(context.Background(), key, token, lease)
	require.NoError(t, err, "Claim(%q, %q)", key, token)
	require.Equal(t, want, st, "Claim(%q, %q)", key, token)
}

// Migrate of a store whose tables and indexes are all there changes
// nothing and waits for nothing, so that each consumer may call it at its
// start beside running ones: not for a delivery's transaction that holds
// its claim (claimed in its transaction, its function running), nor for
// one that counted a failure. CREATE INDEX IF NOT EXISTS takes its table's
// SHARE lock before it finds the index, which waits for every transaction
// that wrote the table, and every claim queues behind it.
func TestMigrateDoesNotWait(t *testing.T) {
	ctx := context.Background()
	for name, hold := range map[string]func(t *testing.T, f *inboxFixture) (release func()){
		"for a transaction that claimed a key": func(t *testing.T, f *inboxFixture) func() {
			running, done := make(chan struct{}), make(chan struct{})
			handled := make(chan error, 1)
			h := f.stack(pgstore.Handler(f.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
				if err := f.insert(ctx, tx, d); err != nil {
					return err
				}
				close(running)
				<-done
				return nil
			}, pgstore.HandlerOptions{}), middleware.DedupOptions{})
			go func() { handled <- h.Handle(ctx, delivery("held")) }()
			<-running
			return func() {
				close(done)
				require.NoError(t, <-handled)
			}
		},
		"for a transaction that counted a failure": func(t *testing.T, f *inboxFixture) func() {
			tx, err := f.pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tx.Exec(ctx, `INSERT INTO `+strings.TrimSuffix(f.effects, "_effects")+`_failures (key, count, expires_at) VALUES ('\x01', 1, now() + interval '1 hour')`)
			require.NoError(t, err)
			return func() { require.NoError(t, tx.Rollback(ctx)) }
		},
	} {
		t.Run(name, func(t *testing.T) {
			f := newInbox(t, newPool(t))
			requireMigrateWaitsForNothing(t, f.st.Migrate, hold(t, f))
		})
	}
}

// Migrate of a store that lacks one of its indexes makes it again, in
// the table's schema, named or not.
func TestMigrateMakesAMissingIndex(t *testing.T) {
	pool := newPool(t)
	requireMigrateMakesMissingIndexes(t, []string{"_forget_at", "_failures_expires_at"}, func(t *testing.T, _, qualified string) func(context.Context) error {
		t.Cleanup(func() {
			pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+qualified+`, `+qualified+`_failures`)
		})
		return newStore(t, pool, pgstore.Options{Table: qualified}).Migrate
	})
}
