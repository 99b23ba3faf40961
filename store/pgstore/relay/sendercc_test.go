package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/pgstore/relay"
)

// A row that an older Write stored with a CC or BCC header that is not an
// array of strings (a string; an array holding a number) is parked with
// the publisher's reason, listed as parked, and the rows beside it are
// sent: it is neither retried for ever nor dropped.
func TestRelayParksARowWithASenderHeaderOfAnotherShape(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	var bad, good []string
	require.NoError(t, pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
		for i := range 4 {
			id, err := f.ob.Write(ctx, tx, "", f.queue, amqp.Publishing{Body: []byte("x"), Headers: amqp.Table{"CC": []any{"a"}}})
			if err != nil {
				return err
			}
			if i < 2 {
				bad = append(bad, id)
			} else {
				good = append(good, id)
			}
		}
		return nil
	}))
	// As an older Write stored them.
	for id, hs := range map[string]string{
		bad[0]: `{"CC": {"t": "string", "v": "x"}}`,
		bad[1]: `{"BCC": {"t": "array", "v": [{"t": "string", "v": "x"}, {"t": "int32", "v": 7}]}}`,
	} {
		_, err := f.pool.Exec(ctx, `UPDATE `+f.table+` SET properties = jsonb_build_object('headers', $1::jsonb) WHERE message_id = $2`, hs, id)
		require.NoError(t, err)
	}
	f.run(relay.New(f.ob, f.b, relay.Options{Senders: 1, PollInterval: 20 * time.Millisecond}))
	require.Eventually(t, func() bool { return f.stats().Pending == 0 }, 10*time.Second, 20*time.Millisecond, "no row left pending")
	rows, err := f.ob.List(ctx, pgstore.OutboxFilter{State: "parked"})
	require.NoError(t, err)
	var parked []string
	for _, r := range rows {
		parked = append(parked, r.MessageID)
		assert.Contains(t, r.Error, "invalid message")
		assert.Contains(t, r.Error, "CC")
		assert.Equal(t, 1, r.Attempts)
		t.Logf("parked: %s", r.Error)
	}
	assert.ElementsMatch(t, bad, parked)
	assert.Equal(t, once(good), f.drain(2))
}
