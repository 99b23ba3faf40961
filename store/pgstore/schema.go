package pgstore

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

// DefaultTable is the table of a [Store] whose options name none.
const DefaultTable = "rabbitmw_inbox"

// A table name is a lower-case SQL identifier, optionally qualified by a
// schema. Quoting makes any name safe in SQL; the rule keeps the names an
// operator types in psql the ones the store uses (no case folding
// surprises), and leaves room for the suffixes of the other names ("_failures_expires_at") within
// PostgreSQL's 63 bytes.
var tableName = regexp.MustCompile(`^([a-z_][a-z0-9_]{0,62}\.)?[a-z_][a-z0-9_]{0,42}$`)

// names holds the quoted names of a store's tables and index.
type names struct {
	schema, table    string // unquoted; schema empty when unqualified
	claims, failures string // quoted, qualified as given
	claimsIndex      string // quoted, unqualified (CREATE INDEX names no schema)
	failuresIndex    string
}

func parseTable(name string) (names, error) {
	if name == "" {
		name = DefaultTable
	}
	if !tableName.MatchString(name) {
		return names{}, fmt.Errorf("table name %q: want a lower-case SQL identifier of at most 43 characters, optionally schema-qualified (schema.table)", name)
	}
	var n names
	if schema, table, ok := strings.Cut(name, "."); ok {
		n.schema, n.table = schema, table
	} else {
		n.table = name
	}
	qualified := func(table string) string {
		if n.schema == "" {
			return pgx.Identifier{table}.Sanitize()
		}
		return pgx.Identifier{n.schema, table}.Sanitize()
	}
	n.claims = qualified(n.table)
	n.failures = qualified(n.table + "_failures")
	ix := n.indexNames()
	n.claimsIndex = pgx.Identifier{ix[0]}.Sanitize()
	n.failuresIndex = pgx.Identifier{ix[1]}.Sanitize()
	return n, nil
}

// indexNames returns the names of the tables' indexes, unquoted: on the
// claims' forget_at, and on the failures' expires_at.
func (n names) indexNames() []string {
	return []string{n.table + "_forget_at", n.table + "_failures_expires_at"}
}

// Schema returns the SQL that [Store.Migrate] runs to create the store's
// tables, for teams that run their own migrations: table is the name given
// in [Options].Table ("" for [DefaultTable]). It panics if table is not a
// valid name, as New does. The statements are idempotent, but each
// CREATE INDEX IF NOT EXISTS takes its table's SHARE lock even when the
// index is there, which waits for the deliveries' transactions and holds
// their claims behind it: run them once, as a migration, not at each
// start of a consumer ([Store.Migrate] runs them only where something is
// missing).
func Schema(table string) string {
	n, err := parseTable(table)
	if err != nil {
		panic("pgstore: Schema: " + err.Error())
	}
	return n.schemaSQL()
}

func (n names) schemaSQL() string {
	return `-- Claims and done marks of message keys, one row per key.
--   token       the owner's token while the key is processing; NULL once done
--   lease_until the end of the owner's lease, or of the done mark's retention
--   forget_at   when the row may be deleted, and, for a claim, is forgotten
--               (as if absent): lease_until plus the abandoned retention, so
--               that a claim whose lease ran out is reported abandoned until
--               then; -infinity once a claim found it abandoned (token NULL,
--               lease_until -infinity too). A done mark is forgotten at its
--               lease_until, and keeps its claim's forget_at unless that is
--               earlier, so that the mark is a HOT update
-- Keys and tokens are bytea: a message key may hold any bytes, NUL included.
CREATE TABLE IF NOT EXISTS ` + n.claims + ` (
    key         bytea       PRIMARY KEY,
    token       bytea,
    lease_until timestamptz NOT NULL,
    forget_at   timestamptz NOT NULL
);
-- For the deletion of forgotten rows (Prune).
CREATE INDEX IF NOT EXISTS ` + n.claimsIndex + ` ON ` + n.claims + ` (forget_at);
-- Failure counters of message keys.
CREATE TABLE IF NOT EXISTS ` + n.failures + ` (
    key        bytea       PRIMARY KEY,
    count      bigint      NOT NULL,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS ` + n.failuresIndex + ` ON ` + n.failures + ` (expires_at);
`
}

// The columns each table must have, with their types as
// information_schema.columns spells them, by the suffix of the table's
// name. In order: the claims table is checked first, so that a table of
// that name made by something else is reported as such, not as a missing
// failures table.
var wantColumns = []struct {
	suffix  string
	columns []column
}{
	{"", []column{
		{"key", "bytea"}, {"token", "bytea"},
		{"lease_until", "timestamp with time zone"}, {"forget_at", "timestamp with time zone"},
	}},
	{"_failures", []column{
		{"key", "bytea"}, {"count", "bigint"}, {"expires_at", "timestamp with time zone"},
	}},
}

type column struct{ name, typ string }

// ErrSchema is returned, wrapped, by [Store.Check] and [Store.Migrate] when a
// table of the store is missing or exists with other columns.
var ErrSchema = errors.New("pgstore: table schema does not match")

// A querier is a pool or a transaction.
type querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// checkSchema compares the store's tables with wantColumns. Missing tables
// are an error unless allowMissing.
func (s *Store) checkSchema(ctx context.Context, q querier, allowMissing bool) error {
	for _, w := range wantColumns {
		table, want := s.n.table+w.suffix, w.columns
		rows, err := q.Query(ctx, `
SELECT column_name::text, data_type::text FROM information_schema.columns
WHERE table_name = $1 AND table_schema = COALESCE(NULLIF($2, ''), current_schema())
ORDER BY ordinal_position`, table, s.n.schema)
		if err != nil {
			return s.unreachable("check schema", err)
		}
		var got []column
		for rows.Next() {
			var c column
			if err := rows.Scan(&c.name, &c.typ); err != nil {
				rows.Close()
				return s.unreachable("check schema", err)
			}
			got = append(got, c)
		}
		if err := rows.Err(); err != nil {
			return s.unreachable("check schema", err)
		}
		if len(got) == 0 && allowMissing {
			continue
		}
		if len(got) == 0 {
			return fmt.Errorf("%w: table %s does not exist: call Store.Migrate, or run the SQL of pgstore.Schema(%q) in your migrations", ErrSchema, table, s.table)
		}
		if !sameColumns(got, want) {
			return fmt.Errorf("%w: table %s has columns (%s); the store needs (%s): it was made by something else, or by another version of pgstore. Give Options.Table another name, or drop the table (DROP TABLE %s) and call Store.Migrate",
				ErrSchema, table, columnList(got), columnList(want), table)
		}
	}
	return nil
}

func sameColumns(got, want []column) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range got {
		if got[i] != want[i] {
			return false
		}
	}
	return true
}

func columnList(cs []column) string {
	s := make([]string, len(cs))
	for i, c := range cs {
		s[i] = c.name + " " + c.typ
	}
	return strings.Join(s, ", ")
}
