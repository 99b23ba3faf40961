package deadletter

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
)

// Listing reads every field, filters, and leaves the queue as it was, in
// order, twice in a row.
func testListKeepsTheQueue(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	var all []string
	for i := range 12 {
		all = append(all, fmt.Sprintf("m%02d", i))
	}
	all = append(all, "typed-1")
	before := time.Now().Add(-time.Second)
	f.deadLetter(t, false, nil, all...)
	for range 2 {
		dls, err := f.in.List(ctx, f.q, ListOptions{})
		require.NoError(t, err, "DeadLetters")
		assert.Equal(t, all, ids(dls), "ids listed")
	}
	dls, err := f.in.List(ctx, f.q, ListOptions{Filter: Filter{IDs: []string{"typed-1"}}})
	require.NoError(t, err, "DeadLetters")
	if len(dls) != 1 {
		t.Fatalf("DeadLetters(typed-1) = %v; want one", ids(dls))
	}
	dl := dls[0]
	assert.Equal(t, f.q, dl.Queue, "queue")
	assert.Equal(t, "*deadletter.typedErr", dl.ErrorType, "error type")
	assert.Equal(t, "typed failure of typed-1", dl.Error, "error")
	assert.Equal(t, 1, dl.Attempts, "attempts")
	assert.Equal(t, len("body of typed-1"), dl.BodySize, "body size")
	assert.Equal(t, "test-host", dl.Host, "host")
	assert.Equal(t, f.process, dl.Process, "process")
	assert.Equal(t, []string(nil), dl.Malformed, "malformed")
	if dl.LastFailure.Before(before.Truncate(time.Second)) || dl.LastFailure.After(time.Now()) || dl.FirstFailure.After(dl.LastFailure) {
		t.Errorf("first, last failure = %v, %v; want in [%v, now], first not after last", dl.FirstFailure, dl.LastFailure, before)
	}

	dls, err = f.in.List(ctx, f.q, ListOptions{Filter: Filter{ErrorType: "error"}, Limit: 3})
	require.NoError(t, err, "DeadLetters")
	assert.Equal(t, all[:3], ids(dls), "first 3 of an error type")
	dls, err = f.in.List(ctx, f.q, ListOptions{Filter: Filter{Until: before}})
	require.NoError(t, err, "DeadLetters")
	assert.Equal(t, []string{}, ids(dls), "failed before the test")
	var progress []int
	dls, err = f.in.List(ctx, f.q, ListOptions{
		Filter:   Filter{Since: before, Match: func(dl *Message) bool { return strings.HasSuffix(dl.ID, "1") }},
		Progress: func(done, total int) { progress = append(progress, done, total) },
	})
	require.NoError(t, err, "DeadLetters")
	assert.Equal(t, []string{"m01", "m11", "typed-1"}, ids(dls), "matched by func")
	assert.Equal(t, []int{len(all), len(all)}, progress[len(progress)-2:], "last progress")
	assert.Equal(t, all, deliveryIDs(f.drain(f.q+".dlq")), "left in the dead-letter queue, in order")
	f.assertSettled(t)
}

// Headers of the wrong types are listed as malformed, replayed, purged,
// exported: never a crash.
func testDLQMalformed(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	bad := amqp.Table{
		broker.HeaderOriginalQueue: int32(7), broker.HeaderFailedAt: "yesterday", broker.HeaderError: []byte("bytes"),
		broker.HeaderErrorType: nil, rabbitmw.HeaderAttempts: "many", HeaderReplays: amqp.Table{},
		HeaderHistory: "not an array", "x-death": []any{"not a table"}, "x-first-death-queue": int64(1),
	}
	require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: "bad", Headers: bad}), "Publish")
	require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: "bad-history", Headers: amqp.Table{
		broker.HeaderOriginalQueue: f.q, HeaderHistory: []any{"not a table", amqp.Table{broker.HeaderFailedAt: 3}},
	}}), "Publish")
	dls, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "DeadLetters")
	if len(dls) != 2 {
		t.Fatalf("DeadLetters = %v; want 2", ids(dls))
	}
	slices.Sort(dls[0].Malformed)
	want := []string{broker.HeaderError, broker.HeaderErrorType, broker.HeaderFailedAt, HeaderHistory, broker.HeaderOriginalQueue, HeaderReplays, rabbitmw.HeaderAttempts, "x-death", "x-first-death-queue"}
	slices.Sort(want)
	assert.Equal(t, want, dls[0].Malformed, "malformed")
	_, err = f.in.Replay(ctx, f.q, ReplayOptions{Filter: Filter{IDs: []string{"bad"}}})
	require.ErrorIs(t, err, ErrNoDestination, "Replay without a destination")
	var out bytes.Buffer
	n, err := f.in.Export(ctx, f.q, &out, ExportOptions{})
	require.NoError(t, err, "Export")
	assert.Equal(t, 2, n, "exported")
	res, err := f.in.Replay(ctx, f.q, ReplayOptions{To: f.q})
	require.NoError(t, err, "Replay")
	assert.Equal(t, 2, res.Replayed, "replayed")
	back := f.drain(f.q)
	slices.SortFunc(back, func(a, b *amqp.Delivery) int { return strings.Compare(a.MessageId, b.MessageId) })
	assert.Equal(t, []string{"bad", "bad-history"}, deliveryIDs(back), "replayed")
	assert.Equal(t, int64(1), back[0].Headers[HeaderReplays], "replays after a malformed count")
	lives, _ := back[0].Headers[HeaderHistory].([]any)
	if len(lives) != 1 || lives[0].(amqp.Table)[HeaderHistory] != "not an array" {
		t.Errorf("history = %v; want one life keeping the malformed history", back[0].Headers[HeaderHistory])
	}
	lives, _ = back[1].Headers[HeaderHistory].([]any)
	assert.Equal(t, 3, len(lives), "lives of bad-history")
	f.assertSettled(t)
}

// A message retried through a delay queue, then dead-lettered, shows its
// first failure: the handler's, not the delay hop's expiry that RabbitMQ
// records in x-first-death-*.
func testFirstFailureIsTheHandlers(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	before := time.Now().Add(-time.Second).Truncate(time.Second)
	f.deadLetter(t, true, nil, "r1")
	dls, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err)
	require.Len(t, dls, 1)
	dl := dls[0]
	assert.Equal(t, "boom", dl.FirstError, "first error")
	assert.Equal(t, "failure of r1: boom", dl.Error, "last error")
	assert.Empty(t, dl.DeadLetteredFrom, "dead-lettered from (x-first-death-queue is %v)", dl.Delivery.Headers["x-first-death-queue"])
	assert.Empty(t, dl.Reason, "reason")
	if dl.FirstFailure.Before(before) || dl.FirstFailure.After(dl.LastFailure) {
		t.Errorf("first, last failure = %v, %v; want in [%v, last]", dl.FirstFailure, dl.LastFailure, before)
	}
}
