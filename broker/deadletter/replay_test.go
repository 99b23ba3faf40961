package deadletter

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
)

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
		assert.Equal(t, []string{f.q + ".delay.50ms expired 1"}, fixtures.DeathKeys(life["x-death"]), d.MessageId+": x-death in the history")
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
			assert.Equal(t, []string{f.q + ".delay.50ms expired 1"}, fixtures.DeathKeys(life["x-death"]), "x-death in the history")
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
			assert.Equal(t, []string{f.q + " " + reason + " 1"}, fixtures.DeathKeys(lives[0].(amqp.Table)["x-death"]), "server's x-death in the history")
			f.assertSettled(t)
		})
	}
}

// A message that the broker dead-lettered from another work queue, taken
// out of that dead-letter queue and forwarded whole to this work queue
// (by a shovel, or a producer), then dead-lettered by the server from
// this one (a consumer rejected it): its x-rabbitmw-original-queue names
// the other queue, and is older than the server's x-death record. It is
// a dead-letter of the server, whose queue Replay must be told: it
// refuses it (ErrNoDestination), and sends nothing to the other queue.
func testReplayForwardedDeadLetter(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	other := f.q + "-other"
	require.NoError(t, f.b.Declare(ctx, other, f.top), "Declare(%q)", other)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		assert.NoError(t, f.b.Delete(ctx, other, f.top), "Delete(%q)", other)
	})
	failed := time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
	f.publish("fwd", []byte("x"), amqp.Table{
		broker.HeaderOriginalQueue: other, broker.HeaderFailedAt: failed,
		broker.HeaderError: "failed in the other queue", rabbitmw.HeaderAttempts: int64(3),
	})
	d, ok, err := f.b.Get(ctx, f.q)
	require.NoError(t, err, "Get")
	require.True(t, ok, "Get: no message")
	require.NoError(t, d.Reject(false), "Reject")
	require.Eventually(t, func() bool { return f.length(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "message not dead-lettered by the server")

	dls, err := f.in.List(ctx, f.q, ListOptions{})
	require.NoError(t, err, "List")
	require.Len(t, dls, 1, "List")
	assert.Equal(t, "", dls[0].Queue, "queue of a message the server dead-lettered last")
	assert.Equal(t, f.q, dls[0].DeadLetteredFrom, "dead-lettered from")
	assert.Equal(t, "rejected", dls[0].Reason, "reason")
	_, err = f.in.Replay(ctx, f.q, ReplayOptions{})
	require.ErrorIs(t, err, ErrNoDestination, "Replay without To")
	assert.Equal(t, 0, f.length(other), "the other queue after the replay")
	assert.Equal(t, 1, f.length(f.q+".dlq"), "dead-letter queue after the refusal")
	f.drain(f.q + ".dlq")
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

// A dead letter found in a queue's dead-letter queue goes back to that
// queue, whatever its x-rabbitmw-original-queue header says: one whose
// header names another queue (forged, or stale: a file imported into the
// wrong dead-letter queue) is not sent there. The replay refuses, naming
// the message and both queues, and nothing moves, the messages that name
// their own queue included; To, the operator's choice, sends them all.
func testReplayForeignQueue(t *testing.T, be backend) {
	f := setup(t, be, broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	other := f.q + "-other"
	require.NoError(t, f.b.Declare(ctx, other, broker.Topology{}))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		assert.NoError(t, f.b.Delete(ctx, other, broker.Topology{}))
	})
	for _, m := range []struct{ id, queue string }{{"own", f.q}, {"foreign", other}, {"own-2", f.q}} {
		require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: m.id,
			Headers: amqp.Table{broker.HeaderOriginalQueue: m.queue}}))
	}

	res, err := f.in.Replay(ctx, f.q, ReplayOptions{})
	assert.Error(t, err, "Replay of a dead letter that names another queue")
	for _, want := range []string{`"foreign"`, strconv.Quote(other), strconv.Quote(f.q + ".dlq"), "nothing was replayed"} {
		assert.ErrorContains(t, err, want)
	}
	assert.Zero(t, res.Replayed, "replayed")
	assert.Zero(t, f.length(other), "messages in the queue the header names")
	assert.Zero(t, f.length(f.q), "messages in the work queue")
	assert.Equal(t, 3, f.length(f.q+".dlq"), "messages in the dead-letter queue")

	res, err = f.in.Replay(ctx, f.q, ReplayOptions{To: f.q})
	require.NoError(t, err, "Replay To the work queue")
	assert.Equal(t, 3, res.Replayed, "replayed")
	assert.Zero(t, f.length(other), "messages in the queue the header names")
	assert.ElementsMatch(t, []string{"own", "foreign", "own-2"}, deliveryIDs(f.drain(f.q)), "work queue")
	f.assertSettled(t)
}

// A replay whose context ends (the command's Ctrl-C) starts nothing more,
// but finishes what it has sent: each message sent and confirmed leaves
// the dead-letter queue, so that every message is in one queue, once, and
// the result counts what reached the work queue. On a server that takes
// 50 ms to confirm, the context ends at the first message replayed, with
// the others of the window still unconfirmed.
func TestReplayInterruptedFinishesWhatItSent(t *testing.T) {
	f := setup(t, backends[0], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	const n = 40
	for i := range n {
		require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: fmt.Sprintf("m%d", i),
			Headers: amqp.Table{broker.HeaderOriginalQueue: f.q}}))
	}
	f.mem.SetConfirmDelay(50 * time.Millisecond)
	rctx, interrupt := context.WithCancel(ctx)
	defer interrupt()
	res, err := f.in.Replay(rctx, f.q, ReplayOptions{Progress: func(done, total int) { interrupt() }})
	require.ErrorIs(t, err, context.Canceled, "Replay")
	f.mem.SetConfirmDelay(0)
	replayed := f.drain(f.q)
	left := f.drain(f.q + ".dlq")
	assert.Greater(t, res.Replayed, 1, "the messages in flight at the interrupt are replayed")
	assert.Equal(t, len(replayed), res.Replayed, "replayed, as the result says")
	assert.Equal(t, n, len(replayed)+len(left), "messages in the work queue and the dead-letter queue")
	f.assertSettled(t)
}

// An abort (an operator's second Ctrl-C) ends at once the wait of a
// replay whose context has ended for the messages in flight: the replay
// returns, and names them in InDoubt, in queue order; each is both in the
// work queue and back in the dead-letter queue, and nothing is lost. On a
// server that takes a minute to confirm, the window's messages are in the
// work queue, unconfirmed, when the context ends and the abort comes.
func TestReplayAbortedGivesUpAtOnce(t *testing.T) {
	f := setup(t, backends[0], broker.Topology{})
	ctx := testContext(t, 30*time.Second)
	const n = 40
	var want []string
	for i := range n {
		id := fmt.Sprintf("m%d", i)
		if i < replayWindow {
			want = append(want, id)
		}
		require.NoError(t, f.b.Publish(ctx, "", f.q+".dlq", amqp.Publishing{MessageId: id,
			Headers: amqp.Table{broker.HeaderOriginalQueue: f.q}}))
	}
	f.mem.SetConfirmDelay(time.Minute)
	abort := make(chan struct{})
	rctx, interrupt := context.WithCancel(WithAbort(ctx, abort))
	defer interrupt()
	aborted := make(chan time.Time, 1)
	go func() {
		assert.Eventually(t, func() bool {
			got, err := f.b.Len(ctx, f.q)
			return err == nil && got == replayWindow
		}, 10*time.Second, time.Millisecond, "the window's messages in the work queue")
		interrupt()
		close(abort)
		aborted <- time.Now()
	}()
	res, err := f.in.Replay(rctx, f.q, ReplayOptions{})
	took := time.Since(<-aborted)
	require.ErrorIs(t, err, context.Canceled, "Replay")
	assert.ErrorContains(t, err, "given up on before its confirm")
	assert.Less(t, took, finishWithin/2, "from the abort to the return")
	f.mem.SetConfirmDelay(0)
	assert.Zero(t, res.Replayed, "replayed")
	assert.Equal(t, want, ids(res.InDoubt), "in doubt")
	assert.ElementsMatch(t, want, deliveryIDs(f.drain(f.q)), "the work queue")
	assert.Len(t, f.drain(f.q+".dlq"), n, "the dead-letter queue")
	f.assertSettled(t)
}
