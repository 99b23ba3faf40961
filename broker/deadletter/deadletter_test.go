package deadletter

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
)

// behaviours run on both backends.
var behaviours = []struct {
	name string
	run  func(t *testing.T, be backend)
}{
	{"ListKeepsTheQueue", testListKeepsTheQueue},
	{"FirstFailureIsTheHandlers", testFirstFailureIsTheHandlers},
	{"ReplaySelected", testReplaySelected},
	{"ReplayedMessageFailsAgain", testReplayFailsAgain},
	{"ReplayOfServerDeadLetters", testReplayServerDeadLetters},
	{"ReplayToMissingQueue", testReplayMissingQueue},
	{"MalformedHeaders", testDLQMalformed},
	{"PurgeSelected", testPurgeSelected},
	{"ExportImport", testExportImport},
}

func TestDeadLetterOperations(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			for _, c := range behaviours {
				t.Run(c.name, func(t *testing.T) { c.run(t, be) })
			}
		})
	}
}

// typedErr gives dead-lettered messages an error type of their own.
type typedErr struct{ msg string }

func (e *typedErr) Error() string { return e.msg }

// deadLetter sends the messages ids through a consumer that dead-letters
// each at its first call; with retryFirst, each is retried once first, so
// that its x-death holds a delay queue's record. Messages whose id has
// the prefix "typed" fail with a *typedErr.
func (f *fixture) deadLetter(t *testing.T, retryFirst bool, headers amqp.Table, ids ...string) {
	t.Helper()
	dlq0 := f.length(f.q + ".dlq")
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) == 1 && retryFirst {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		if strings.HasPrefix(d.MessageId, "typed") {
			return rabbitmw.Permanent(&typedErr{"typed failure of " + d.MessageId})
		}
		return rabbitmw.Permanent(fmt.Errorf("failure of %s: %w", d.MessageId, errBoom))
	}), broker.ConsumeOptions{Workers: 1})
	for _, id := range ids {
		f.publish(id, []byte("body of "+id), headers)
	}
	require.Eventually(t, func() bool { return f.length(f.q+".dlq") == dlq0+len(ids) }, 30*time.Second, 10*time.Millisecond, "messages not dead-lettered")
	require.NoError(t, r.stop(t), "Consume after cancel")
}

func ids(dls []*Message) []string {
	out := []string{}
	for _, dl := range dls {
		out = append(out, dl.ID)
	}
	return out
}

func deliveryIDs(ds []*amqp.Delivery) []string {
	out := []string{}
	for _, d := range ds {
		out = append(out, d.MessageId)
	}
	return out
}

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

// Replay sends back what it selects, with the fault headers moved into
// the history, and leaves the rest in order; a dry run moves nothing.
func testReplaySelected(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	all := []string{"a", "typed-b", "c", "typed-d", "e", "typed-f"}
	f.deadLetter(t, true, amqp.Table{"custom": "kept"}, all...)

	res, err := f.in.Replay(ctx, f.q, ReplayOptions{Filter: Filter{ErrorType: "*deadletter.typedErr"}, DryRun: true})
	require.NoError(t, err, "Replay dry run")
	assert.Equal(t, []string{"typed-b", "typed-d", "typed-f"}, ids(res.Selected), "dry run: selected")
	assert.Equal(t, 0, res.Replayed, "dry run: replayed")
	assert.Equal(t, 0, f.length(f.q), "dry run: work queue")

	var (
		mu       sync.Mutex
		reset    []string
		progress [][2]int
	)
	res, err = f.in.Replay(ctx, f.q, ReplayOptions{
		Filter: Filter{ErrorType: "*deadletter.typedErr"},
		Limit:  2,
		ResetFailures: func(_ context.Context, d *amqp.Delivery) error {
			mu.Lock()
			defer mu.Unlock()
			reset = append(reset, d.MessageId)
			return nil
		},
		Progress: func(done, total int) { progress = append(progress, [2]int{done, total}) },
	})
	require.NoError(t, err, "Replay")
	assert.Equal(t, len(all), res.Scanned, "scanned")
	assert.Equal(t, 2, res.Replayed, "replayed")
	slices.Sort(reset)
	assert.Equal(t, []string{"typed-b", "typed-d"}, reset, "failures reset")
	assert.Equal(t, [][2]int{{1, 2}, {2, 2}}, progress, "progress")
	back := f.drain(f.q)
	slices.SortFunc(back, func(a, b *amqp.Delivery) int { return strings.Compare(a.MessageId, b.MessageId) })
	assert.Equal(t, []string{"typed-b", "typed-d"}, deliveryIDs(back), "back in the work queue")
	for _, d := range back {
		for _, k := range historyHeaders {
			if v, ok := d.Headers[k]; ok {
				t.Errorf("%s: header %s = %v after the replay; want it in the history", d.MessageId, k, v)
			}
		}
		assert.Equal(t, "kept", d.Headers["custom"], d.MessageId+": custom header")
		assert.Equal(t, "body of "+d.MessageId, string(d.Body), d.MessageId+": body")
		assert.Equal(t, "text/plain", d.ContentType, d.MessageId+": content type")
		assert.Equal(t, int64(1), d.Headers[HeaderReplays], d.MessageId+": replays")
		assert.Equal(t, f.q, d.Headers[broker.HeaderOriginalRoutingKey], d.MessageId+": original routing key")
		lives, _ := d.Headers[HeaderHistory].([]any)
		if len(lives) != 1 {
			t.Fatalf("%s: history = %v; want one life", d.MessageId, d.Headers[HeaderHistory])
		}
		life, _ := lives[0].(amqp.Table)
		assert.Equal(t, "typed failure of "+d.MessageId, life[broker.HeaderError], d.MessageId+": error in the history")
		assert.Equal(t, f.q+".dlq", life["dead-letter-queue"], d.MessageId+": dead-letter queue in the history")
		assert.Equal(t, []string{f.q + ".delay.50ms expired 1"}, deathKeys(life["x-death"]), d.MessageId+": x-death in the history")
	}
	assert.Equal(t, []string{"a", "c", "e", "typed-f"}, deliveryIDs(f.drain(f.q+".dlq")), "left in the dead-letter queue, in order")
	f.assertSettled(t)
}

// A replayed message that fails again has fresh fault headers and keeps
// its history; replayed again and again, the history is capped, the count
// is not. Then, with its cause fixed, it succeeds.
func testReplayFailsAgain(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 60*time.Second)
	f.deadLetter(t, true, nil, "m")
	var mu sync.Mutex
	fixed := false
	var calls []*amqp.Delivery
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		mu.Lock()
		defer mu.Unlock()
		calls = append(calls, d)
		if fixed {
			return nil
		}
		return rabbitmw.Permanent(fmt.Errorf("round %d", len(calls)))
	}), broker.ConsumeOptions{Workers: 1})
	for round := 1; round <= 3; round++ {
		res, err := f.in.Replay(ctx, f.q, ReplayOptions{HistoryLimit: 2})
		require.NoError(t, err, "Replay")
		assert.Equal(t, 1, res.Replayed, "replayed")
		require.Eventually(t, func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(calls) == round && f.length(f.q+".dlq") == 1
		}, 20*time.Second, 10*time.Millisecond, "replayed message not dead-lettered again")
		dls, err := f.in.List(ctx, f.q, ListOptions{})
		require.NoError(t, err, "DeadLetters")
		d := dls[0].Delivery
		assert.Equal(t, fmt.Sprintf("round %d", round), d.Headers[broker.HeaderError], "fresh error")
		assert.Equal(t, int64(1), d.Headers[rabbitmw.HeaderAttempts], "fresh attempts")
		assert.Equal(t, nil, d.Headers["x-death"], "fresh x-death")
		assert.Equal(t, int64(round), d.Headers[HeaderReplays], "replays")
		lives, _ := d.Headers[HeaderHistory].([]any)
		var errs []any
		for _, l := range lives {
			errs = append(errs, l.(amqp.Table)[broker.HeaderError])
		}
		want := []any{"failure of m: boom", "round 1", "round 2"}[:round]
		slices.Reverse(want)
		assert.Equal(t, want[:min(2, round)], errs, "errors in the history, most recent first")
		if round == 1 {
			life := lives[0].(amqp.Table)
			assert.Equal(t, []string{f.q + ".delay.50ms expired 1"}, deathKeys(life["x-death"]), "x-death in the history")
		}
	}
	mu.Lock()
	fixed = true
	mu.Unlock()
	_, err := f.in.Replay(ctx, f.q, ReplayOptions{})
	require.NoError(t, err, "Replay")
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(calls) == 4
	}, 20*time.Second, 10*time.Millisecond, "fixed message not handled")
	require.NoError(t, r.stop(t), "Consume after cancel")
	f.assertSettled(t)
}

// Messages the server dead-lettered (expired in the work queue, or past a
// quorum queue's delivery limit) have no fault headers: replaying them
// needs To, and without it nothing moves. Replayed, they fail once with a
// retry and then succeed: the delay copy is not dropped as a cycle.
func testReplayServerDeadLetters(t *testing.T, be backend) {
	for _, quorum := range []bool{false, true} {
		t.Run(map[bool]string{false: "expired", true: "delivery_limit"}[quorum], func(t *testing.T) {
			top := broker.Topology{}
			if quorum {
				top = broker.Topology{Quorum: true, DeliveryLimit: 1}
			}
			f := setup(t, be, top)
			ctx := testContext(t, 60*time.Second)
			for _, id := range []string{"x", "y"} {
				require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: id, Body: []byte(id), Expiration: map[bool]string{false: "1", true: ""}[quorum]}), "Publish")
			}
			if quorum {
				for range 20 {
					d, ok, err := f.b.Get(ctx, f.q)
					require.NoError(t, err, "Get")
					if !ok {
						break
					}
					require.NoError(t, d.Nack(false, true), "Nack")
				}
			}
			require.Eventually(t, func() bool { return f.length(f.q+".dlq") == 2 }, 20*time.Second, 10*time.Millisecond, "messages not dead-lettered by the server")
			dls, err := f.in.List(ctx, f.q, ListOptions{})
			require.NoError(t, err, "DeadLetters")
			assert.Equal(t, f.q, dls[0].DeadLetteredFrom, "dead-lettered from")
			assert.Equal(t, "", dls[0].Queue, "queue")

			_, err = f.in.Replay(ctx, f.q, ReplayOptions{})
			require.ErrorIs(t, err, ErrNoDestination, "Replay without To")
			assert.Contains(t, fmt.Sprint(err), `"x", "y"`, "Replay error")
			assert.Equal(t, 2, f.length(f.q+".dlq"), "dead-letter queue after the refusal")
			assert.Equal(t, 0, f.length(f.q), "work queue after the refusal")

			j := newJournal()
			r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				if j.record(d) == 1 {
					return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
				}
				return nil
			}), broker.ConsumeOptions{})
			res, err := f.in.Replay(ctx, f.q, ReplayOptions{To: f.q})
			require.NoError(t, err, "Replay")
			assert.Equal(t, 2, res.Replayed, "replayed")
			require.Eventually(t, func() bool {
				return len(j.callsOf("x")) == 2 && len(j.callsOf("y")) == 2
			}, 20*time.Second, 10*time.Millisecond, "replayed messages not handled after their retry")
			require.NoError(t, r.stop(t), "Consume after cancel")
			first := j.callsOf("x")[0]
			lives, _ := first.Headers[HeaderHistory].([]any)
			if len(lives) != 1 {
				t.Fatalf("history = %v; want one life", first.Headers[HeaderHistory])
			}
			reason := map[bool]string{false: "expired", true: "delivery_limit"}[quorum]
			assert.Equal(t, []string{f.q + " " + reason + " 1"}, deathKeys(lives[0].(amqp.Table)["x-death"]), "server's x-death in the history")
			f.assertSettled(t)
		})
	}
}

// A replay to a queue that does not exist is refused before anything
// moves.
func testReplayMissingQueue(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "b")
	_, err := f.in.Replay(ctx, f.q, ReplayOptions{To: f.q + "-missing"})
	require.ErrorIs(t, err, broker.ErrQueueNotFound, "Replay to a missing queue")
	assert.Equal(t, []string{"a", "b"}, deliveryIDs(f.drain(f.q+".dlq")), "dead-letter queue")
	_, err = f.in.Replay(ctx, f.q+"-missing", ReplayOptions{})
	require.ErrorIs(t, err, broker.ErrQueueNotFound, "Replay from a missing dead-letter queue")
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

// Purge removes what it selects and leaves the rest in order.
func testPurgeSelected(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "typed-b", "c", "typed-d")
	removed, err := f.in.Purge(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*deadletter.typedErr"}, DryRun: true})
	require.NoError(t, err, "Purge dry run")
	assert.Equal(t, []string{"typed-b", "typed-d"}, ids(removed), "selected")
	assert.Equal(t, 4, f.length(f.q+".dlq"), "dead-letter queue after a dry run")
	removed, err = f.in.Purge(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*deadletter.typedErr"}})
	require.NoError(t, err, "Purge")
	assert.Equal(t, []string{"typed-b", "typed-d"}, ids(removed), "removed")
	assert.Equal(t, []string{"a", "c"}, deliveryIDs(f.drain(f.q+".dlq")), "left")
	f.assertSettled(t)
}

// Exported, purged and imported back, the messages are the same: body,
// properties, and headers type for type.
func testExportImport(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, true, allTypes(), "a", "b")
	require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{
		Headers: exportTypes(), Body: []byte{0, 1, 2, 0xff}, ContentType: "application/octet-stream",
		ContentEncoding: "identity", DeliveryMode: amqp.Transient, Priority: 3, CorrelationId: "corr",
		ReplyTo: "reply", Expiration: "600000", MessageId: "props", Timestamp: time.Unix(1700000000, 0),
		Type: "kind", AppId: "app",
	}), "Publish")
	before, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "DeadLetters")
	var out bytes.Buffer
	n, err := f.in.Export(ctx, f.q, &out, ExportOptions{})
	require.NoError(t, err, "Export")
	assert.Equal(t, 3, n, "exported")
	assert.Equal(t, 3, strings.Count(out.String(), "\n"), "lines")
	assert.Equal(t, 3, f.length(f.q+".dlq"), "dead-letter queue after the export")
	_, err = f.in.Purge(ctx, f.q, PurgeOptions{})
	require.NoError(t, err, "Purge")
	n, err = f.in.Import(ctx, f.q, bytes.NewReader(out.Bytes()), ImportOptions{})
	require.NoError(t, err, "Import")
	assert.Equal(t, 3, n, "imported")
	after, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "DeadLetters")
	if len(after) != len(before) {
		t.Fatalf("after the import: %v; want %v", ids(after), ids(before))
	}
	for i, b := range before {
		a := after[i]
		assert.Equal(t, b.ID, a.ID, "id")
		assert.Equal(t, b.Delivery.Body, a.Delivery.Body, b.ID+": body")
		p := func(d *amqp.Delivery) []any {
			return []any{d.ContentType, d.ContentEncoding, d.DeliveryMode, d.Priority, d.CorrelationId,
				d.ReplyTo, d.Expiration, d.MessageId, d.Timestamp, d.Type, d.UserId, d.AppId}
		}
		// The import makes a copy as the broker's are (see Import): one
		// that carried an Expiration, or was not persistent, keeps them
		// in headers.
		want := *b.Delivery
		want.Headers = maps.Clone(want.Headers)
		if want.Expiration != "" {
			want.Headers[broker.HeaderOriginalExpiration] = want.Expiration
			want.Expiration = ""
		}
		if want.DeliveryMode != amqp.Persistent {
			want.Headers[broker.HeaderOriginalDeliveryMode] = int64(want.DeliveryMode)
			want.DeliveryMode = amqp.Persistent
		}
		equalTypes(t, b.ID+": headers", a.Delivery.Headers, want.Headers)
		assert.Equal(t, p(&want), p(a.Delivery), b.ID+": properties")
	}
	_, err = f.in.Import(ctx, f.q, strings.NewReader("{}\nnot json\n"), ImportOptions{})
	assert.Contains(t, fmt.Sprint(err), "line 2", "Import of a bad line")
	_, err = f.in.Import(ctx, f.q, strings.NewReader(""), ImportOptions{To: f.q + "-missing"})
	require.ErrorIs(t, err, broker.ErrQueueNotFound, "Import to a missing queue")
	f.drain(f.q + ".dlq")
	f.assertSettled(t)
}

// exportTypes has a header of every AMQP type amqp091 supports, as
// amqp091 decodes them, with their extreme values. (Not an infinite or
// NaN float: RabbitMQ 3.10 closes the connection with INTERNAL_ERROR on
// one; TestTypedValueRoundTrip checks those without a server.)
func exportTypes() amqp.Table {
	return amqp.Table{
		"bool": false, "uint8": uint8(255), "int8": int8(-128), "int16": int16(math.MinInt16),
		"uint16": uint16(math.MaxUint16), "int32": int32(math.MinInt32), "uint32": uint32(math.MaxUint32),
		"int64": int64(math.MaxInt64), "float32": float32(math.SmallestNonzeroFloat32), "float64": math.MaxFloat64,
		"decimal": amqp.Decimal{Scale: 255, Value: math.MinInt32}, "string": "",
		"bytes": []byte{}, "time": time.Unix(0, 0), "void": nil, "array": []any{}, "table": amqp.Table{},
		"nested": []any{amqp.Table{"a": []any{[]byte("x"), nil, amqp.Table{"t": time.Unix(1, 0)}}}},
	}
}

// equalTypes reports a difference between got and want, Go types
// included, key by key.
func equalTypes(t *testing.T, what string, got, want amqp.Table) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("%s: %s missing; want %T %v", what, k, w, w)
		} else if !reflect.DeepEqual(g, w) {
			t.Errorf("%s: %s = %T %#v; want %T %#v", what, k, g, g, w, w)
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("%s: %s = %T %v; want none", what, k, g, g)
		}
	}
}

// The typed JSON of headers reads back type for type, without a server:
// every type, extreme values, NaN.
func TestTypedValueRoundTrip(t *testing.T) {
	for name, h := range map[string]amqp.Table{"allTypes": allTypes(), "exportTypes": exportTypes()} {
		d := &amqp.Delivery{Headers: h, Body: []byte("b"), MessageId: "m", Timestamp: time.Unix(5, 0), DeliveryMode: amqp.Persistent}
		m, err := ExportMessage("q", d)
		require.NoError(t, err, "Export")
		line, err := json.Marshal(m)
		require.NoError(t, err, "Marshal")
		var back ExportedMessage
		require.NoError(t, json.Unmarshal(line, &back), "Unmarshal")
		p, err := back.Publishing()
		require.NoError(t, err, "Publishing")
		want := rabbit.WireTable(h) // as the wire decodes it: int becomes int32
		equalTypes(t, name, p.Headers, want)
		assert.Equal(t, d.Timestamp, p.Timestamp, name+": timestamp")
	}
	m, err := ExportMessage("q", &amqp.Delivery{Headers: amqp.Table{"nan": math.NaN(), "nan32": float32(math.NaN()), "inf": math.Inf(-1)}})
	require.NoError(t, err, "Export")
	p, err := m.Publishing()
	require.NoError(t, err, "Publishing")
	if f, ok := p.Headers["nan"].(float64); !ok || !math.IsNaN(f) {
		t.Errorf("nan = %T %v; want float64 NaN", p.Headers["nan"], p.Headers["nan"])
	}
	if f, ok := p.Headers["nan32"].(float32); !ok || !math.IsNaN(float64(f)) {
		t.Errorf("nan32 = %T %v; want float32 NaN", p.Headers["nan32"], p.Headers["nan32"])
	}
	assert.Equal(t, math.Inf(-1), p.Headers["inf"], "inf")
	if _, err := ExportMessage("q", &amqp.Delivery{Headers: amqp.Table{"bad": struct{}{}}}); err == nil {
		t.Error("Export of a header of no AMQP type = nil; want an error")
	}
	for _, bad := range []string{
		`{"type":"int8","value":300}`, `{"type":"nope"}`, `{"type":"bytes","value":"!"}`,
		`{"type":"void","value":1}`, `{"type":"decimal","value":{"scale":-1,"value":0}}`,
		`{"type":"array","value":[{"type":"uint8","value":-1}]}`, `{"type":"timestamp","value":"soon"}`,
	} {
		var tv TypedValue
		require.NoError(t, json.Unmarshal([]byte(bad), &tv), "Unmarshal")
		if _, err := tv.decode(); err == nil {
			t.Errorf("decode(%s) = nil error; want one", bad)
		}
	}
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
