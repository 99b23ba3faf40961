package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// Every test closes its pools and stores: no goroutine outlives it. The
// examples need PostgreSQL, and an example cannot skip itself: without
// one they are skipped here, with a message, and fail under CI=true.
func TestMain(m *testing.M) {
	flag.Parse()
	if err := pingPostgres(); err != nil && !testenv.InCI() {
		fmt.Fprintf(os.Stderr, "skipped: the examples: no PostgreSQL (%v); set DATABASE_URL, and CI=true turns this skip into a failure\n", err)
		skip := "^Example"
		if s := flag.Lookup("test.skip").Value.String(); s != "" {
			skip = s + "|" + skip
		}
		flag.Set("test.skip", skip)
	}
	goleak.VerifyTestMain(m)
}

// pingPostgres connects to the test database and queries it.
func pingPostgres() error {
	url := os.Getenv("DATABASE_URL")
	if url == "" {
		url = testenv.DefaultPostgresURL
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

// newPool returns a pool on the test database, closed when t ends.
func newPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := testenv.PostgresURL(t)
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err, "pgxpool.New(%q)", url)
	t.Cleanup(pool.Close)
	return pool
}

// newPoolWith returns a pool on the test database, with the
// configuration that configure changed, closed when t ends.
func newPoolWith(t testing.TB, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg := newPool(t).Config()
	configure(cfg)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// execModes are the modes in which a pool may send its statements.
var execModes = []pgx.QueryExecMode{
	pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
	pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol,
}

// uniqueTable returns a table name of its own for t, whose tables are
// dropped when t ends: other tests, of other people too, may share the
// database.
func uniqueTable(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	b := make([]byte, 6)
	rand.Read(b)
	name := "rmwtest_" + hex.EncodeToString(b)
	t.Cleanup(func() {
		pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+name+`, `+name+`_failures`)
	})
	return name
}

// newSchema creates a schema of its own, whose name ends in suffix, and
// drops it with what it holds when t ends.
func newSchema(t testing.TB, pool *pgxpool.Pool, suffix string) string {
	t.Helper()
	schema := uniqueTable(t, pool) + suffix
	_, err := pool.Exec(context.Background(), `CREATE SCHEMA `+schema)
	require.NoError(t, err)
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+schema+` CASCADE`) })
	return schema
}

// newStore returns a migrated store on a table of its own, closed when t
// ends.
func newStore(t testing.TB, pool *pgxpool.Pool, opts pgstore.Options) *pgstore.Store {
	t.Helper()
	if opts.Table == "" {
		opts.Table = uniqueTable(t, pool)
	}
	s := pgstore.New(pool, opts)
	t.Cleanup(s.Close)
	require.NoError(t, s.Migrate(context.Background()), "Migrate")
	return s
}

// placements are the two places a table may be named in: the current
// schema, unqualified, and schema, qualified; each returns the schema to
// look the table up in ("" for the current one) and the name to give.
func placements(schema string) map[string]func(table string) (in, qualified string) {
	return map[string]func(table string) (string, string){
		"in the current schema": func(table string) (string, string) { return "", table },
		"schema-qualified":      func(table string) (string, string) { return schema, schema + "." + table },
	}
}

// requireMigrateWaitsForNothing calls migrate, with a deadline of 2 s,
// while something holds the table, then release, and fails t if migrate
// failed (it waited out its deadline).
func requireMigrateWaitsForNothing(t *testing.T, migrate func(context.Context) error, release func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	err := migrate(ctx)
	waited := time.Since(start)
	release()
	require.NoError(t, err, "Migrate waited %s", waited)
}

// requireMigrateMakesMissingIndexes drops, one at a time, each index of a
// table whose name ends in one of suffixes, then calls the Migrate of what
// create made on it, which must make the index again: for a table in the
// current schema, and for one in a schema of its own. create gets the
// table's name, unqualified, and the name to give it, and drops what it
// makes when t ends.
func requireMigrateMakesMissingIndexes(t *testing.T, suffixes []string, create func(t *testing.T, table, qualified string) (migrate func(context.Context) error)) {
	pool := newPool(t)
	ctx := context.Background()
	schema := newSchema(t, pool, "_s")
	for name, qualify := range placements(schema) {
		t.Run(name, func(t *testing.T) {
			for _, suffix := range suffixes {
				table := uniqueTable(t, pool)
				in, qualified := qualify(table)
				migrate := create(t, table, qualified)
				index := table + suffix
				_, err := pool.Exec(ctx, `DROP INDEX `+strings.TrimPrefix(in+"."+index, "."))
				require.NoError(t, err)
				require.NoError(t, migrate(ctx))
				var n int
				require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_indexes
WHERE schemaname = COALESCE(NULLIF($1, ''), current_schema()) AND indexname = $2`, in, index).Scan(&n))
				assert.Equal(t, 1, n, "index %s made again", index)
			}
		})
	}
}
