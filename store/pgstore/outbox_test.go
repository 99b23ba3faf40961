package pgstore_test

import (
	"context"
	"errors"
	"math"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// newOutbox returns a migrated outbox on a table of its own, dropped when
// t ends.
func newOutbox(t *testing.T, pool *pgxpool.Pool, opts pgstore.OutboxOptions) *pgstore.Outbox {
	t.Helper()
	if opts.Table == "" {
		opts.Table = uniqueTable(t, pool) + "_outbox"
		t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+opts.Table) })
	}
	ob := pgstore.NewOutbox(pool, opts)
	require.NoError(t, ob.Migrate(context.Background()))
	return ob
}

// write writes msg in a transaction of its own, committed.
func write(t *testing.T, pool *pgxpool.Pool, ob *pgstore.Outbox, key string, msg amqp.Publishing) string {
	t.Helper()
	var id string
	require.NoError(t, pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
		var err error
		id, err = ob.Write(context.Background(), tx, "", key, msg)
		return err
	}))
	return id
}

// collect dispatches once and returns what send was given, answering each
// message with answer.
func collect(t *testing.T, ob *pgstore.Outbox, limit int, answer func(pgstore.OutboxMessage) pgstore.OutboxResult) ([]pgstore.OutboxMessage, pgstore.DispatchResult) {
	t.Helper()
	var got []pgstore.OutboxMessage
	res, err := ob.Dispatch(context.Background(), pgstore.DispatchOptions{Limit: limit}, func(_ context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
		got = append(got, msgs...)
		for i := range msgs {
			results[i] = answer(msgs[i])
		}
	})
	require.NoError(t, err)
	return got, res
}

func sent(pgstore.OutboxMessage) pgstore.OutboxResult { return pgstore.OutboxResult{Sent: true} }

// Every property and every header type that AMQP carries comes back from
// the table as it was written, with the id given at write time.
func TestOutboxWriteKeepsTheMessage(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{Inject: func(_ context.Context, c map[string]string) {
		c["traceparent"] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	}})
	ts := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
	msg := amqp.Publishing{
		ContentType: "application/json", ContentEncoding: "gzip", Priority: 3,
		CorrelationId: "c1", ReplyTo: "replies", Expiration: "60000", Timestamp: ts,
		Type: "order.paid", UserId: "guest", AppId: "shop",
		Headers: amqp.Table{
			"bool": true, "i8": int8(-8), "u8": uint8(8), "i16": int16(-16), "u16": uint16(16),
			"i32": int32(-32), "u32": uint32(32), "i64": int64(-1 << 62), "int": 7,
			"f32": float32(1.5), "f64": 2.25, "s": "text", "b": []byte{0, 1, 2}, "ts": ts,
			"dec": amqp.Decimal{Scale: 2, Value: 1234}, "nil": nil,
			"table": amqp.Table{"inner": "x", "deeper": amqp.Table{"n": int32(1)}},
			"array": []any{"a", int64(2), amqp.Table{"k": false}},
		},
		Body: []byte(`{"order":1}`),
	}
	id := write(t, pool, ob, "shipments", msg)
	assert.Len(t, id, 32, "a message without an id gets one when written")

	got, res := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, pgstore.DispatchResult{Taken: 1, Sent: 1}, res)
	m := got[0]
	assert.Equal(t, "", m.Exchange)
	assert.Equal(t, "shipments", m.Key)
	assert.Equal(t, map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, m.Trace)
	want := msg
	want.MessageId, want.DeliveryMode = id, amqp.Persistent
	want.Headers = amqp.Table{}
	for k, v := range msg.Headers {
		want.Headers[k] = v
	}
	want.Headers["int"] = int32(7) // amqp091 sends an int as an int32
	assert.Equal(t, want, m.Publishing)
}

// A message that the outbox cannot hold or AMQP cannot carry is refused
// with ErrInvalidMessage, and the caller's transaction goes on. Names and
// properties are text in the table (PostgreSQL's text and jsonb hold no
// NUL, and only UTF-8): one that is not is refused, not changed.
func TestOutboxWriteRefusesWhatCannotBeSent(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	for name, tc := range map[string]struct {
		exchange, key string
		msg           amqp.Publishing
	}{
		"a header of a type AMQP lacks":          {key: "q", msg: amqp.Publishing{Headers: amqp.Table{"x": struct{}{}}}},
		"an int over 32 bits":                    {key: "q", msg: amqp.Publishing{Headers: amqp.Table{"x": 1 << 40}}},
		"a long correlation id":                  {key: "q", msg: amqp.Publishing{CorrelationId: strings.Repeat("c", 256)}},
		"a NaN":                                  {key: "q", msg: amqp.Publishing{Headers: amqp.Table{"x": []any{float64NaN()}}}},
		"a NUL in the message id":                {key: "q", msg: amqp.Publishing{MessageId: "id\x00"}},
		"a NUL in the exchange":                  {exchange: "ex\x00", key: "q"},
		"a routing key that is not UTF-8":        {key: "q\xff"},
		"a NUL in the correlation id":            {key: "q", msg: amqp.Publishing{CorrelationId: "c\x00"}},
		"a content type that is not UTF-8":       {key: "q", msg: amqp.Publishing{ContentType: "text/\xff"}},
		"a NUL in a header name":                 {key: "q", msg: amqp.Publishing{Headers: amqp.Table{"x\x00": "v"}}},
		"a header name that is not UTF-8":        {key: "q", msg: amqp.Publishing{Headers: amqp.Table{"x\xff": "v"}}},
		"a nested header name that is not UTF-8": {key: "q", msg: amqp.Publishing{Headers: amqp.Table{"t": amqp.Table{"\xfe": int32(1)}}}},
		// RabbitMQ refuses these by closing the channel, which would park
		// the row and the rows in flight beside it.
		"an expiration that is not milliseconds": {key: "q", msg: amqp.Publishing{Expiration: "60s"}},
		"a negative expiration":                  {key: "q", msg: amqp.Publishing{Expiration: "-1"}},
		"an expiration over ten years":           {key: "q", msg: amqp.Publishing{Expiration: "315360000001"}},
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := pool.Begin(context.Background())
			require.NoError(t, err)
			defer tx.Rollback(context.Background())
			_, err = ob.Write(context.Background(), tx, tc.exchange, tc.key, tc.msg)
			require.ErrorIs(t, err, pgstore.ErrInvalidMessage)
			// The transaction is untouched: it still commits.
			_, err = tx.Exec(context.Background(), `SELECT 1`)
			require.NoError(t, err)
		})
	}
	s, err := ob.Stats(context.Background())
	require.NoError(t, err)
	assert.Zero(t, s.Pending)
}

// RabbitMQ routes a message by the strings of its CC and BCC headers too
// (sender-selected distribution), which must be arrays of strings: it
// refuses one of another type by closing the channel (the relay's, with
// the publishes in flight beside it), and skips an element that is not a
// string, so that the message misses a queue. Write refuses both, naming
// the header, before anything is written. An array of strings, empty or
// not UTF-8, and a header of another name, are written.
func TestOutboxWriteRefusesSenderKeysThatAreNotStrings(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	ctx := context.Background()
	for name, tc := range map[string]struct {
		header string
		v      any
	}{
		"a CC string":     {"CC", "audit"},
		"a BCC string":    {"BCC", "audit"},
		"a CC table":      {"CC", amqp.Table{"audit": true}},
		"a void CC":       {"CC", nil},
		"a CC of bytes":   {"CC", []byte("audit")},
		"an int in CC":    {"CC", []any{"audit", int32(7)}},
		"bytes in BCC":    {"BCC", []any{[]byte("audit")}},
		"an array in BCC": {"BCC", []any{[]any{"audit"}}},
		"a void in CC":    {"CC", []any{nil}},
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			headers := amqp.Table{tc.header: tc.v}
			if tc.header == "CC" {
				headers["BCC"] = []any{"bcc"}
			}
			_, err = ob.Write(ctx, tx, "", "q", amqp.Publishing{Headers: headers})
			require.ErrorIs(t, err, pgstore.ErrInvalidMessage)
			assert.Contains(t, err.Error(), strconv.Quote(tc.header), "the error names the header")
			_, err = tx.Exec(ctx, `SELECT 1`)
			require.NoError(t, err, "the transaction goes on")
		})
	}
	s, err := ob.Stats(ctx)
	require.NoError(t, err)
	assert.Zero(t, s.Pending, "nothing was written")

	good := amqp.Table{
		"CC": []any{"audit", "caf\xe9"}, "BCC": []any{},
		"cc": "not routed by", "nested": amqp.Table{"CC": "not routed by"},
	}
	write(t, pool, ob, "q", amqp.Publishing{Headers: good})
	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, good, got[0].Publishing.Headers)
}

func float64NaN() float64 { var z float64; return z / z }

// A message at the limits of what AMQP carries and amqp091 reads back,
// as broker.Broker.Publish sends it, is written and read back whole:
// tables and arrays nested 32 deep, 8192 entries, names of 255 bytes;
// one nested a level deeper is refused.
func TestOutboxWriteTakesMessagesAtTheLimits(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	nest := func(depth int, wrap func(any) any) any {
		v := any("bottom")
		for range depth {
			v = wrap(v)
		}
		return v
	}
	inTable := func(v any) any { return amqp.Table{"d": v} }
	inArray := func(v any) any { return []any{v} }
	wide := amqp.Table{}
	for i := range 8192 {
		wide[strconv.Itoa(i)] = nil
	}
	headers := amqp.Table{
		"tables": nest(32, inTable), "arrays": nest(32, inArray), "wide": wide,
		strings.Repeat("k", 255): "v",
	}
	write(t, pool, ob, "q", amqp.Publishing{MessageId: strings.Repeat("i", 255), Headers: headers})
	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, headers, got[0].Publishing.Headers)

	for name, h := range map[string]amqp.Table{"tables": {"tables": nest(33, inTable)}, "arrays": {"arrays": nest(33, inArray)}} {
		tx, err := pool.Begin(context.Background())
		require.NoError(t, err)
		_, err = ob.Write(context.Background(), tx, "", "q", amqp.Publishing{Headers: h})
		assert.ErrorIs(t, err, pgstore.ErrInvalidMessage, "%s nested 33 deep", name)
		require.NoError(t, tx.Rollback(context.Background()))
	}
}

// A float header of negative zero is sent as negative zero: jsonb keeps
// numbers as numeric, which has no sign for zero.
func TestOutboxWriteKeepsNegativeZero(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	write(t, pool, ob, "q", amqp.Publishing{Headers: amqp.Table{
		"f64": math.Copysign(0, -1), "f32": float32(math.Copysign(0, -1)), "in array": []any{math.Copysign(0, -1)},
	}})
	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	h := got[0].Publishing.Headers
	require.IsType(t, float64(0), h["f64"])
	assert.True(t, math.Signbit(h["f64"].(float64)), "f64: %v", h["f64"])
	require.IsType(t, float32(0), h["f32"])
	assert.True(t, math.Signbit(float64(h["f32"].(float32))), "f32: %v", h["f32"])
	require.IsType(t, []any{}, h["in array"])
	assert.True(t, math.Signbit(h["in array"].([]any)[0].(float64)), "in array: %v", h["in array"])
}

// A timestamp, the Timestamp property or a header, keeps its instant
// whatever its location: JSON's RFC 3339 offsets hold whole minutes, so a
// location whose offset has seconds (local mean time, as Go's zone data
// gives for dates before a zone's standard time, or a FixedZone) must not
// move it by those seconds. (AMQP sends whole seconds of Unix time.)
func TestOutboxWriteKeepsTheInstantOfATimestamp(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	ts := time.Date(2026, 3, 4, 5, 6, 7, 0, time.FixedZone("LMT", 19*60+32)) // Amsterdam's offset until 1937
	write(t, pool, ob, "q", amqp.Publishing{Timestamp: ts, Headers: amqp.Table{
		"ts": ts, "in table": amqp.Table{"ts": ts}, "in array": []any{ts},
	}})
	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	p := got[0].Publishing
	unix := func(v any) int64 {
		t.Helper()
		require.IsType(t, time.Time{}, v)
		return v.(time.Time).Unix()
	}
	assert.Equal(t, ts.Unix(), p.Timestamp.Unix(), "Timestamp: %v", p.Timestamp)
	assert.Equal(t, ts.Unix(), unix(p.Headers["ts"]), "header: %v", p.Headers["ts"])
	assert.Equal(t, ts.Unix(), unix(p.Headers["in table"].(amqp.Table)["ts"]), "in a table")
	assert.Equal(t, ts.Unix(), unix(p.Headers["in array"].([]any)[0]), "in an array")
}

// AMQP's long strings are bytes: a header string that is not UTF-8 text
// (a client that sends bytes as a string, a header copied from a delivery
// of one) or that holds a NUL is sent as it was written, at any depth.
func TestOutboxWriteKeepsHeaderStringsThatAreNotText(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	headers := amqp.Table{
		"latin1": "caf\xe9",
		"nul":    "a\x00b",
		"binary": "\xff\xfe\x00\x01",
		"text":   "café",
		"table":  amqp.Table{"inner": "\x80", "deeper": amqp.Table{"x": "\x00"}},
		"array":  []any{"\xc3", "ok", amqp.Table{"k": "\xff"}},
	}
	id := write(t, pool, ob, "q", amqp.Publishing{Headers: headers})
	got, res := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, pgstore.DispatchResult{Taken: 1, Sent: 1}, res, "the row is read back, not parked as corrupt")
	assert.Equal(t, id, got[0].Publishing.MessageId)
	assert.Equal(t, headers, got[0].Publishing.Headers)
}

// A trace context that the table cannot hold as text (a propagator that
// writes a NUL, or bytes that are not UTF-8) never fails the write: its
// entries that are not text are dropped, the others kept, and the message
// goes out as it was written. The caller's transaction goes on; through
// database/sql too.
func TestOutboxWriteDropsTraceEntriesThatAreNotText(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{Inject: func(_ context.Context, c map[string]string) {
		c["traceparent"] = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
		c["tracestate"] = "a=\x00"
		c["baggage"] = "caf\xe9"
		c["x-\x00"] = "v"
		c["x-\xff"] = "v"
	}})
	only := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: ob.Table(), Inject: func(_ context.Context, c map[string]string) {
		c["tracestate"] = "\x00"
	}})
	ctx := context.Background()
	msg := amqp.Publishing{MessageId: "order", Headers: amqp.Table{"h": "v"}, Body: []byte("paid")}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = ob.Write(ctx, tx, "", "q", msg)
	require.NoError(t, err, "the trace context fails the write")
	msg.MessageId = "nothing left"
	_, err = only.Write(ctx, tx, "", "q", msg)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT 1`)
	require.NoError(t, err, "the transaction goes on")
	require.NoError(t, tx.Commit(ctx))

	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	stx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	msg.MessageId = "via-sql"
	_, err = ob.WriteSQL(ctx, stx, "", "q", msg)
	require.NoError(t, err)
	require.NoError(t, stx.Commit())

	got, res := collect(t, ob, 10, sent)
	require.Len(t, got, 3)
	assert.Equal(t, pgstore.DispatchResult{Taken: 3, Sent: 3}, res)
	kept := map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
	for i, want := range []struct {
		id    string
		trace map[string]string
	}{{"order", kept}, {"nothing left", nil}, {"via-sql", kept}} {
		m := got[i]
		assert.Equal(t, want.id, m.Publishing.MessageId)
		assert.Equal(t, want.trace, m.Trace, "%s: the trace context", want.id)
		assert.Equal(t, amqp.Table{"h": "v"}, m.Publishing.Headers, "%s: the headers", want.id)
		assert.Equal(t, []byte("paid"), m.Publishing.Body, "%s: the body", want.id)
	}
}

// A schema-qualified table name may be longer than PostgreSQL's 63
// bytes of a channel name: Write still writes, and notifies on the
// channel that Channel names and a relay listens on.
func TestOutboxWithALongQualifiedName(t *testing.T) {
	pool := newPool(t)
	ctx := context.Background()
	schema := newSchema(t, pool, "_a_schema_with_a_long_name_x")
	ob := newOutbox(t, pool, pgstore.OutboxOptions{Table: schema + ".outbox_of_the_shipping_service"})

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{ob.Channel()}.Sanitize())
	require.NoError(t, err)
	defer conn.Exec(context.Background(), "UNLISTEN *")

	write(t, pool, ob, "q", amqp.Publishing{MessageId: "long"})
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := conn.Conn().WaitForNotification(wctx)
	require.NoError(t, err, "the commit's notification")
	assert.Equal(t, ob.Channel(), n.Channel)
	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, "long", got[0].Publishing.MessageId)
	assert.LessOrEqual(t, len(ob.Channel()), 63, "Channel() = %q", ob.Channel())
}

// The outbox works over a pool in any of pgx's modes of sending
// statements: the exec and simple-protocol modes are those of a
// connection pooler in transaction mode (PgBouncer), for which the
// relay has NoListen.
func TestOutboxInEveryExecMode(t *testing.T) {
	for _, mode := range execModes {
		t.Run(mode.String(), func(t *testing.T) {
			pool := newPoolWith(t, func(c *pgxpool.Config) { c.ConnConfig.DefaultQueryExecMode = mode })
			ob := newOutbox(t, pool, pgstore.OutboxOptions{Inject: func(_ context.Context, c map[string]string) { c["traceparent"] = "tp" }})
			ctx := context.Background()
			msg := amqp.Publishing{MessageId: "m", Headers: amqp.Table{"h": int16(2)}, Body: []byte{0, 1, 0xff}}
			for _, id := range []string{"sent", "parked", "failed"} {
				msg.MessageId = id
				write(t, pool, ob, "q", msg)
			}
			got, res := collect(t, ob, 10, func(m pgstore.OutboxMessage) pgstore.OutboxResult {
				switch m.Publishing.MessageId {
				case "parked":
					return pgstore.OutboxResult{Park: errors.New("no route")}
				case "failed":
					return pgstore.OutboxResult{Failed: errors.New("nacked")}
				}
				return pgstore.OutboxResult{Sent: true}
			})
			assert.Equal(t, pgstore.DispatchResult{Taken: 3, Sent: 1, Parked: 1, Failed: 1}, res)
			require.Len(t, got, 3)
			assert.Equal(t, msg.Body, got[0].Publishing.Body)
			assert.Equal(t, msg.Headers, got[0].Publishing.Headers)
			assert.Equal(t, map[string]string{"traceparent": "tp"}, got[0].Trace)
			s, err := ob.Stats(ctx)
			require.NoError(t, err)
			assert.Equal(t, int64(1), s.Pending)
			assert.Equal(t, int64(1), s.Parked)
			n, err := ob.Retry(ctx, nil)
			require.NoError(t, err)
			assert.Equal(t, int64(1), n)
			rows, err := ob.List(ctx, pgstore.OutboxFilter{State: "pending"})
			require.NoError(t, err)
			assert.Len(t, rows, 2)
			d, err := ob.DeleteSent(ctx, 0, 10)
			require.NoError(t, err)
			assert.Equal(t, int64(1), d)
		})
	}
}

// A message written in a transaction that rolls back is never sent; one
// written through database/sql is, like one through pgx.
func TestOutboxWriteJoinsTheTransaction(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	ctx := context.Background()

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	_, err = ob.Write(ctx, tx, "", "q", amqp.Publishing{MessageId: "rolled-back"})
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))

	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	stx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	id, err := ob.WriteSQL(ctx, stx, "ex", "k", amqp.Publishing{MessageId: "via-sql", Headers: amqp.Table{"h": int16(2)}, Body: []byte("b")})
	require.NoError(t, err)
	assert.Equal(t, "via-sql", id)
	require.NoError(t, stx.Commit())

	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, "via-sql", got[0].Publishing.MessageId)
	assert.Equal(t, amqp.Table{"h": int16(2)}, got[0].Publishing.Headers)
	assert.Equal(t, []byte("b"), got[0].Publishing.Body)
	assert.Nil(t, got[0].Trace)
}

// Sent rows are marked and not taken again; parked rows keep their reason
// until Retry; rows whose send failed stay pending and count the attempt.
func TestOutboxDispatchRecordsEachResult(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	ctx := context.Background()
	for _, id := range []string{"ok", "park", "fail", "untouched"} {
		write(t, pool, ob, "q", amqp.Publishing{MessageId: id})
	}
	got, res := collect(t, ob, 10, func(m pgstore.OutboxMessage) pgstore.OutboxResult {
		switch m.Publishing.MessageId {
		case "ok":
			return pgstore.OutboxResult{Sent: true}
		case "park":
			return pgstore.OutboxResult{Park: errors.New("no route")}
		case "fail":
			return pgstore.OutboxResult{Failed: errors.New("connection lost")}
		}
		return pgstore.OutboxResult{}
	})
	require.Len(t, got, 4)
	assert.Equal(t, pgstore.DispatchResult{Taken: 4, Sent: 1, Parked: 1, Failed: 1}, res)

	rows, err := ob.List(ctx, pgstore.OutboxFilter{})
	require.NoError(t, err)
	byID := map[string]pgstore.OutboxRow{}
	for _, r := range rows {
		byID[r.MessageID] = r
	}
	assert.Equal(t, "sent", byID["ok"].State)
	assert.False(t, byID["ok"].SentAt.IsZero())
	assert.Equal(t, "parked", byID["park"].State)
	assert.Equal(t, "no route", byID["park"].Error)
	assert.Equal(t, "pending", byID["fail"].State)
	assert.Equal(t, 1, byID["fail"].Attempts)
	assert.Equal(t, "connection lost", byID["fail"].Error)
	assert.Equal(t, "pending", byID["untouched"].State)
	assert.Equal(t, 0, byID["untouched"].Attempts)

	s, err := ob.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, int64(2), s.Pending)
	assert.Equal(t, int64(1), s.Parked)
	assert.Equal(t, int64(1), s.Sent)
	assert.Greater(t, s.OldestPending, time.Duration(0))

	got, _ = collect(t, ob, 10, sent)
	ids := []string{}
	for _, m := range got {
		ids = append(ids, m.Publishing.MessageId)
	}
	assert.ElementsMatch(t, []string{"fail", "untouched"}, ids, "only pending rows are taken again")
	assert.Equal(t, 1, got[0].Attempts+got[1].Attempts)

	n, err := ob.Retry(ctx, nil)
	require.NoError(t, err)
	assert.Equal(t, int64(1), n)
	got, _ = collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, "park", got[0].Publishing.MessageId)

	s, err = ob.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, pgstore.OutboxStats{Sent: 4}, s)

	deleted, err := ob.DeleteSent(ctx, time.Hour, 100)
	require.NoError(t, err)
	assert.Zero(t, deleted, "rows within the retention stay")
	deleted, err = ob.DeleteSent(ctx, 0, 100)
	require.NoError(t, err)
	assert.Equal(t, int64(4), deleted)
}

// A row whose send failed with a RetryAfter is left out of the
// dispatches until its retry_at, which List shows; the rows after it are
// taken meanwhile. Retry clears the wait, and the row goes at once.
func TestOutboxFailedRowWaitsForItsRetryAt(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	ctx := context.Background()
	write(t, pool, ob, "q", amqp.Publishing{MessageId: "full"})
	write(t, pool, ob, "q", amqp.Publishing{MessageId: "soon"})
	before := time.Now()
	_, res := collect(t, ob, 10, func(m pgstore.OutboxMessage) pgstore.OutboxResult {
		if m.Publishing.MessageId == "full" {
			return pgstore.OutboxResult{Failed: errors.New("nacked"), RetryAfter: time.Hour}
		}
		return pgstore.OutboxResult{Failed: errors.New("nacked")} // no wait
	})
	assert.Equal(t, pgstore.DispatchResult{Taken: 2, Failed: 2}, res)

	rows, err := ob.List(ctx, pgstore.OutboxFilter{State: "pending"})
	require.NoError(t, err)
	require.Len(t, rows, 2)
	assert.WithinDuration(t, before.Add(time.Hour), rows[0].RetryAt, time.Minute, "the row's next attempt")
	assert.True(t, rows[1].RetryAt.IsZero(), "a failed row without RetryAfter goes at the next dispatch")

	got, _ := collect(t, ob, 10, func(pgstore.OutboxMessage) pgstore.OutboxResult { return pgstore.OutboxResult{} })
	require.Len(t, got, 1, "the row waiting for its retry_at is not taken")
	assert.Equal(t, "soon", got[0].Publishing.MessageId)

	n, err := ob.Retry(ctx, []int64{rows[0].ID})
	require.NoError(t, err)
	assert.Equal(t, int64(1), n, "a waiting row is retried")
	n, err = ob.Retry(ctx, []int64{rows[1].ID})
	require.NoError(t, err)
	assert.Zero(t, n, "a pending row that does not wait is left as it is")
	got, _ = collect(t, ob, 10, sent)
	require.Len(t, got, 2)
	assert.Equal(t, "full", got[0].Publishing.MessageId)
	assert.Equal(t, 1, got[0].Attempts)
	rows, err = ob.List(ctx, pgstore.OutboxFilter{})
	require.NoError(t, err)
	for _, r := range rows {
		assert.Equal(t, "sent", r.State)
		assert.True(t, r.RetryAt.IsZero())
	}
}

// A table made before the retry_at column was added fails Check with
// ErrSchema, which gives the ALTER TABLE to run; Migrate adds the column
// and keeps the rows.
func TestOutboxMigrateAddsRetryAt(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	ctx := context.Background()
	_, err := pool.Exec(ctx, `ALTER TABLE `+ob.Table()+` DROP COLUMN retry_at`)
	require.NoError(t, err)
	write(t, pool, ob, "q", amqp.Publishing{MessageId: "kept"})

	err = ob.Check(ctx)
	require.ErrorIs(t, err, pgstore.ErrSchema)
	assert.Contains(t, err.Error(), `ALTER TABLE "`+ob.Table()+`" ADD COLUMN IF NOT EXISTS retry_at timestamptz`)
	assert.Contains(t, err.Error(), "Migrate")

	require.NoError(t, ob.Migrate(ctx))
	require.NoError(t, ob.Check(ctx))
	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1)
	assert.Equal(t, "kept", got[0].Publishing.MessageId)
}

// Migrate of an outbox that has its table and indexes (a process that
// starts beside running writers and relays) waits for no transaction on
// the table: a lock that waited for one would hold up, behind it, every
// Write of the application and every dispatch, for as long as that
// transaction runs. Neither for a dispatch that holds its rows while
// their confirms are on their way (PublishTimeout at most, 30 s when
// RabbitMQ is slow), nor for a business transaction that wrote a row and
// has not committed yet.
func TestOutboxMigrateDoesNotWait(t *testing.T) {
	ctx := context.Background()
	for name, hold := range map[string]func(t *testing.T, pool *pgxpool.Pool, ob *pgstore.Outbox) (release func() error){
		"for a dispatch awaiting its confirms": func(t *testing.T, pool *pgxpool.Pool, ob *pgstore.Outbox) func() error {
			write(t, pool, ob, "q", amqp.Publishing{MessageId: "held"})
			sending := make(chan struct{})
			confirm := make(chan struct{})
			dispatched := make(chan error, 1)
			go func() {
				_, err := ob.Dispatch(ctx, pgstore.DispatchOptions{Limit: 10}, func(_ context.Context, _ []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
					close(sending)
					<-confirm
					results[0].Sent = true
				})
				dispatched <- err
			}()
			<-sending
			return func() error {
				close(confirm)
				return <-dispatched
			}
		},
		"for a transaction that wrote a row": func(t *testing.T, pool *pgxpool.Pool, ob *pgstore.Outbox) func() error {
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			t.Cleanup(func() { tx.Rollback(ctx) })
			_, err = ob.Write(ctx, tx, "", "q", amqp.Publishing{})
			require.NoError(t, err)
			return func() error { return tx.Commit(ctx) }
		},
	} {
		t.Run(name, func(t *testing.T) {
			pool := newPool(t)
			ob := newOutbox(t, pool, pgstore.OutboxOptions{})
			release := hold(t, pool, ob)
			requireMigrateWaitsForNothing(t, ob.Migrate, func() { require.NoError(t, release()) })
		})
	}
}

// Migrate of a table that lacks one of its indexes makes it again, in
// the table's schema, named or not.
func TestOutboxMigrateMakesAMissingIndex(t *testing.T) {
	pool := newPool(t)
	requireMigrateMakesMissingIndexes(t, []string{"_pending", "_sent_at", "_parked"}, func(t *testing.T, _, qualified string) func(context.Context) error {
		t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+qualified) })
		return newOutbox(t, pool, pgstore.OutboxOptions{Table: qualified}).Migrate
	})
}

// A dispatch that ends without recording (its process dies: here, its
// transaction is rolled back by a failed commit) leaves its rows pending.
func TestOutboxDispatchWithoutCommitLeavesRowsPending(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	write(t, pool, ob, "q", amqp.Publishing{MessageId: "m"})
	_, err := ob.Dispatch(context.Background(), pgstore.DispatchOptions{Limit: 10}, func(ctx context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
		results[0].Sent = true
		// The relay's connection dies after the confirm, before the
		// commit. pg_terminate_backend waits until it has gone, and its
		// row locks with it.
		_, err := pool.Exec(ctx, `SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity
WHERE state = 'idle in transaction' AND query LIKE '%FOR UPDATE SKIP LOCKED%' AND query LIKE '%'||$1||'%'`, ob.Table())
		require.NoError(t, err)
	})
	require.Error(t, err)
	got, _ := collect(t, ob, 10, sent)
	require.Len(t, got, 1, "the row is sent again")
	assert.Equal(t, "m", got[0].Publishing.MessageId, "with the same id")
}

// Dispatches running at once never take the same row.
func TestOutboxDispatchesShareRows(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	ctx := context.Background()
	const n = 300
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for range n {
			if _, err := ob.Write(ctx, tx, "", "q", amqp.Publishing{}); err != nil {
				return err
			}
		}
		return nil
	}))
	var mu sync.Mutex
	seen := map[string]int{}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				res, err := ob.Dispatch(ctx, pgstore.DispatchOptions{Limit: 7, DeleteSent: true}, func(_ context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
					time.Sleep(time.Millisecond) // a publish's round trip, so that the dispatches overlap
					mu.Lock()
					for i, m := range msgs {
						seen[m.Publishing.MessageId]++
						results[i].Sent = true
					}
					mu.Unlock()
				})
				if !assert.NoError(t, err) || res.Taken == 0 {
					return
				}
			}
		}()
	}
	wg.Wait()
	assert.Len(t, seen, n)
	for id, c := range seen {
		if c != 1 {
			t.Errorf("message %s taken %d times", id, c)
		}
	}
	s, err := ob.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, pgstore.OutboxStats{}, s, "DeleteSent mode: confirmed rows are deleted")
}

func TestOutboxSchemaMismatch(t *testing.T) {
	pool := newPool(t)
	name := uniqueTable(t, pool) + "_outbox"
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+name) })
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+name+` (id int)`)
	require.NoError(t, err)
	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: name})
	require.ErrorIs(t, ob.Migrate(context.Background()), pgstore.ErrSchema)
	missing := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: name + "_none"})
	require.ErrorIs(t, missing.Check(context.Background()), pgstore.ErrSchema)
	assert.Contains(t, pgstore.OutboxSchema("shop.outbox"), `CREATE TABLE IF NOT EXISTS "shop"."outbox"`)
	assert.Panics(t, func() { pgstore.OutboxSchema("Bad Name") })
}

// A dispatch that stalls holding its rows (its process frozen, its
// network cut) loses them once HoldFor has passed: PostgreSQL ends its
// session, another dispatch sends the rows, and the stalled one's results
// are not recorded.
func TestOutboxStalledDispatchReleasesItsRows(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	write(t, pool, ob, "q", amqp.Publishing{MessageId: "m"})
	taken := make(chan struct{})
	resume := make(chan struct{})
	stalled := make(chan error, 1)
	go func() {
		_, err := ob.Dispatch(context.Background(), pgstore.DispatchOptions{Limit: 10, HoldFor: 300 * time.Millisecond}, func(_ context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
			close(taken)
			<-resume // frozen until the other dispatch has sent the row
			results[0].Sent = true
		})
		stalled <- err
	}()
	<-taken
	var got []pgstore.OutboxMessage
	require.Eventually(t, func() bool {
		got, _ = collect(t, ob, 10, sent)
		return len(got) == 1
	}, 10*time.Second, 50*time.Millisecond, "another dispatch takes the stalled one's row")
	assert.Equal(t, "m", got[0].Publishing.MessageId)
	close(resume)
	require.Error(t, <-stalled, "the stalled dispatch's session was ended: its results are not recorded")
	s, err := ob.Stats(context.Background())
	require.NoError(t, err)
	assert.Equal(t, pgstore.OutboxStats{Sent: 1}, s)
}

// failing is a pgx tracer that fails the statements whose SQL contains
// match, by handing them a context already cancelled.
type failing struct {
	match string
}

func (f failing) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, f.match) {
		ctx, cancel := context.WithCancel(ctx)
		cancel()
		return ctx
	}
	return ctx
}

func (failing) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// A dispatch that fails between its begin and its take (here the setting
// of HoldFor; in a relay, a stop at that moment) gives its connection back
// to the pool: with a pool of one connection, the next dispatch gets it.
func TestOutboxDispatchThatFailsReleasesItsConnection(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	require.NoError(t, err)
	cfg.MaxConns = 1
	cfg.ConnConfig.Tracer = failing{match: "idle_in_transaction_session_timeout"}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { // pool.Close waits for a leaked connection for ever
		closed := make(chan struct{})
		go func() { pool.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Errorf("pool.Close blocked 10 s: %d connection(s) acquired", pool.Stat().AcquiredConns())
		}
	})
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	write(t, pool, ob, "q", amqp.Publishing{MessageId: "m"})

	_, err = ob.Dispatch(context.Background(), pgstore.DispatchOptions{HoldFor: time.Minute}, func(context.Context, []pgstore.OutboxMessage, []pgstore.OutboxResult) {
		t.Error("send called after the dispatch failed")
	})
	require.ErrorIs(t, err, context.Canceled)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	res, err := ob.Dispatch(ctx, pgstore.DispatchOptions{}, func(_ context.Context, _ []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
		results[0].Sent = true
	})
	require.NoError(t, err, "the failed dispatch's connection is back in the pool")
	assert.Equal(t, pgstore.DispatchResult{Taken: 1, Sent: 1}, res)
}

// After takes only the rows past it, in id order.
func TestOutboxDispatchAfter(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	for _, id := range []string{"a", "b", "c"} {
		write(t, pool, ob, "q", amqp.Publishing{MessageId: id})
	}
	first, _ := collect(t, ob, 1, func(pgstore.OutboxMessage) pgstore.OutboxResult { return pgstore.OutboxResult{} })
	require.Len(t, first, 1)
	var got []string
	res, err := ob.Dispatch(context.Background(), pgstore.DispatchOptions{After: first[0].ID}, func(_ context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
		for i, m := range msgs {
			got = append(got, m.Publishing.MessageId)
			results[i].Sent = true
		}
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"b", "c"}, got)
	assert.Equal(t, pgstore.DispatchResult{Taken: 2, Sent: 2}, res)
	s, err := ob.Stats(context.Background())
	require.NoError(t, err)
	assert.Equal(t, int64(1), s.Pending, "a, before After, is left pending")
}

// A HoldFor longer than PostgreSQL's idle_in_transaction_session_timeout
// can hold (INT_MAX milliseconds, about 24.8 days) still dispatches: the
// relay's hold is PublishTimeout + StopTimeout + 15 s, so a relay given a
// PublishTimeout of a month would otherwise send nothing, for ever.
func TestOutboxDispatchWithALongHoldFor(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	write(t, pool, ob, "q", amqp.Publishing{MessageId: "m"})
	for _, hold := range []time.Duration{30 * 24 * time.Hour, math.MaxInt64} {
		t.Run(hold.String(), func(t *testing.T) {
			res, err := ob.Dispatch(context.Background(), pgstore.DispatchOptions{HoldFor: hold}, func(_ context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
				assert.Equal(t, "m", msgs[0].Publishing.MessageId)
			})
			require.NoError(t, err)
			assert.Equal(t, pgstore.DispatchResult{Taken: 1}, res, "taken and left pending")
		})
	}
}

// A reason that PostgreSQL's text cannot hold is recorded all the same,
// and so are the other results of its dispatch. RabbitMQ cuts a reason at
// 252 bytes, in the middle of a character if it must: a relay on a vhost
// of a long non-ASCII name, publishing to a missing exchange, gets an
// ErrUnroutable that is not UTF-8. Storing it raw failed the whole
// record: the row was never parked, the rows confirmed beside it were
// never marked sent, and the same batch was taken and sent again at each
// dispatch, for ever.
func TestOutboxDispatchRecordsAReasonThatIsNotText(t *testing.T) {
	pool := newPool(t)
	ob := newOutbox(t, pool, pgstore.OutboxOptions{})
	for _, id := range []string{"ok", "park", "fail"} {
		write(t, pool, ob, "q", amqp.Publishing{MessageId: id})
	}
	_, res := collect(t, ob, 10, func(m pgstore.OutboxMessage) pgstore.OutboxResult {
		switch m.Publishing.MessageId {
		case "park":
			return pgstore.OutboxResult{Park: errors.New("no exchange 'x' in vhost 'caf\xc3...'")}
		case "fail":
			return pgstore.OutboxResult{Failed: errors.New("lost\x00")}
		}
		return pgstore.OutboxResult{Sent: true}
	})
	assert.Equal(t, pgstore.DispatchResult{Taken: 3, Sent: 1, Parked: 1, Failed: 1}, res)
	rows, err := ob.List(context.Background(), pgstore.OutboxFilter{})
	require.NoError(t, err)
	require.Len(t, rows, 3)
	assert.Equal(t, "sent", rows[0].State)
	assert.Equal(t, "parked", rows[1].State)
	assert.Equal(t, "no exchange 'x' in vhost 'caf\ufffd...'", rows[1].Error)
	assert.Equal(t, "pending", rows[2].State)
	assert.Equal(t, 1, rows[2].Attempts)
	assert.Equal(t, `lost\x00`, rows[2].Error)
}
