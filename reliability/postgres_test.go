//go:build reliability

package reliability_test

// The PostgreSQL inbox in the suite: a run whose consumers use pgstore
// (-store postgres://…) keeps its store in a table of its own and counts
// effects in <table>_effects, rows that the handler inserts in the
// transaction that commits the done mark.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// pgEffects reads the effects of a run from PostgreSQL.
type pgEffects struct {
	pool    *pgxpool.Pool
	table   string // the store's
	effects string
}

// usePostgres makes r's effects count in the database at url, in tables of
// its own (dropped when the test ends), and returns the consumer options
// that select the inbox there.
func (r *run) usePostgres(url string, o consumerOpts) consumerOpts {
	r.t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	require.NoError(r.t, err, "pgxpool.New(%q)", url)
	b := make([]byte, 6)
	rand.Read(b)
	pe := &pgEffects{pool: pool, table: "rmwrel_" + r.scenario + "_" + hex.EncodeToString(b)}
	pe.effects = pe.table + "_effects"
	r.t.Cleanup(func() {
		pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+pe.table+`, `+pe.table+`_failures, `+pe.effects)
		pool.Close()
	})
	st := pgstore.New(pool, pgstore.Options{Table: pe.table})
	defer st.Close()
	require.NoError(r.t, st.Migrate(ctx))
	_, err = pool.Exec(ctx, `CREATE TABLE `+pe.effects+` (seq bigserial PRIMARY KEY, id text NOT NULL, consumer text NOT NULL)`)
	require.NoError(r.t, err)
	r.pg = pe
	r.t.Logf("PostgreSQL inbox: table %s, effects in %s", pe.table, pe.effects)
	o.storeAddr, o.storePrefix = url, pe.table
	return o
}

// count returns the effects' total or distinct count (see run.count).
func (pe *pgEffects) count(ctx context.Context, t *testing.T, name string) int64 {
	q := `SELECT count(*) FROM ` + pe.effects
	if name == "distinct" {
		q = `SELECT count(DISTINCT id) FROM ` + pe.effects
	}
	var n int64
	if err := pe.pool.QueryRow(ctx, q).Scan(&n); err != nil {
		t.Logf("counting effects: %v", err)
	}
	return n
}

// log returns who applied each message's effect, in commit order (near
// enough: in order of the sequence numbers taken).
func (pe *pgEffects) log(ctx context.Context) (map[string][]string, error) {
	rows, err := pe.pool.Query(ctx, `SELECT id, consumer FROM `+pe.effects+` ORDER BY seq`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	by := map[string][]string{}
	for rows.Next() {
		var id, by1 string
		if err := rows.Scan(&id, &by1); err != nil {
			return nil, err
		}
		by[id] = append(by[id], by1)
	}
	return by, rows.Err()
}
