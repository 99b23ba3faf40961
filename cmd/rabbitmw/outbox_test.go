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

// rabbitmw outbox ls, stats and retry on an outbox with a row of each
// state, and a pending one that waits after a failed send; retry refuses
// to act on nothing named.
func TestOutboxCommands(t *testing.T) {
	ctx := context.Background()
	url := testenv.PostgresURL(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	b := make([]byte, 6)
	rand.Read(b)
	table := "rmwtest_cli_outbox_" + hex.EncodeToString(b)
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+table) })
	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: table})
	require.NoError(t, ob.Migrate(ctx))
	require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, id := range []string{"sent-1", "parked-1", "pending-1", "waiting-1"} {
			if _, err := ob.Write(ctx, tx, "", "shipments", amqp.Publishing{MessageId: id, Body: []byte("body")}); err != nil {
				return err
			}
		}
		return nil
	}))
	_, err = ob.Dispatch(ctx, pgstore.DispatchOptions{Limit: 10}, func(_ context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
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

	out, stderr, code = cli(t, "", nil, "outbox", "ls", "--postgres", url, "--table", table, "--state", "parked", "--json")
	expectCode(t, "outbox ls --state parked", code, exitOK, stderr)
	var rows []struct {
		ID        int64  `json:"id"`
		MessageID string `json:"message_id"`
		State     string `json:"state"`
		Error     string `json:"error"`
		BodySize  int    `json:"body_size"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows), out)
	require.Len(t, rows, 1)
	assert.Equal(t, "parked-1", rows[0].MessageID)
	assert.Equal(t, "broker: message unroutable", rows[0].Error)
	assert.Equal(t, 4, rows[0].BodySize)

	out, stderr, code = cli(t, "", nil, "outbox", "ls", "--postgres", url, "--table", table)
	expectCode(t, "outbox ls", code, exitOK, stderr)
	for _, want := range []string{"sent-1", "parked-1", "pending-1", "unroutable", "NEXT ATTEMPT", "nacked"} {
		assert.Contains(t, out, want)
	}
	out, stderr, code = cli(t, "", nil, "outbox", "ls", "--postgres", url, "--table", table, "--state", "pending", "--json")
	expectCode(t, "outbox ls --state pending", code, exitOK, stderr)
	var pending []struct {
		MessageID string     `json:"message_id"`
		RetryAt   *time.Time `json:"retry_at"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &pending), out)
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
