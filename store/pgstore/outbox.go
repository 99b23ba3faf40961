package pgstore

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
)

// DefaultOutboxTable is the table of an [Outbox] whose options name none.
const DefaultOutboxTable = "rabbitmw_outbox"

// ErrInvalidMessage is returned, wrapped, by [Outbox.Write] and
// [Outbox.WriteSQL] for a message that could never be sent: a name or
// property that AMQP 0-9-1 cannot carry, or a header of a type it does not
// send; an Expiration that RabbitMQ refuses (not a whole number of
// milliseconds, negative, or over ten years), which would close the
// relay's channel and park the rows in flight on it; a CC or BCC header
// (whose strings RabbitMQ routes the message by, besides its routing key)
// that is not an array of strings: RabbitMQ refuses one of another type
// in the same way, and skips an element that is not a string; or one that
// the outbox table cannot hold: an exchange, routing key, header name or
// property (MessageId, CorrelationId, ContentType, …) that holds a NUL
// byte or bytes that are not UTF-8, as PostgreSQL's text holds neither.
// (A header's string value may hold any bytes: it is stored as its bytes
// and sent as it was written.) Nothing is written, and the caller's
// transaction is left as it was.
var ErrInvalidMessage = errors.New("pgstore: invalid outbox message")

// OutboxOptions configures an [Outbox]. The zero value selects the
// defaults.
type OutboxOptions struct {
	// Table is the name of the outbox table: a lower-case SQL identifier
	// of at most 43 characters, optionally schema-qualified. Default
	// [DefaultOutboxTable]. It is also the name of the channel on which
	// Write notifies the relays (LISTEN/NOTIFY), cut to its first 63
	// bytes, PostgreSQL's limit.
	Table string
	// Inject, if set, is called by Write with the writer's context and an
	// empty map, into which it writes the writer's trace context (the W3C
	// traceparent and tracestate, as an OpenTelemetry propagator does).
	// The map is stored with the row, and the relay hands it back when it
	// sends the message, so that the send joins the writer's trace.
	// otelmw's Telemetry.InjectMap is one. An entry whose name or value
	// is not UTF-8 text without NUL bytes, which the table cannot hold,
	// is dropped (the others are kept), so that the trace context never
	// fails the write; Inject changes nothing of the message.
	Inject func(ctx context.Context, carrier map[string]string)
}

// Outbox is a transactional outbox in PostgreSQL: a table of messages to
// publish, written in the caller's transaction ([Outbox.Write],
// [Outbox.WriteSQL]) and sent to RabbitMQ after the commit by a relay
// (package github.com/rabbitmw/rabbitmw/store/pgstore/relay), which
// publishes each row with confirms and marks it sent only once its
// confirm came. A transaction that rolls back leaves no message; one that
// commits leaves one that is sent even if the writer dies at once.
//
// Each row is in one of three states:
//
//	pending  written, not yet confirmed by RabbitMQ (a row that RabbitMQ
//	         nacked, or did not confirm, stays pending and is sent again,
//	         not before its retry_at)
//	sent     confirmed; deleted once the relay's retention has passed
//	parked   RabbitMQ returned it (no queue bound for it), or refused it
//	         in a way that sending again cannot mend; kept, with the
//	         reason, until an operator sends it back to pending (Retry,
//	         or rabbitmw outbox retry)
//
// The message's MessageId is fixed when it is written, so every send of
// a row, after a relay's crash or a lost confirm, carries the same id:
// the consumers' Dedup absorbs the copies. [OutboxSchema] gives the
// table's SQL; [Outbox.Migrate] creates it.
type Outbox struct {
	pool   *pgxpool.Pool
	table  string // as given
	n      outboxNames
	inject func(context.Context, map[string]string)

	writeSQL string
}

// maxChannel is the most bytes of a channel name (NAMEDATALEN - 1).
const maxChannel = 63

type outboxNames struct {
	name          string // unquoted, qualified as given
	schema, table string // unquoted; schema empty when unqualified
	qualified     string // quoted
	channel       string // unquoted: the NOTIFY channel (pg_notify's argument)
	pendingIndex  string // quoted, unqualified
	sentIndex     string
	parkedIndex   string
}

func parseOutboxTable(name string) (outboxNames, error) {
	if name == "" {
		name = DefaultOutboxTable
	}
	if !tableName.MatchString(name) {
		return outboxNames{}, fmt.Errorf("outbox table name %q: want a lower-case SQL identifier of at most 43 characters, optionally schema-qualified (schema.table)", name)
	}
	n := outboxNames{name: name}
	if schema, table, ok := strings.Cut(name, "."); ok {
		n.schema, n.table = schema, table
		n.qualified = pgx.Identifier{schema, table}.Sanitize()
	} else {
		n.table = name
		n.qualified = pgx.Identifier{name}.Sanitize()
	}
	// PostgreSQL's channel names, as its identifiers, hold at most 63
	// bytes: pg_notify refuses a longer one. Two tables whose names share
	// their first 63 bytes share a channel, which costs their relays a
	// wake-up that finds nothing.
	n.channel = name[:min(len(name), maxChannel)]
	ix := n.indexNames()
	n.pendingIndex = pgx.Identifier{ix[0]}.Sanitize()
	n.sentIndex = pgx.Identifier{ix[1]}.Sanitize()
	n.parkedIndex = pgx.Identifier{ix[2]}.Sanitize()
	return n, nil
}

// indexNames returns the names of the table's indexes, unquoted: on the
// pending rows, the sent rows' sent_at, and the parked rows.
func (n outboxNames) indexNames() []string {
	return []string{n.table + "_pending", n.table + "_sent_at", n.table + "_parked"}
}

// NewOutbox returns the Outbox of table opts.Table in pool's database,
// which the caller keeps and closes. It does not reach the database: call
// [Outbox.Migrate] or [Outbox.Check] at start-up. It panics if pool is nil
// or opts.Table is not a valid name.
func NewOutbox(pool *pgxpool.Pool, opts OutboxOptions) *Outbox {
	if pool == nil {
		panic("pgstore: NewOutbox: nil pool")
	}
	n, err := parseOutboxTable(opts.Table)
	if err != nil {
		panic("pgstore: NewOutbox: " + err.Error())
	}
	o := &Outbox{pool: pool, table: opts.Table, n: n, inject: opts.Inject}
	// One statement, one round trip: the row and the notification, which
	// PostgreSQL delivers only if the transaction commits, once per
	// transaction whatever the number of rows it wrote.
	o.writeSQL = `WITH w AS (
  INSERT INTO ` + n.qualified + ` (message_id, exchange, routing_key, properties, body, trace)
  VALUES ($1, $2, $3, $4, $5, $6) RETURNING id
)
SELECT pg_notify($7, '') FROM w`
	return o
}

// Table returns the outbox's table name as given in [OutboxOptions]
// ("" for [DefaultOutboxTable]).
func (o *Outbox) Table() string { return o.table }

// Pool returns the pool given to NewOutbox.
func (o *Outbox) Pool() *pgxpool.Pool { return o.pool }

// Channel returns the name of the channel on which Write notifies the
// relays: LISTEN on it to wake up when a transaction that wrote a message
// commits. It is the table's name as given (or [DefaultOutboxTable]), cut
// to its first 63 bytes.
func (o *Outbox) Channel() string { return o.n.channel }

// OutboxSchema returns the SQL that [Outbox.Migrate] runs to create the
// outbox table, for teams that run their own migrations: table is the name
// given in [OutboxOptions].Table ("" for [DefaultOutboxTable]). It panics if
// table is not a valid name. The statements are idempotent, but its ALTER
// TABLE (for a table made before the retry_at column) takes the table's
// ACCESS EXCLUSIVE lock each time it runs: run them once, as a migration,
// not at each start of a process beside running relays.
func OutboxSchema(table string) string {
	n, err := parseOutboxTable(table)
	if err != nil {
		panic("pgstore: OutboxSchema: " + err.Error())
	}
	return n.schemaSQL(true)
}

// schemaSQL returns the SQL of OutboxSchema; without addRetryAt, it leaves
// out the ALTER TABLE that adds retry_at to a table made before it (see
// Migrate).
func (n outboxNames) schemaSQL(addRetryAt bool) string {
	alter := ""
	if addRetryAt {
		alter = "-- A table made before retry_at was added gets it here.\n" + n.addRetryAtSQL() + "\n"
	}
	return `-- Messages to publish, written in the business transaction, sent by the relay.
--   message_id  the message's AMQP message-id, fixed when it was written
--   properties  the other AMQP properties and the headers, as JSON (typed header values)
--   trace       the writer's trace context (W3C traceparent, tracestate), or NULL
--   state       pending, sent (confirmed) or parked (returned, or refused for good)
--   attempts    sends that ended without a confirm (nacked, or none came) or with a refusal
--   error       why the row is parked, or the last failed send
--   retry_at    not before when a pending row whose send failed is sent again; NULL: at once
CREATE TABLE IF NOT EXISTS ` + n.qualified + ` (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id  text        NOT NULL,
    exchange    text        NOT NULL,
    routing_key text        NOT NULL,
    properties  jsonb       NOT NULL,
    body        bytea       NOT NULL,
    trace       jsonb,
    state       text        NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'parked')),
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts    integer     NOT NULL DEFAULT 0,
    sent_at     timestamptz,
    error       text,
    retry_at    timestamptz
);
` + alter + `-- The relay's scan: pending rows in the order they were written.
CREATE INDEX IF NOT EXISTS ` + n.pendingIndex + ` ON ` + n.qualified + ` (id) WHERE state = 'pending';
-- The retention's deletion of sent rows.
CREATE INDEX IF NOT EXISTS ` + n.sentIndex + ` ON ` + n.qualified + ` (sent_at) WHERE state = 'sent';
-- Parked rows, for the operator's list and count.
CREATE INDEX IF NOT EXISTS ` + n.parkedIndex + ` ON ` + n.qualified + ` (id) WHERE state = 'parked';
`
}

var outboxColumns = []column{
	{"id", "bigint"}, {"message_id", "text"}, {"exchange", "text"}, {"routing_key", "text"},
	{"properties", "jsonb"}, {"body", "bytea"}, {"trace", "jsonb"}, {"state", "text"},
	{"created_at", "timestamp with time zone"}, {"attempts", "integer"},
	{"sent_at", "timestamp with time zone"}, {"error", "text"},
	{"retry_at", "timestamp with time zone"},
}

// addRetryAtSQL adds the retry_at column to a table made before it was
// added (by pgstore's first versions of the outbox).
func (n outboxNames) addRetryAtSQL() string {
	return `ALTER TABLE ` + n.qualified + ` ADD COLUMN IF NOT EXISTS retry_at timestamptz;`
}

// Migrate creates the outbox table and its indexes if they do not exist
// (the SQL of [OutboxSchema]), adds the retry_at column to a table made
// before it was added, then checks them as [Outbox.Check] does. On a
// table that has them all, it changes nothing and takes no lock on it, so
// that a process may call it at each start beside running writers and
// relays. Concurrent calls, from several processes, are serialised by an
// advisory lock.
func (o *Outbox) Migrate(ctx context.Context) error {
	var schemaErr error
	err := pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext($1))`, "rabbitmw pgstore "+o.n.qualified); err != nil {
			return err
		}
		err := o.checkSchema(ctx, tx, true)
		if err != nil && !errors.Is(err, errNoRetryAt) {
			schemaErr = err
			return err
		}
		// The schema's statements lock the table even when they find
		// what they would make there: CREATE INDEX IF NOT EXISTS takes
		// its SHARE lock (which waits for the transactions that wrote
		// rows), ALTER TABLE its ACCESS EXCLUSIVE lock (which waits for
		// every transaction on it, a dispatch awaiting its confirms
		// too), and every Write and dispatch waits behind them. So they
		// run only where something is missing, and the ALTER TABLE only
		// on a table without retry_at.
		if err == nil {
			var indexes int
			if err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_indexes
WHERE schemaname = COALESCE(NULLIF($1, ''), current_schema()) AND tablename = $2 AND indexname = ANY($3)`,
				o.n.schema, o.n.table, o.n.indexNames()).Scan(&indexes); err != nil {
				return err
			}
			if indexes == len(o.n.indexNames()) {
				return nil
			}
		}
		_, err = tx.Exec(ctx, o.n.schemaSQL(err != nil))
		return err
	})
	switch {
	case schemaErr != nil:
		return schemaErr
	case err != nil:
		return o.unreachable("migrate", err)
	}
	return o.checkSchema(ctx, o.pool, false)
}

// Check reports whether the database answers and the outbox table exists
// with the columns the outbox needs. A schema mismatch wraps [ErrSchema];
// a table made before the retry_at column was added is one (call
// Migrate, or run the ALTER TABLE that the error gives).
func (o *Outbox) Check(ctx context.Context) error {
	if err := o.pool.Ping(ctx); err != nil {
		return o.unreachable("check", err)
	}
	return o.checkSchema(ctx, o.pool, false)
}

func (o *Outbox) checkSchema(ctx context.Context, q querier, allowMissing bool) error {
	rows, err := q.Query(ctx, `
SELECT column_name::text, data_type::text FROM information_schema.columns
WHERE table_name = $1 AND table_schema = COALESCE(NULLIF($2, ''), current_schema())
ORDER BY ordinal_position`, o.n.table, o.n.schema)
	if err != nil {
		return o.unreachable("check schema", err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (c column, err error) {
		err = r.Scan(&c.name, &c.typ)
		return c, err
	})
	if err != nil {
		return o.unreachable("check schema", err)
	}
	switch {
	case len(got) == 0 && allowMissing:
		return nil
	case len(got) == 0:
		return fmt.Errorf("%w: table %s does not exist: call Outbox.Migrate, or run the SQL of pgstore.OutboxSchema(%q) in your migrations", ErrSchema, o.n.name, o.table)
	case sameColumns(got, outboxColumns[:len(outboxColumns)-1]):
		return fmt.Errorf("%w: table %s %w: call Outbox.Migrate, or run in your migrations: %s",
			ErrSchema, o.n.name, errNoRetryAt, o.n.addRetryAtSQL())
	case !sameColumns(got, outboxColumns):
		return fmt.Errorf("%w: table %s has columns (%s); the outbox needs (%s): it was made by something else, or by another version of pgstore. Give OutboxOptions.Table another name, or drop the table and call Outbox.Migrate",
			ErrSchema, o.n.name, columnList(got), columnList(outboxColumns))
	}
	return nil
}

// errNoRetryAt is wrapped by checkSchema's error for a table that lacks
// only the retry_at column, which Migrate adds.
var errNoRetryAt = errors.New("has no column retry_at (it was made by an earlier version of pgstore)")

func (o *Outbox) unreachable(op string, err error) error {
	cfg := o.pool.Config().ConnConfig
	return fmt.Errorf("pgstore: outbox %s: PostgreSQL at %s:%d, database %q: %w", op, cfg.Host, cfg.Port, cfg.Database, err)
}

// Write writes msg, to be published to exchange with routing key key,
// into the outbox in tx, the caller's transaction: the message is sent
// once tx commits, and never if it rolls back. It returns the message's
// MessageId: msg's own, or, if it has none, a new random one of 32 hex
// digits, which every send of the row carries. A DeliveryMode of 0 is
// sent as persistent, as [broker.Broker.Publish] does.
//
// Write runs one statement in tx: the INSERT, and a notification to the
// relays, which PostgreSQL delivers at the commit. It is usable in the
// transaction of [Handler] (the effect of a delivery and the messages it
// causes then commit together, with the delivery's done mark) and in any
// other code's transaction. A message that could never be sent returns an
// error wrapping [ErrInvalidMessage] before anything is written. Like any
// statement, Write must not be called on one transaction from two
// goroutines at once.
//
// The relay publishes with the mandatory flag: a message that reaches no
// queue is parked, not dropped.
func (o *Outbox) Write(ctx context.Context, tx pgx.Tx, exchange, key string, msg amqp.Publishing) (string, error) {
	args, id, err := o.row(ctx, exchange, key, msg)
	if err != nil {
		return "", err
	}
	if _, err := tx.Exec(ctx, o.writeSQL, args...); err != nil {
		return "", fmt.Errorf("pgstore: outbox write of %q: %w", id, err)
	}
	return id, nil
}

// WriteSQL is [Outbox.Write] on database/sql, for code written against
// *sql.Tx: tx must be a transaction of the outbox's database, through
// pgx's driver (stdlib).
func (o *Outbox) WriteSQL(ctx context.Context, tx *sql.Tx, exchange, key string, msg amqp.Publishing) (string, error) {
	args, id, err := o.row(ctx, exchange, key, msg)
	if err != nil {
		return "", err
	}
	if _, err := tx.ExecContext(ctx, o.writeSQL, args...); err != nil {
		return "", fmt.Errorf("pgstore: outbox write of %q: %w", id, err)
	}
	return id, nil
}

// row returns the arguments of writeSQL for msg, and its message id.
func (o *Outbox) row(ctx context.Context, exchange, key string, msg amqp.Publishing) ([]any, string, error) {
	if msg.MessageId == "" {
		msg.MessageId = newMessageID()
	}
	if msg.DeliveryMode == 0 {
		msg.DeliveryMode = amqp.Persistent
	}
	props, err := encodeProperties(exchange, key, msg)
	if err != nil {
		return nil, "", fmt.Errorf("%w: message %q: %w", ErrInvalidMessage, msg.MessageId, err)
	}
	// The JSON goes as text: pgx sends a []byte as bytea, which a jsonb
	// column takes only in the modes that describe the statement first
	// (not in the exec and simple-protocol modes of a pooler in
	// transaction mode).
	var trace *string
	if o.inject != nil {
		carrier := map[string]string{}
		o.inject(ctx, carrier)
		// An entry that jsonb cannot hold would fail the INSERT, and with
		// it the caller's transaction: a trace must never cost the write.
		maps.DeleteFunc(carrier, func(k, v string) bool { return !isText(k) || !isText(v) })
		if len(carrier) > 0 {
			b, _ := json.Marshal(carrier) // a map of strings always encodes
			s := string(b)
			trace = &s
		}
	}
	body := msg.Body
	if body == nil {
		body = []byte{} // the column is NOT NULL; an empty body is a message
	}
	return []any{msg.MessageId, exchange, key, string(props), body, trace, o.n.channel}, msg.MessageId, nil
}

// newMessageID returns 32 random hex digits, as the broker gives a message
// that has no id.
func newMessageID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}
