package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// Every test closes its pools and stores: no goroutine outlives it.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newPool returns a pool on the test database, closed when t ends.
func newPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	url := testenv.PostgresURL(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatalf("pgxpool.New(%q): %v", url, err)
	}
	t.Cleanup(pool.Close)
	return pool
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

// newStore returns a migrated store on a table of its own, closed when t
// ends.
func newStore(t testing.TB, pool *pgxpool.Pool, opts pgstore.Options) *pgstore.Store {
	t.Helper()
	if opts.Table == "" {
		opts.Table = uniqueTable(t, pool)
	}
	s := pgstore.New(pool, opts)
	t.Cleanup(s.Close)
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return s
}
