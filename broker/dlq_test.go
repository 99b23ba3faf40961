package broker

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

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
)

// dlqBehaviours run on both backends, like behaviours.
var dlqBehaviours = []struct {
	name string
	run  func(t *testing.T, be backend)
}{
	{"ListKeepsTheQueue", testListKeepsTheQueue},
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
			for _, c := range dlqBehaviours {
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
	}), ConsumeOptions{Workers: 1})
	for _, id := range ids {
		f.publish(id, []byte("body of "+id), headers)
	}
	eventually(t, 30*time.Second, "messages not dead-lettered", func() bool { return f.length(f.q+".dlq") == dlq0+len(ids) })
	noErr(t, "Consume after cancel", r.stop(t))
}

func ids(dls []*DeadLetter) []string {
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
	f := setup(t, be, Topology{})
	ctx := testContext(t, 30*time.Second)
	var all []string
	for i := range 12 {
		all = append(all, fmt.Sprintf("m%02d", i))
	}
	all = append(all, "typed-1")
	before := time.Now().Add(-time.Second)
	f.deadLetter(t, false, nil, all...)
	for range 2 {
		dls, err := f.b.DeadLetters(ctx, f.q, ListOptions{})
		noErr(t, "DeadLetters", err)
		equal(t, "ids listed", ids(dls), all)
	}
	dls, err := f.b.DeadLetters(ctx, f.q, ListOptions{Filter: Filter{IDs: []string{"typed-1"}}})
	noErr(t, "DeadLetters", err)
	if len(dls) != 1 {
		t.Fatalf("DeadLetters(typed-1) = %v; want one", ids(dls))
	}
	dl := dls[0]
	equal(t, "queue", dl.Queue, f.q)
	equal(t, "error type", dl.ErrorType, "*broker.typedErr")
	equal(t, "error", dl.Error, "typed failure of typed-1")
	equal(t, "attempts", dl.Attempts, 1)
	equal(t, "body size", dl.BodySize, len("body of typed-1"))
	equal(t, "host", dl.Host, "test-host")
	equal(t, "process", dl.Process, f.process)
	equal(t, "malformed", dl.Malformed, []string(nil))
	if dl.LastFailure.Before(before.Truncate(time.Second)) || dl.LastFailure.After(time.Now()) || dl.FirstFailure.After(dl.LastFailure) {
		t.Errorf("first, last failure = %v, %v; want in [%v, now], first not after last", dl.FirstFailure, dl.LastFailure, before)
	}

	dls, err = f.b.DeadLetters(ctx, f.q, ListOptions{Filter: Filter{ErrorType: "error"}, Limit: 3})
	noErr(t, "DeadLetters", err)
	equal(t, "first 3 of an error type", ids(dls), all[:3])
	dls, err = f.b.DeadLetters(ctx, f.q, ListOptions{Filter: Filter{Until: before}})
	noErr(t, "DeadLetters", err)
	equal(t, "failed before the test", ids(dls), []string{})
	var progress []int
	dls, err = f.b.DeadLetters(ctx, f.q, ListOptions{
		Filter:   Filter{Since: before, Match: func(dl *DeadLetter) bool { return strings.HasSuffix(dl.ID, "1") }},
		Progress: func(done, total int) { progress = append(progress, done, total) },
	})
	noErr(t, "DeadLetters", err)
	equal(t, "matched by func", ids(dls), []string{"m01", "m11", "typed-1"})
	equal(t, "last progress", progress[len(progress)-2:], []int{len(all), len(all)})
	equal(t, "left in the dead-letter queue, in order", deliveryIDs(f.drain(f.q+".dlq")), all)
	f.assertSettled(t)
}

// Replay sends back what it selects, with the fault headers moved into
// the history, and leaves the rest in order; a dry run moves nothing.
func testReplaySelected(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 30*time.Second)
	all := []string{"a", "typed-b", "c", "typed-d", "e", "typed-f"}
	f.deadLetter(t, true, amqp.Table{"custom": "kept"}, all...)

	res, err := f.b.Replay(ctx, f.q, ReplayOptions{Filter: Filter{ErrorType: "*broker.typedErr"}, DryRun: true})
	noErr(t, "Replay dry run", err)
	equal(t, "dry run: selected", ids(res.Selected), []string{"typed-b", "typed-d", "typed-f"})
	equal(t, "dry run: replayed", res.Replayed, 0)
	equal(t, "dry run: work queue", f.length(f.q), 0)

	var (
		mu       sync.Mutex
		reset    []string
		progress [][2]int
	)
	res, err = f.b.Replay(ctx, f.q, ReplayOptions{
		Filter: Filter{ErrorType: "*broker.typedErr"},
		Limit:  2,
		ResetFailures: func(_ context.Context, d *amqp.Delivery) error {
			mu.Lock()
			defer mu.Unlock()
			reset = append(reset, d.MessageId)
			return nil
		},
		Progress: func(done, total int) { progress = append(progress, [2]int{done, total}) },
	})
	noErr(t, "Replay", err)
	equal(t, "scanned", res.Scanned, len(all))
	equal(t, "replayed", res.Replayed, 2)
	slices.Sort(reset)
	equal(t, "failures reset", reset, []string{"typed-b", "typed-d"})
	equal(t, "progress", progress, [][2]int{{1, 2}, {2, 2}})
	back := f.drain(f.q)
	slices.SortFunc(back, func(a, b *amqp.Delivery) int { return strings.Compare(a.MessageId, b.MessageId) })
	equal(t, "back in the work queue", deliveryIDs(back), []string{"typed-b", "typed-d"})
	for _, d := range back {
		for _, k := range historyHeaders {
			if v, ok := d.Headers[k]; ok {
				t.Errorf("%s: header %s = %v after the replay; want it in the history", d.MessageId, k, v)
			}
		}
		equal(t, d.MessageId+": custom header", d.Headers["custom"], "kept")
		equal(t, d.MessageId+": body", string(d.Body), "body of "+d.MessageId)
		equal(t, d.MessageId+": content type", d.ContentType, "text/plain")
		equal(t, d.MessageId+": replays", d.Headers[HeaderReplays], int64(1))
		equal(t, d.MessageId+": original routing key", d.Headers[HeaderOriginalRoutingKey], f.q)
		lives, _ := d.Headers[HeaderHistory].([]any)
		if len(lives) != 1 {
			t.Fatalf("%s: history = %v; want one life", d.MessageId, d.Headers[HeaderHistory])
		}
		life, _ := lives[0].(amqp.Table)
		equal(t, d.MessageId+": error in the history", life[HeaderError], "typed failure of "+d.MessageId)
		equal(t, d.MessageId+": dead-letter queue in the history", life["dead-letter-queue"], f.q+".dlq")
		equal(t, d.MessageId+": x-death in the history", deathKeys(life["x-death"]), []string{f.q + ".delay.50ms expired 1"})
	}
	equal(t, "left in the dead-letter queue, in order", deliveryIDs(f.drain(f.q+".dlq")), []string{"a", "c", "e", "typed-f"})
	f.assertSettled(t)
}

// A replayed message that fails again has fresh fault headers and keeps
// its history; replayed again and again, the history is capped, the count
// is not. Then, with its cause fixed, it succeeds.
func testReplayFailsAgain(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
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
	}), ConsumeOptions{Workers: 1})
	for round := 1; round <= 3; round++ {
		res, err := f.b.Replay(ctx, f.q, ReplayOptions{HistoryLimit: 2})
		noErr(t, "Replay", err)
		equal(t, "replayed", res.Replayed, 1)
		eventually(t, 20*time.Second, "replayed message not dead-lettered again", func() bool {
			mu.Lock()
			defer mu.Unlock()
			return len(calls) == round && f.length(f.q+".dlq") == 1
		})
		dls, err := f.b.DeadLetters(ctx, f.q, ListOptions{})
		noErr(t, "DeadLetters", err)
		d := dls[0].Message
		equal(t, "fresh error", d.Headers[HeaderError], fmt.Sprintf("round %d", round))
		equal(t, "fresh attempts", d.Headers[rabbitmw.HeaderAttempts], int64(1))
		equal(t, "fresh x-death", d.Headers["x-death"], nil)
		equal(t, "replays", d.Headers[HeaderReplays], int64(round))
		lives, _ := d.Headers[HeaderHistory].([]any)
		var errs []any
		for _, l := range lives {
			errs = append(errs, l.(amqp.Table)[HeaderError])
		}
		want := []any{"failure of m: boom", "round 1", "round 2"}[:round]
		slices.Reverse(want)
		equal(t, "errors in the history, most recent first", errs, want[:min(2, round)])
		if round == 1 {
			life := lives[0].(amqp.Table)
			equal(t, "x-death in the history", deathKeys(life["x-death"]), []string{f.q + ".delay.50ms expired 1"})
		}
	}
	mu.Lock()
	fixed = true
	mu.Unlock()
	_, err := f.b.Replay(ctx, f.q, ReplayOptions{})
	noErr(t, "Replay", err)
	eventually(t, 20*time.Second, "fixed message not handled", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(calls) == 4
	})
	noErr(t, "Consume after cancel", r.stop(t))
	f.assertSettled(t)
}

// Messages the server dead-lettered (expired in the work queue, or past a
// quorum queue's delivery limit) have no fault headers: replaying them
// needs To, and without it nothing moves. Replayed, they fail once with a
// retry and then succeed: the delay copy is not dropped as a cycle.
func testReplayServerDeadLetters(t *testing.T, be backend) {
	for _, quorum := range []bool{false, true} {
		t.Run(map[bool]string{false: "expired", true: "delivery_limit"}[quorum], func(t *testing.T) {
			top := Topology{}
			if quorum {
				top = Topology{Quorum: true, DeliveryLimit: 1}
			}
			f := setup(t, be, top)
			ctx := testContext(t, 60*time.Second)
			for _, id := range []string{"x", "y"} {
				noErr(t, "Publish", f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: id, Body: []byte(id), Expiration: map[bool]string{false: "1", true: ""}[quorum]}))
			}
			if quorum {
				for range 20 {
					d, ok, err := f.b.Get(ctx, f.q)
					noErr(t, "Get", err)
					if !ok {
						break
					}
					noErr(t, "Nack", d.Nack(false, true))
				}
			}
			eventually(t, 20*time.Second, "messages not dead-lettered by the server", func() bool { return f.length(f.q+".dlq") == 2 })
			dls, err := f.b.DeadLetters(ctx, f.q, ListOptions{})
			noErr(t, "DeadLetters", err)
			equal(t, "dead-lettered from", dls[0].DeadLetteredFrom, f.q)
			equal(t, "queue", dls[0].Queue, "")

			_, err = f.b.Replay(ctx, f.q, ReplayOptions{})
			isErr(t, "Replay without To", err, ErrNoDestination)
			contains(t, "Replay error", fmt.Sprint(err), `"x", "y"`)
			equal(t, "dead-letter queue after the refusal", f.length(f.q+".dlq"), 2)
			equal(t, "work queue after the refusal", f.length(f.q), 0)

			j := newJournal()
			r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				if j.record(d) == 1 {
					return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
				}
				return nil
			}), ConsumeOptions{})
			res, err := f.b.Replay(ctx, f.q, ReplayOptions{To: f.q})
			noErr(t, "Replay", err)
			equal(t, "replayed", res.Replayed, 2)
			eventually(t, 20*time.Second, "replayed messages not handled after their retry", func() bool {
				return len(j.callsOf("x")) == 2 && len(j.callsOf("y")) == 2
			})
			noErr(t, "Consume after cancel", r.stop(t))
			first := j.callsOf("x")[0].d
			lives, _ := first.Headers[HeaderHistory].([]any)
			if len(lives) != 1 {
				t.Fatalf("history = %v; want one life", first.Headers[HeaderHistory])
			}
			reason := map[bool]string{false: "expired", true: "delivery_limit"}[quorum]
			equal(t, "server's x-death in the history", deathKeys(lives[0].(amqp.Table)["x-death"]), []string{f.q + " " + reason + " 1"})
			f.assertSettled(t)
		})
	}
}

// A replay to a queue that does not exist is refused before anything
// moves.
func testReplayMissingQueue(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "b")
	_, err := f.b.Replay(ctx, f.q, ReplayOptions{To: f.q + "-missing"})
	isErr(t, "Replay to a missing queue", err, ErrQueueNotFound)
	equal(t, "dead-letter queue", deliveryIDs(f.drain(f.q+".dlq")), []string{"a", "b"})
	_, err = f.b.Replay(ctx, f.q+"-missing", ReplayOptions{})
	isErr(t, "Replay from a missing dead-letter queue", err, ErrQueueNotFound)
	f.assertSettled(t)
}

// Headers of the wrong types are listed as malformed, replayed, purged,
// exported: never a crash.
func testDLQMalformed(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 30*time.Second)
	bad := amqp.Table{
		HeaderOriginalQueue: int32(7), HeaderFailedAt: "yesterday", HeaderError: []byte("bytes"),
		HeaderErrorType: nil, rabbitmw.HeaderAttempts: "many", HeaderReplays: amqp.Table{},
		HeaderHistory: "not an array", "x-death": []any{"not a table"}, "x-first-death-queue": int64(1),
	}
	noErr(t, "Publish", f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: "bad", Headers: bad}))
	noErr(t, "Publish", f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: "bad-history", Headers: amqp.Table{
		HeaderOriginalQueue: f.q, HeaderHistory: []any{"not a table", amqp.Table{HeaderFailedAt: 3}},
	}}))
	dls, err := f.b.DeadLetters(ctx, f.q, ListOptions{})
	noErr(t, "DeadLetters", err)
	if len(dls) != 2 {
		t.Fatalf("DeadLetters = %v; want 2", ids(dls))
	}
	slices.Sort(dls[0].Malformed)
	want := []string{HeaderError, HeaderErrorType, HeaderFailedAt, HeaderHistory, HeaderOriginalQueue, HeaderReplays, rabbitmw.HeaderAttempts, "x-death", "x-first-death-queue"}
	slices.Sort(want)
	equal(t, "malformed", dls[0].Malformed, want)
	_, err = f.b.Replay(ctx, f.q, ReplayOptions{Filter: Filter{IDs: []string{"bad"}}})
	isErr(t, "Replay without a destination", err, ErrNoDestination)
	var out bytes.Buffer
	n, err := f.b.ExportDeadLetters(ctx, f.q, &out, ExportOptions{})
	noErr(t, "Export", err)
	equal(t, "exported", n, 2)
	res, err := f.b.Replay(ctx, f.q, ReplayOptions{To: f.q})
	noErr(t, "Replay", err)
	equal(t, "replayed", res.Replayed, 2)
	back := f.drain(f.q)
	slices.SortFunc(back, func(a, b *amqp.Delivery) int { return strings.Compare(a.MessageId, b.MessageId) })
	equal(t, "replayed", deliveryIDs(back), []string{"bad", "bad-history"})
	equal(t, "replays after a malformed count", back[0].Headers[HeaderReplays], int64(1))
	lives, _ := back[0].Headers[HeaderHistory].([]any)
	if len(lives) != 1 || lives[0].(amqp.Table)[HeaderHistory] != "not an array" {
		t.Errorf("history = %v; want one life keeping the malformed history", back[0].Headers[HeaderHistory])
	}
	lives, _ = back[1].Headers[HeaderHistory].([]any)
	equal(t, "lives of bad-history", len(lives), 3)
	f.assertSettled(t)
}

// Purge removes what it selects and leaves the rest in order.
func testPurgeSelected(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, false, nil, "a", "typed-b", "c", "typed-d")
	removed, err := f.b.PurgeDeadLetters(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*broker.typedErr"}, DryRun: true})
	noErr(t, "Purge dry run", err)
	equal(t, "selected", ids(removed), []string{"typed-b", "typed-d"})
	equal(t, "dead-letter queue after a dry run", f.length(f.q+".dlq"), 4)
	removed, err = f.b.PurgeDeadLetters(ctx, f.q, PurgeOptions{Filter: Filter{ErrorType: "*broker.typedErr"}})
	noErr(t, "Purge", err)
	equal(t, "removed", ids(removed), []string{"typed-b", "typed-d"})
	equal(t, "left", deliveryIDs(f.drain(f.q+".dlq")), []string{"a", "c"})
	f.assertSettled(t)
}

// Exported, purged and imported back, the messages are the same: body,
// properties, and headers type for type.
func testExportImport(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 30*time.Second)
	f.deadLetter(t, true, allTypes(), "a", "b")
	noErr(t, "Publish", f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{
		Headers: exportTypes(), Body: []byte{0, 1, 2, 0xff}, ContentType: "application/octet-stream",
		ContentEncoding: "identity", DeliveryMode: amqp.Transient, Priority: 3, CorrelationId: "corr",
		ReplyTo: "reply", Expiration: "600000", MessageId: "props", Timestamp: time.Unix(1700000000, 0),
		Type: "kind", AppId: "app",
	}))
	before, err := f.b.DeadLetters(ctx, f.q, ListOptions{})
	noErr(t, "DeadLetters", err)
	var out bytes.Buffer
	n, err := f.b.ExportDeadLetters(ctx, f.q, &out, ExportOptions{})
	noErr(t, "Export", err)
	equal(t, "exported", n, 3)
	equal(t, "lines", strings.Count(out.String(), "\n"), 3)
	equal(t, "dead-letter queue after the export", f.length(f.q+".dlq"), 3)
	_, err = f.b.PurgeDeadLetters(ctx, f.q, PurgeOptions{})
	noErr(t, "Purge", err)
	n, err = f.b.ImportDeadLetters(ctx, f.q, bytes.NewReader(out.Bytes()), ImportOptions{})
	noErr(t, "Import", err)
	equal(t, "imported", n, 3)
	after, err := f.b.DeadLetters(ctx, f.q, ListOptions{})
	noErr(t, "DeadLetters", err)
	if len(after) != len(before) {
		t.Fatalf("after the import: %v; want %v", ids(after), ids(before))
	}
	for i, b := range before {
		a := after[i]
		equal(t, "id", a.ID, b.ID)
		equal(t, b.ID+": body", a.Message.Body, b.Message.Body)
		p := func(d *amqp.Delivery) []any {
			return []any{d.ContentType, d.ContentEncoding, d.DeliveryMode, d.Priority, d.CorrelationId,
				d.ReplyTo, d.Expiration, d.MessageId, d.Timestamp, d.Type, d.UserId, d.AppId}
		}
		// The import makes a copy as the broker's are (see asCopy): one
		// that carried an Expiration, or was not persistent, keeps them
		// in headers.
		want := *b.Message
		want.Headers = maps.Clone(want.Headers)
		if want.Expiration != "" {
			want.Headers[HeaderOriginalExpiration] = want.Expiration
			want.Expiration = ""
		}
		if want.DeliveryMode != amqp.Persistent {
			want.Headers[HeaderOriginalDeliveryMode] = int64(want.DeliveryMode)
			want.DeliveryMode = amqp.Persistent
		}
		equalTypes(t, b.ID+": headers", a.Message.Headers, want.Headers)
		assert.Equal(t, p(&want), p(a.Message), b.ID+": properties")
	}
	_, err = f.b.ImportDeadLetters(ctx, f.q, strings.NewReader("{}\nnot json\n"), ImportOptions{})
	contains(t, "Import of a bad line", fmt.Sprint(err), "line 2")
	_, err = f.b.ImportDeadLetters(ctx, f.q, strings.NewReader(""), ImportOptions{To: f.q + "-missing"})
	isErr(t, "Import to a missing queue", err, ErrQueueNotFound)
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
		noErr(t, "Export", err)
		line, err := json.Marshal(m)
		noErr(t, "Marshal", err)
		var back ExportedMessage
		noErr(t, "Unmarshal", json.Unmarshal(line, &back))
		p, err := back.Publishing()
		noErr(t, "Publishing", err)
		want := rabbit.WireTable(h) // as the wire decodes it: int becomes int32
		equalTypes(t, name, p.Headers, want)
		equal(t, name+": timestamp", p.Timestamp, d.Timestamp)
	}
	m, err := ExportMessage("q", &amqp.Delivery{Headers: amqp.Table{"nan": math.NaN(), "nan32": float32(math.NaN()), "inf": math.Inf(-1)}})
	noErr(t, "Export", err)
	p, err := m.Publishing()
	noErr(t, "Publishing", err)
	if f, ok := p.Headers["nan"].(float64); !ok || !math.IsNaN(f) {
		t.Errorf("nan = %T %v; want float64 NaN", p.Headers["nan"], p.Headers["nan"])
	}
	if f, ok := p.Headers["nan32"].(float32); !ok || !math.IsNaN(float64(f)) {
		t.Errorf("nan32 = %T %v; want float32 NaN", p.Headers["nan32"], p.Headers["nan32"])
	}
	equal(t, "inf", p.Headers["inf"], math.Inf(-1))
	if _, err := ExportMessage("q", &amqp.Delivery{Headers: amqp.Table{"bad": struct{}{}}}); err == nil {
		t.Error("Export of a header of no AMQP type = nil; want an error")
	}
	for _, bad := range []string{
		`{"type":"int8","value":300}`, `{"type":"nope"}`, `{"type":"bytes","value":"!"}`,
		`{"type":"void","value":1}`, `{"type":"decimal","value":{"scale":-1,"value":0}}`,
		`{"type":"array","value":[{"type":"uint8","value":-1}]}`, `{"type":"timestamp","value":"soon"}`,
	} {
		var tv TypedValue
		noErr(t, "Unmarshal", json.Unmarshal([]byte(bad), &tv))
		if _, err := tv.decode(); err == nil {
			t.Errorf("decode(%s) = nil error; want one", bad)
		}
	}
}
