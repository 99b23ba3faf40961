package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// newCLIOutbox returns a pool on the test database, a migrated outbox on a
// table of its own, dropped when t ends, and the database's URL.
func newCLIOutbox(t *testing.T) (*pgxpool.Pool, *pgstore.Outbox, string) {
	t.Helper()
	url := testenv.PostgresURL(t)
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	b := make([]byte, 6)
	rand.Read(b)
	table := "rmwtest_cli_outbox_" + hex.EncodeToString(b)
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+table) })
	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: table})
	require.NoError(t, ob.Migrate(context.Background()))
	return pool, ob, url
}

// An lsRow is a row of outbox ls --json.
type lsRow struct {
	ID        int64      `json:"id"`
	MessageID string     `json:"message_id"`
	Exchange  string     `json:"exchange"`
	Key       string     `json:"routing_key"`
	State     string     `json:"state"`
	Error     string     `json:"error"`
	RetryAt   *time.Time `json:"retry_at"`
	BodySize  int        `json:"body_size"`
}

// outboxLs runs outbox ls --json on table, with args, and returns the
// rows it printed.
func outboxLs(t *testing.T, url, table string, args ...string) []lsRow {
	t.Helper()
	out, stderr, code := cli(t, "", nil, append([]string{"outbox", "ls", "--postgres", url, "--table", table, "--json"}, args...)...)
	expectCode(t, "outbox ls --json "+strings.Join(args, " "), code, exitOK, stderr)
	var rows []lsRow
	require.NoError(t, json.Unmarshal([]byte(out), &rows), out)
	return rows
}

// rabbitmw outbox ls, stats and retry on an outbox with a row of each
// state, and a pending one that waits after a failed send; retry refuses
// to act on nothing named.
func TestOutboxCommands(t *testing.T) {
	ctx := context.Background()
	pool, ob, url := newCLIOutbox(t)
	table := ob.Table()
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, id := range []string{"sent-1", "parked-1", "pending-1", "waiting-1"} {
			if _, err := ob.Write(ctx, tx, "", "shipments", amqp.Publishing{MessageId: id, Body: []byte("body")}); err != nil {
				return err
			}
		}
		return nil
	}))
	_, err := ob.Dispatch(ctx, pgstore.DispatchOptions{Limit: 10}, func(_ context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
		for i, m := range msgs {
			switch m.Publishing.MessageId {
			case "sent-1":
				results[i].Sent = true
			case "parked-1":
				results[i].Park = errors.New("broker: message unroutable")
			case "waiting-1":
				results[i] = pgstore.OutboxResult{Failed: errors.New("broker: message nacked"), RetryAfter: time.Hour}
			}
		}
	})
	require.NoError(t, err)

	out, stderr, code := cli(t, "", nil, "outbox", "stats", "--postgres", url, "--table", table)
	expectCode(t, "outbox stats", code, exitOK, stderr)
	words := strings.Join(strings.Fields(out), " ")
	for _, want := range []string{"pending 2", "oldest pending", "parked 1", "sent (kept for the relays' retention) 1"} {
		assert.Contains(t, words, want)
	}

	rows := outboxLs(t, url, table, "--state", "parked")
	require.Len(t, rows, 1)
	assert.Equal(t, "parked-1", rows[0].MessageID)
	assert.Equal(t, "broker: message unroutable", rows[0].Error)
	assert.Equal(t, 4, rows[0].BodySize)

	out, stderr, code = cli(t, "", nil, "outbox", "ls", "--postgres", url, "--table", table)
	expectCode(t, "outbox ls", code, exitOK, stderr)
	for _, want := range []string{"sent-1", "parked-1", "pending-1", "unroutable", "NEXT ATTEMPT", "nacked"} {
		assert.Contains(t, out, want)
	}
	pending := outboxLs(t, url, table, "--state", "pending")
	require.Len(t, pending, 2)
	assert.Equal(t, "pending-1", pending[0].MessageID)
	assert.Nil(t, pending[0].RetryAt, "a row that goes at the next dispatch")
	assert.Equal(t, "waiting-1", pending[1].MessageID)
	require.NotNil(t, pending[1].RetryAt)
	assert.WithinDuration(t, time.Now().Add(time.Hour), *pending[1].RetryAt, time.Minute)

	_, stderr, code = cli(t, "", nil, "outbox", "retry", "--postgres", url, "--table", table)
	expectCode(t, "outbox retry without --id or --all", code, exitRefused, stderr)
	_, stderr, code = cli(t, "", nil, "outbox", "retry", "--postgres", url, "--table", table, "--id", "999999")
	expectCode(t, "outbox retry of a missing row", code, exitNotFound, stderr)
	out, stderr, code = cli(t, "", nil, "outbox", "retry", "--postgres", url, "--table", table, "--id", strconv.FormatInt(rows[0].ID, 10))
	expectCode(t, "outbox retry --id", code, exitOK, stderr)
	assert.Contains(t, out, "1 row(s) to send now")
	s, err := ob.Stats(ctx)
	require.NoError(t, err)
	assert.Equal(t, int64(3), s.Pending)
	assert.Zero(t, s.Parked)
	// The waiting row goes at once; the other pending one does not wait.
	out, stderr, code = cli(t, "", nil, "outbox", "retry", "--postgres", url, "--table", table, "--all")
	expectCode(t, "outbox retry --all", code, exitOK, stderr)
	assert.Contains(t, out, "1 row(s) to send now")
	all, err := ob.List(ctx, pgstore.OutboxFilter{State: "pending"})
	require.NoError(t, err)
	require.Len(t, all, 3)
	for _, r := range all {
		assert.True(t, r.RetryAt.IsZero(), "row %s waits until %s", r.MessageID, r.RetryAt)
	}

	for name, args := range map[string][]string{
		"no --postgres":    {"outbox", "stats"},
		"a bad --table":    {"outbox", "stats", "--postgres", url, "--table", "Bad-Name"},
		"a bad --id":       {"outbox", "retry", "--postgres", url, "--id", "x"},
		"--all and --id":   {"outbox", "retry", "--postgres", url, "--all", "--id", "1"},
		"an unknown verb":  {"outbox", "drop", "--postgres", url},
		"no verb":          {"outbox"},
		"an extra operand": {"outbox", "stats", "--postgres", url, "extra"},
	} {
		_, stderr, code := cli(t, "", nil, args...)
		expectCode(t, name, code, exitUsage, stderr)
	}
	_, stderr, code = cli(t, "", nil, "outbox", "stats", "--postgres", url, "--table", table+"_missing")
	expectCode(t, "outbox stats of a missing table", code, exitFailed, stderr)
	assert.Contains(t, stderr, "OutboxSchema")
}

// outbox ls prints a row's names and error escaped where they hold what
// is not printable text (control characters: an escape sequence, a
// newline, a carriage return, a tab, a C1 control), so that
// they neither break the table nor rewrite the operator's terminal; the
// JSON keeps them exact.
func TestOutboxLsEscapesWhatIsNotPrintable(t *testing.T) {
	ctx := context.Background()
	pool, ob, url := newCLIOutbox(t)
	const (
		exchange = "amq.\x1b]0;owned\x07"
		key      = "orders\nfake  row\r\x1b[2K"
		id       = "id\t\x1b[31mred"
		why      = "broker: refused\n\x1b[1Abold"
	)
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := ob.Write(ctx, tx, exchange, key, amqp.Publishing{MessageId: id})
		return err
	}))
	_, err := ob.Dispatch(ctx, pgstore.DispatchOptions{}, func(_ context.Context, _ []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
		results[0].Park = errors.New(why)
	})
	require.NoError(t, err)
	// A row written by hand, whose error holds a C1 control character:
	// CSI, which starts an escape sequence on some terminals.
	const c1 = "caf\u009b31m"
	_, err = pool.Exec(ctx, `INSERT INTO `+ob.Table()+` (message_id, exchange, routing_key, properties, body, state, error)
VALUES ('plain', '', 'q', '{}', '', 'parked', $1)`, c1)
	require.NoError(t, err)

	out, stderr, code := cli(t, "", nil, "outbox", "ls", "--postgres", url, "--table", ob.Table())
	expectCode(t, "outbox ls", code, exitOK, stderr)
	for _, c := range []string{"\x1b", "\r", "\a", "\t", "\u009b"} {
		assert.NotContains(t, out, c, "outbox ls printed %q", c)
	}
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, 3, "a header and two rows:\n%s", out)
	for _, want := range []string{strconv.Quote(exchange), strconv.Quote(key), strconv.Quote(id), strconv.Quote(why)} {
		assert.Contains(t, lines[1], want)
	}
	assert.Contains(t, lines[2], `plain`)
	assert.Contains(t, lines[2], strconv.Quote(c1))
	assert.NotContains(t, lines[2], `"plain"`, "printable text is printed as it is")

	rows := outboxLs(t, url, ob.Table())
	require.Len(t, rows, 2)
	assert.Equal(t, id, rows[0].MessageID)
	assert.Equal(t, exchange, rows[0].Exchange)
	assert.Equal(t, key, rows[0].Key)
	assert.Equal(t, why, rows[0].Error)
}
