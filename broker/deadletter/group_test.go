package deadletter

import (
	"crypto/md5"
	"encoding/hex"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
)

// A message that Retry dead-lettered after two delay hops: RabbitMQ's
// x-first-death-* name the first hop's expiry, which is no failure.
func retried(t0 time.Time) *amqp.Delivery {
	hop := func(q string, at time.Time) amqp.Table {
		return amqp.Table{"queue": q, "reason": "expired", "count": int64(1), "exchange": "", "time": at, "routing-keys": []any{q}}
	}
	return &amqp.Delivery{MessageId: "m1", Body: []byte("{}"), Headers: amqp.Table{
		"x-first-death-queue":      "orders.delay.1s",
		"x-first-death-reason":     "expired",
		"x-first-death-exchange":   "",
		"x-death":                  []any{hop("orders.delay.2s", t0.Add(4*time.Second)), hop("orders.delay.1s", t0.Add(time.Second))},
		broker.HeaderOriginalQueue: "orders",
		broker.HeaderError:         "card declined (middleware: retries exhausted after 3 attempts)",
		broker.HeaderErrorType:     "error",
		broker.HeaderFailedAt:      t0.Add(5 * time.Second),
		broker.HeaderFirstError:    "gateway timeout",
		broker.HeaderFirstFailedAt: t0,
		rabbitmw.HeaderAttempts:    int64(3),
	}}
}

func TestReadMessageFirstFailure(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	m := readMessage(retried(t0))
	assert.Empty(t, m.DeadLetteredFrom, "dead-lettered from: a delay hop is no failure")
	assert.Empty(t, m.Reason, "reason: a delay hop's expiry is no failure")
	assert.Equal(t, "gateway timeout", m.FirstError, "first error")
	assert.Equal(t, t0, m.FirstFailure, "first failure")
	assert.Equal(t, t0.Add(5*time.Second), m.LastFailure, "last failure")

	// Without the first-failure headers (a copy from before they were
	// written), the first failure is the last one; the hops' times, which
	// came after a failure, are not taken for one.
	d := retried(t0)
	delete(d.Headers, broker.HeaderFirstError)
	delete(d.Headers, broker.HeaderFirstFailedAt)
	m = readMessage(d)
	assert.Equal(t, m.Error, m.FirstError, "first error without the header")
	assert.Equal(t, t0.Add(5*time.Second), m.FirstFailure, "first failure without the header")

	// A message the server dead-lettered out of its work queue keeps what
	// RabbitMQ says.
	d = &amqp.Delivery{MessageId: "m2", Headers: amqp.Table{
		"x-first-death-queue": "orders", "x-first-death-reason": "expired",
		"x-death": []any{amqp.Table{"queue": "orders", "reason": "expired", "count": int64(1), "time": t0}},
	}}
	m = readMessage(d)
	assert.Equal(t, "orders", m.DeadLetteredFrom)
	assert.Equal(t, "expired", m.Reason)
	assert.Equal(t, t0, m.FirstFailure)
}

// A message without a message id is known by the key the consumers used,
// the MD5 of its body, and a filter selects it by that key.
func TestMessageWithoutIDHasItsKey(t *testing.T) {
	body := []byte(`{"order":7}`)
	sum := md5.Sum(body)
	key := hex.EncodeToString(sum[:])
	m := readMessage(&amqp.Delivery{Body: body})
	assert.Equal(t, "", m.ID)
	assert.Equal(t, key, m.Key)
	assert.True(t, (&Filter{IDs: []string{key}}).match(m), "a filter by its key")
	m = readMessage(&amqp.Delivery{MessageId: "m1", Body: body})
	assert.Equal(t, "m1", m.Key, "a message id is the key")
	assert.True(t, (&Filter{IDs: []string{"m1"}}).match(m))
	assert.False(t, (&Filter{IDs: []string{key}}).match(m), "a message with an id is not known by its body")
}

func TestFilterByErrorText(t *testing.T) {
	m := &Message{Error: "payment Gateway unreachable (middleware: retries exhausted after 3 attempts)", ErrorType: "error"}
	assert.True(t, (&Filter{Error: "gateway unreachable"}).match(m), "case does not matter")
	assert.False(t, (&Filter{Error: "declined"}).match(m))
	assert.True(t, (&Filter{Error: "gateway", ErrorType: "error"}).match(m))
	assert.False(t, (&Filter{Error: "gateway", ErrorType: "panic"}).match(m))
}

func TestMask(t *testing.T) {
	for in, want := range map[string]string{
		"decode order 7: unexpected EOF":                                       "decode order #: unexpected EOF",
		"order 1f0c2d3e-4b5a-6978-8a9b-0c1d2e3f4a5b not found":                 "order <uuid> not found",
		"at 2026-01-02T03:04:05.123Z: 12.5 ms over":                            "at <time>: #.# ms over",
		"key 9e107d9d372bb6826bd81d3542a419d6 busy":                            "key <hex> busy",
		"dial tcp 10.0.0.7:5432: connect: connection refused":                  "dial tcp #.#.#.#:#: connect: connection refused",
		"utf8 and http2 stay; so does deadbeef":                                "utf8 and http2 stay; so does deadbeef",
		"decode order 7: EOF (middleware: retries exhausted after 3 attempts)": "decode order #: EOF (middleware: retries exhausted after # attempts)",
	} {
		assert.Equal(t, want, Mask(in), "Mask(%q)", in)
	}
}

func TestGroups(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	msg := func(id, typ, text string, at time.Duration) *Message {
		return &Message{ID: id, Key: id, ErrorType: typ, Error: text, LastFailure: t0.Add(at), FirstFailure: t0.Add(at)}
	}
	msgs := []*Message{
		msg("a", "error", "decode order 7: unexpected EOF", 3*time.Second),
		msg("b", "*json.SyntaxError", "decode order 8: invalid character", time.Second),
		msg("c", "error", "decode order 12: unexpected EOF", time.Second),
		msg("d", "panic", "decode order 9: unexpected EOF", 2*time.Second),
		msg("e", "error", "decode order 13: unexpected EOF", 2*time.Second),
	}
	gs := Groups(msgs)
	require.Len(t, gs, 3)
	g := gs[0] // the largest first
	assert.Equal(t, "error", g.ErrorType)
	assert.Equal(t, "decode order #: unexpected EOF", g.Pattern)
	assert.Equal(t, 3, g.Count)
	assert.Equal(t, t0.Add(time.Second), g.FirstSeen)
	assert.Equal(t, t0.Add(3*time.Second), g.LastSeen)
	assert.Equal(t, "a", g.Sample.ID, "the sample is the first in queue order")
	assert.NotEmpty(t, g.ID)
	for _, m := range msgs {
		assert.Equal(t, m.ErrorType == "error", (&Filter{Group: g.ID}).match(m), "Filter{Group} of %s", m.ID)
		assert.Equal(t, GroupID(m) == g.ID, m.ErrorType == "error", "GroupID of %s", m.ID)
	}
	assert.NotEqual(t, gs[1].ID, gs[2].ID)
}
