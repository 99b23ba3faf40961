package broker

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
	"github.com/rabbitmw/rabbitmw/internal/header"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// behaviours is the shared table: every case runs against the memory server
// and against RabbitMQ.
var behaviours = []struct {
	name string
	run  func(t *testing.T, be backend)
}{
	{"Flow", testFlow},
	{"FlowQuorum", testFlowQuorum},
	{"DelayedRetriesThenDeadLetter", testRetriesThenDeadLetter},
	{"DelayBeyondLongestTier", testDelayBeyondLongestTier},
	{"PanicIsDeadLettered", testPanic},
	{"CopyNotPublishedIsRequeued", testCopyFailure},
	{"ShutdownWithHandlersInFlight", testShutdownInFlight},
	{"ShutdownTimeout", testShutdownTimeout},
	{"ConnectionLoss", testConnectionLoss},
	{"SlowHandlerDoesNotStallReconnection", testSlowHandlerReconnects},
	{"ResultsAfterTheShutdownDeadline", testLateResults},
	{"PublishWithDoneContextSendsNothing", testPublishWithDoneContext},
	{"QuorumDeliveryLimit", testQuorumDeliveryLimit},
	{"RejectGoesToDeadLetterQueue", testReject},
	{"DeadLetterCycleRule", testDeadLetterCycleRule},
	{"ReplayOfExpiredMessages", testReplayExpired},
	{"ReplayOfMessagesOverTheDeliveryLimit", testReplayDeliveryLimit},
	{"HeadersOfEveryType", testHeaderTypes},
	{"LargeBodies", testLargeBodies},
	{"DeclareNoneMissingQueue", testDeclareNoneMissing},
	{"QueueWithOtherArguments", testOtherArguments},
	{"ServerDownAtStart", testServerDown},
	{"ConsumerCancelledByServer", testConsumerCancelled},
	{"PublishConfirmsAndMessageID", testPublishConfirms},
	{"PublishUnroutable", testPublishUnroutable},
	{"PublishConcurrent", testPublishConcurrent},
	{"Observer", testObserver},
	{"PublishInvalidMessage", testPublishInvalid},
	{"PublishInvalidSenderKeys", testPublishInvalidSenderKeys},
	{"PublishFrameBoundary", testPublishFrameBoundary},
	{"DeadLetterCopyCutToFit", testDeadLetterCopyCutToFit},
	{"DelayCopyTooBigIsDeadLettered", testDelayCopyTooBigIsDeadLettered},
	{"CopyThatCannotBeSentIsRejected", testCopyThatCannotBeSentIsRejected},
	{"MultipleAckSemantics", testMultipleAckSemantics},
	{"CoalescedAcks", testCoalescedAcks},
}

func TestBehaviour(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			for _, c := range behaviours {
				t.Run(c.name, func(t *testing.T) { c.run(t, be) })
			}
		})
	}
}

// assertSettled checks that queue and the support queues are empty and, on
// the memory server, that nothing is unsettled and no settlement used an
// unknown delivery tag.
func (f *fixture) assertSettled(t *testing.T) {
	t.Helper()
	if n := f.length(f.q); n != 0 {
		t.Errorf("Len(%q) = %d; want 0", f.q, n)
	}
	if n := f.length(f.q + ".dlq"); n != 0 {
		t.Errorf("Len(dlq) = %d; want 0", n)
	}
	if f.mem != nil {
		if n := f.mem.Unacked(f.q); n != 0 {
			t.Errorf("unacked(%q) = %d; want 0", f.q, n)
		}
		if s := f.mem.Stats(); s.UnknownTags != 0 {
			t.Errorf("settlements with unknown delivery tags = %d; want 0", s.UnknownTags)
		}
	}
	if n := f.logs.Count("unknown delivery tag"); n != 0 {
		t.Errorf("log records about unknown delivery tags = %d; want 0", n)
	}
}

func flow(t *testing.T, f *fixture, n int) {
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return nil
	}), ConsumeOptions{Workers: 8})
	for i := range n {
		f.publish(fmt.Sprintf("m%d", i), []byte("body"), nil)
	}
	require.Eventually(t, func() bool { return j.effected() == n }, 30*time.Second, 10*time.Millisecond, "not every message handled")
	require.NoError(t, r.stop(t), "Consume after cancel")
	for i := range n {
		if calls := j.callsOf(fmt.Sprintf("m%d", i)); len(calls) != 1 {
			t.Errorf("message m%d handled %d times; want 1", i, len(calls))
		}
	}
	f.assertSettled(t)
	assert.Equal(t, 1, f.logs.Count("broker: consuming"), "consumer sessions")
	assert.Equal(t, 1, f.logs.Count("broker: consumer stopped"), "stop records")
}

// N messages through a handler: each handled and acked once, queue empty.
func testFlow(t *testing.T, be backend) {
	flow(t, setup(t, be, Topology{}), 300)
}

// The same on a quorum queue; and a message requeued, then delayed: the
// x-delivery-count the quorum queue added is kept through the hop.
func testFlowQuorum(t *testing.T, be backend) {
	f := setup(t, be, Topology{Quorum: true})
	flow(t, f, 100)

	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		switch j.record(d) {
		case 1:
			return errBoom // requeue
		case 2:
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		return nil
	}), ConsumeOptions{})
	f.publish("q1", []byte("x"), nil)
	require.Eventually(t, func() bool { return len(j.callsOf("q1")) == 3 }, 20*time.Second, 10*time.Millisecond, "message not handled three times")
	require.NoError(t, r.stop(t), "Consume after cancel")
	calls := j.callsOf("q1")
	for i, want := range []any{nil, int64(1), int64(1)} {
		assert.Equal(t, want, calls[i].d.Headers["x-delivery-count"], "x-delivery-count of delivery %d", i+1)
	}
	assert.True(t, calls[1].d.Redelivered, "Redelivered of the requeued delivery")
	if gap := calls[2].at.Sub(calls[1].at); gap < 50*time.Millisecond {
		t.Errorf("retry came after %v; want >= 50ms", gap)
	}
	f.assertSettled(t)
}

var errBoom = errors.New("boom")

// A failing message is retried after the delays it asks for, then
// dead-lettered once with its fault headers; a permanent error (a body the
// handler cannot parse) is dead-lettered at once.
func testRetriesThenDeadLetter(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	asked := []time.Duration{50 * time.Millisecond, 150 * time.Millisecond, 300 * time.Millisecond}
	wantTier := []string{".delay.50ms", ".delay.200ms", ".delay.1s"}
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		n := j.record(d)
		if d.MessageId == "bad-json" {
			var v any
			return rabbitmw.Permanent(fmt.Errorf("decode order: %w", json.Unmarshal(d.Body, &v)))
		}
		if n <= len(asked) {
			return rabbitmw.RetryAfter(rabbitmw.WithAttempts(errBoom, n), asked[n-1])
		}
		return rabbitmw.Permanent(rabbitmw.WithAttempts(errBoom, n))
	}), ConsumeOptions{})
	start := time.Now()
	f.publish("retry", []byte("payload"), amqp.Table{"custom": "kept"})
	f.publish("bad-json", []byte("{not json"), nil)
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 2 }, 30*time.Second, 10*time.Millisecond, "dead-letter queue did not get 2 messages")
	require.NoError(t, r.stop(t), "Consume after cancel")

	calls := j.callsOf("retry")
	if len(calls) != len(asked)+1 {
		t.Fatalf("handler calls of the retried message = %d; want %d", len(calls), len(asked)+1)
	}
	for i := 1; i < len(calls); i++ {
		gap := calls[i].at.Sub(calls[i-1].at)
		if gap < asked[i-1] {
			t.Errorf("attempt %d came %v after attempt %d; want >= %v", i+1, gap, i, asked[i-1])
		}
		if gap > asked[i-1]+10*time.Second {
			t.Errorf("attempt %d came %v after attempt %d; want about %v", i+1, gap, i, asked[i-1])
		}
		d := calls[i].d
		assert.Equal(t, i, rabbitmw.PriorAttempts(&d), "attempt %d: PriorAttempts", i+1)
		deaths, _ := d.Headers["x-death"].([]any)
		if len(deaths) == 0 {
			t.Fatalf("attempt %d: x-death = %v; want the delay queue's record", i+1, d.Headers["x-death"])
		}
		last, _ := deaths[0].(amqp.Table)
		assert.Equal(t, f.q+wantTier[i-1], last["queue"], "attempt %d: x-death[0].queue", i+1)
		assert.Equal(t, "", d.Headers[HeaderOriginalExchange], "original exchange header")
		assert.Equal(t, f.q, d.Headers[HeaderOriginalRoutingKey], "original routing key header")
		assert.Equal(t, "kept", d.Headers["custom"], "custom header")
		assert.Equal(t, []byte("payload"), d.Body, "body")
	}
	assert.Equal(t, 1, len(j.callsOf("bad-json")), "handler calls of the unparseable message")

	dead := f.drain(f.q + ".dlq")
	if len(dead) != 2 {
		t.Fatalf("dead-letter queue holds %d messages; want 2 (one copy of each)", len(dead))
	}
	byID := map[string]*amqp.Delivery{}
	for _, d := range dead {
		byID[d.MessageId] = d
	}
	end := time.Now()
	d := byID["retry"]
	if d == nil {
		t.Fatalf("dead-letter queue holds %q and %q; want the retried message", dead[0].MessageId, dead[1].MessageId)
	}
	assert.Equal(t, "boom", d.Headers[HeaderError], HeaderError)
	assert.Equal(t, "error", d.Headers[HeaderErrorType], HeaderErrorType)
	assert.Equal(t, int64(len(asked)+1), d.Headers[rabbitmw.HeaderAttempts], rabbitmw.HeaderAttempts)
	assert.Equal(t, "", d.Headers[HeaderOriginalExchange], HeaderOriginalExchange)
	assert.Equal(t, f.q, d.Headers[HeaderOriginalRoutingKey], HeaderOriginalRoutingKey)
	assert.Equal(t, f.q, d.Headers[HeaderOriginalQueue], HeaderOriginalQueue)
	assert.Equal(t, "test-host", d.Headers[HeaderHost], HeaderHost)
	assert.Equal(t, f.process, d.Headers[HeaderProcess], HeaderProcess)
	assert.Equal(t, "kept", d.Headers["custom"], "custom header")
	assert.Equal(t, []byte("payload"), d.Body, "body")
	assert.Equal(t, "text/plain", d.ContentType, "ContentType")
	assert.Equal(t, uint8(amqp.Persistent), d.DeliveryMode, "DeliveryMode")
	if at, ok := d.Headers[HeaderFailedAt].(time.Time); !ok {
		t.Errorf("%s = %#v; want a timestamp", HeaderFailedAt, d.Headers[HeaderFailedAt])
	} else if at.Before(start.Truncate(time.Second)) || at.After(end) {
		t.Errorf("%s = %v; want in [%v, %v]", HeaderFailedAt, at, start, end)
	}
	p := byID["bad-json"]
	if p == nil {
		t.Fatal("unparseable message not in the dead-letter queue")
	}
	text, _ := p.Headers[HeaderError].(string)
	assert.Contains(t, text, "decode order: invalid character", HeaderError)
	assert.Equal(t, "*json.SyntaxError", p.Headers[HeaderErrorType], HeaderErrorType)
	assert.Equal(t, int64(1), p.Headers[rabbitmw.HeaderAttempts], rabbitmw.HeaderAttempts+" when no layer counted")
	assert.Equal(t, f.q, p.Headers[HeaderOriginalRoutingKey], HeaderOriginalRoutingKey)
	f.assertSettled(t)
	for _, tr := range f.top.Delays {
		assert.Equal(t, 0, f.length(f.q+".delay."+tierName(tr)), "Len(delay queue "+tierName(tr)+")")
	}
}

// A delay longer than the longest tier is honoured through HeaderNotBefore,
// without running the handler early.
func testDelayBeyondLongestTier(t *testing.T, be backend) {
	f := setup(t, be, Topology{Delays: []time.Duration{50 * time.Millisecond, 200 * time.Millisecond}})
	const asked = 700 * time.Millisecond
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) == 1 {
			return rabbitmw.RetryAfter(errBoom, asked)
		}
		return nil
	}), ConsumeOptions{})
	f.publish("late", []byte("x"), nil)
	require.Eventually(t, func() bool { return len(j.callsOf("late")) >= 2 }, 20*time.Second, 10*time.Millisecond, "delayed message not handled again")
	require.NoError(t, r.stop(t), "Consume after cancel")
	calls := j.callsOf("late")
	if len(calls) != 2 {
		t.Fatalf("handler calls = %d; want 2 (not run before due)", len(calls))
	}
	if gap := calls[1].at.Sub(calls[0].at); gap < asked {
		t.Errorf("handled again after %v; want >= %v", gap, asked)
	}
	deaths, _ := calls[1].d.Headers["x-death"].([]any)
	if len(deaths) == 0 {
		t.Fatal("no x-death on the delayed message")
	}
	// The record of the 200 ms tier: on a loaded machine the last hop may
	// be through the 50 ms tier, whose record then stands first.
	var count int64
	for _, d := range deaths {
		if rec, _ := d.(amqp.Table); rec["queue"] == f.q+".delay.200ms" {
			count, _ = header.Integer(rec["count"])
		}
	}
	if count < 3 {
		t.Errorf("hops through the 200ms tier (x-death count) = %d; want >= 3", count)
	}
	f.assertSettled(t)
}

// A panic that escapes the handler dead-letters the message, is logged at
// Error, and the consumer goes on.
func testPanic(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		if d.MessageId == "poison" {
			panic("boom")
		}
		return nil
	}), ConsumeOptions{})
	f.publish("poison", []byte("x"), nil)
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "panicking message not dead-lettered")
	f.publish("after", []byte("x"), nil)
	require.Eventually(t, func() bool { return len(j.callsOf("after")) == 1 }, 20*time.Second, 10*time.Millisecond, "consumer stopped after a panic")
	require.NoError(t, r.stop(t), "Consume after cancel")
	assert.Equal(t, 1, len(j.callsOf("poison")), "handler calls of the panicking message")
	dead := f.onlyDeadLetter()
	assert.Equal(t, "panic: boom", dead.Headers[HeaderError], HeaderError)
	assert.Equal(t, "panic", dead.Headers[HeaderErrorType], HeaderErrorType)
	assert.Equal(t, 1, f.logs.Count("ERROR", "panicked", "poison"), "panic records at Error")
	f.assertSettled(t)
}

// When the delayed or dead-lettered copy cannot be published (here: its
// queue is missing, so it is unroutable), the original is not acked: it is
// requeued after a pause, never lost, never in a hot loop.
func testCopyFailure(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	top := f.top
	top.Declare = DeclareNone
	ctx := testContext(t, 20*time.Second)
	support := top
	require.NoError(t, f.b.do(ctx, "delete", func(s session) error {
		tp, _ := support.resolve(f.q)
		return s.Delete(ctx, tp.names()[1:])
	}), "delete the support queues")
	f.top = top
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) > 1 {
			return nil
		}
		if d.MessageId == "delayed" {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		return rabbitmw.Permanent(errBoom)
	}), ConsumeOptions{})
	f.publish("delayed", []byte("x"), nil)
	f.publish("dead", []byte("x"), nil)
	require.Eventually(t, func() bool {
		return len(j.callsOf("delayed")) == 2 && len(j.callsOf("dead")) == 2
	}, 20*time.Second, 10*time.Millisecond, "messages not handled twice")
	require.NoError(t, r.stop(t), "Consume after cancel")
	for _, id := range []string{"delayed", "dead"} {
		calls := j.callsOf(id)
		if gap := calls[1].at.Sub(calls[0].at); gap < requeueBackoff {
			t.Errorf("%s: handled again after %v; want >= %v (the pause before the requeue)", id, gap, requeueBackoff)
		}
		assert.True(t, calls[1].d.Redelivered, id+": Redelivered")
	}
	assert.Equal(t, 2, f.logs.Count("WARN", "copy not published"), "warnings about copies not published")
	if n := f.length(f.q); n != 0 {
		t.Errorf("Len(%q) = %d; want 0", f.q, n)
	}
	f.top.Declare = DeclareAll // for the cleanup's Delete
}

// Cancelling Consume with handlers in flight: they finish with a live
// context and are acked; what was received but not started is nacked with
// requeue; nothing is left unsettled for the connection's close.
func testShutdownInFlight(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	const workers, total = 3, 10
	for i := range total {
		f.publish(fmt.Sprintf("s%d", i), []byte("x"), nil)
	}
	started := make(chan string, total)
	release := make(chan struct{})
	var ctxErrs atomic.Int32
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		started <- d.MessageId
		<-release
		time.Sleep(100 * time.Millisecond) // still running after the cancel
		if ctx.Err() != nil {
			ctxErrs.Add(1)
		}
		return nil
	}), ConsumeOptions{Workers: workers, Prefetch: total})
	inFlight := map[string]bool{}
	for range workers {
		select {
		case id := <-started:
			inFlight[id] = true
		case <-time.After(20 * time.Second):
			t.Fatalf("handlers started = %d; want %d", len(inFlight), workers)
		}
	}
	if f.mem != nil {
		// All ten were delivered: three in flight, seven waiting.
		require.Eventually(t, func() bool { return f.mem.Unacked(f.q) == total }, 5*time.Second, 10*time.Millisecond, "prefetch not filled")
	}
	r.cancel()
	// Release the handlers once the consumer stopped taking deliveries.
	require.Eventually(t, func() bool { return f.logs.Count("broker: shutting down") == 1 }, 20*time.Second, 10*time.Millisecond, "no shutdown record")
	close(release)
	require.NoError(t, r.wait(t, 20*time.Second), "Consume after a graceful shutdown")
	assert.Equal(t, int32(0), ctxErrs.Load(), "handlers that saw their context cancelled")
	assert.Equal(t, workers, j.totalCalls(), "handlers started")
	assert.Equal(t, total-workers, f.length(f.q), "messages back in the queue")
	if f.mem != nil {
		s := f.mem.Stats()
		assert.Equal(t, total-workers, s.Nacked, "deliveries nacked with requeue")
		assert.Equal(t, 0, s.RequeuedOnClose, "deliveries left for the connection's close to requeue")
	}
	back := f.drain(f.q)
	assert.Equal(t, total-workers, len(back), "messages taken back")
	for _, d := range back {
		if inFlight[d.MessageId] {
			t.Errorf("message %s was handled and acked, yet is back", d.MessageId)
		}
	}
	f.assertSettled(t)
}

// A handler that ignores its context past the shutdown deadline: Consume
// returns ErrShutdownTimeout, and the message returns to the queue.
func testShutdownTimeout(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	started := make(chan struct{})
	release := make(chan struct{})
	var sawCancel atomic.Bool
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		close(started)
		<-release
		sawCancel.Store(ctx.Err() != nil)
		return nil
	}), ConsumeOptions{Workers: 1, ShutdownTimeout: 200 * time.Millisecond})
	f.publish("stuck", []byte("x"), nil)
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("handler did not start")
	}
	begin := time.Now()
	r.cancel()
	err := r.wait(t, 30*time.Second)
	took := time.Since(begin)
	close(release)
	require.ErrorIs(t, err, ErrShutdownTimeout, "Consume with a stuck handler")
	assert.Contains(t, err.Error(), "1 handlers did not return", "error")
	if took < 200*time.Millisecond+shutdownGrace {
		t.Errorf("Consume gave up after %v; want >= the deadline plus the grace", took)
	}
	require.Eventually(t, func() bool { return f.polledLength(f.q) == 1 }, 20*time.Second, 10*time.Millisecond, "stuck message not back in the queue")
	require.Eventually(t, sawCancel.Load, 5*time.Second, 10*time.Millisecond, "handler context not cancelled at the deadline")
	back := f.drain(f.q)
	if len(back) != 1 || !back[0].Redelivered {
		t.Errorf("queue held %d messages (want 1, redelivered)", len(back))
	}
}

// All connections closed by the server, twice, mid-stream: consumption
// resumes, nothing is lost, each effect happens once, and every publish
// succeeds.
func testConnectionLoss(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	const n = 3000
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		time.Sleep(2 * time.Millisecond)
		return nil
	}), ConsumeOptions{Workers: 4})
	pubErr := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		for i := range n {
			if err := f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: fmt.Sprintf("c%d", i), Body: []byte("x")}); err != nil {
				pubErr <- fmt.Errorf("Publish(c%d) = %w", i, err)
				return
			}
		}
		pubErr <- nil
	}()
	sessions := func() int { return f.logs.Count("broker: consuming") }
	require.Eventually(t, func() bool { return j.effected() >= n/10 }, 30*time.Second, 10*time.Millisecond, "first tenth not handled")
	for i := range 2 {
		f.be.drop(t, f.mem, f.process)
		t.Logf("connections closed after %d of %d messages handled", j.effected(), n)
		require.Eventually(t, func() bool { return sessions() >= i+2 }, 30*time.Second, 10*time.Millisecond, "consumer did not reconnect")
	}
	select {
	case err := <-pubErr:
		require.NoError(t, err, "publisher")
	case <-time.After(90 * time.Second):
		t.Fatal("publisher did not finish")
	}
	require.Eventually(t, func() bool { return j.effected() == n }, 60*time.Second, 10*time.Millisecond, "not every message handled")
	require.NoError(t, r.stop(t), "Consume after cancel")
	for i := range n {
		if len(j.callsOf(fmt.Sprintf("c%d", i))) == 0 {
			t.Errorf("message c%d lost", i)
		}
	}
	// Redeliveries are expected (deliveries in flight when the connections
	// closed, and publishes whose confirm was lost); the journal applied
	// each message's effect once.
	t.Logf("%d messages, %d handler calls, %d consumer sessions, %d publish retries",
		n, j.totalCalls(), sessions(), f.logs.Count("broker: publish failed; retrying"))
	f.assertSettled(t)
}

// A quorum queue's delivery limit dead-letters a message that keeps being
// requeued.
func testQuorumDeliveryLimit(t *testing.T, be backend) {
	f := setup(t, be, Topology{Quorum: true, DeliveryLimit: 2})
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return errBoom // plain error: requeue
	}), ConsumeOptions{Workers: 1})
	f.publish("loop", []byte("x"), nil)
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "message not dead-lettered by the delivery limit")
	require.NoError(t, r.stop(t), "Consume after cancel")
	calls := j.callsOf("loop")
	assert.Equal(t, 3, len(calls), "deliveries (the first and two returns)")
	for i, want := range []any{nil, int64(1), int64(2)} {
		assert.Equal(t, want, calls[i].d.Headers["x-delivery-count"], "x-delivery-count of delivery %d", i+1)
		assert.Equal(t, i > 0, calls[i].d.Redelivered, "Redelivered of delivery %d", i+1)
	}
	dead := f.onlyDeadLetter()
	death := onlyDeath(t, dead)
	assert.Equal(t, "delivery_limit", death["reason"], "x-death reason")
	assert.Equal(t, "delivery_limit", dead.Headers["x-first-death-reason"], "x-first-death-reason")
	if _, ok := dead.Headers[HeaderError]; ok {
		t.Errorf("%s set; want none: the server dead-lettered it, not the broker", HeaderError)
	}
	f.assertSettled(t)
}

// A plain reject of the work queue lands in the dead-letter queue, with an
// x-death header.
func testReject(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	f.publish("r1", []byte("x"), nil)
	d, ok, err := f.b.Get(testContext(t, 20*time.Second), f.q)
	require.NoError(t, err, "Get")
	if !ok {
		t.Fatal("Get found no message")
	}
	require.NoError(t, d.Reject(false), "Reject")
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 10*time.Second, 10*time.Millisecond, "rejected message not in the dead-letter queue")
	dead := f.onlyDeadLetter()
	death := onlyDeath(t, dead)
	assert.Equal(t, "rejected", death["reason"], "x-death reason")
	assert.Equal(t, f.q, death["queue"], "x-death queue")
	assert.Equal(t, int64(1), death["count"], "x-death count")
	assert.Equal(t, []any{f.q}, death["routing-keys"], "x-death routing-keys")
	assert.Equal(t, f.q, dead.Headers["x-first-death-queue"], "x-first-death-queue")
	assert.Equal(t, f.q+".dlq", dead.RoutingKey, "routing key")
	f.assertSettled(t)
}

// Headers of every type survive a delay hop and a dead-letter, as do the
// x-death headers RabbitMQ adds. The memory server converts them as the
// wire does.
func testHeaderTypes(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) == 1 {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		return rabbitmw.Permanent(errBoom)
	}), ConsumeOptions{})
	sent := fixtures.AllTypes()
	f.publish("types", []byte("x"), sent)
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "message not dead-lettered")
	require.NoError(t, r.stop(t), "Consume after cancel")
	calls := j.callsOf("types")
	if len(calls) != 2 {
		t.Fatalf("handler calls = %d; want 2", len(calls))
	}
	dead := f.onlyDeadLetter()
	wire := rabbit.WireTable(sent) // what the wire makes of the values
	for k := range sent {
		assert.Equal(t, wire[k], calls[0].d.Headers[k], "header "+k+" as first delivered")
		assert.Equal(t, wire[k], calls[1].d.Headers[k], "header "+k+" after the delay hop")
		assert.Equal(t, wire[k], dead.Headers[k], "header "+k+" in the dead-letter queue")
	}
	if _, ok := calls[1].d.Headers["x-death"]; !ok {
		t.Fatal("no x-death after the delay hop")
	}
	assert.Equal(t, calls[1].d.Headers["x-death"], dead.Headers["x-death"], "x-death in the dead-letter queue")
	assert.Equal(t, calls[1].d.Headers["x-first-death-queue"], dead.Headers["x-first-death-queue"], "x-first-death-queue in the dead-letter queue")
	f.assertSettled(t)
}

// A 1 MiB and a 16 MiB body go through a delay hop intact.
func testLargeBodies(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	bodies := map[string][]byte{"1MiB": make([]byte, 1<<20), "16MiB": make([]byte, 16<<20)}
	for _, b := range bodies {
		for i := range b {
			b[i] = byte(i * 7)
		}
	}
	var mu sync.Mutex
	intact := map[string]bool{}
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) == 1 {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		mu.Lock()
		intact[d.MessageId] = bytes.Equal(d.Body, bodies[d.MessageId])
		mu.Unlock()
		return nil
	}), ConsumeOptions{Workers: 2})
	for id, b := range bodies {
		f.publish(id, b, nil)
	}
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(intact) == len(bodies)
	}, 60*time.Second, 10*time.Millisecond, "large messages not handled twice")
	require.NoError(t, r.stop(t), "Consume after cancel")
	for id := range bodies {
		if !intact[id] {
			t.Errorf("body of %s changed through a delay hop", id)
		}
	}
	f.assertSettled(t)
}

// DeclareNone or DeclareSupport on a missing queue: a fatal error naming it.
func testDeclareNoneMissing(t *testing.T, be backend) {
	b, _ := be.open(t, Options{})
	q := queueName(t)
	h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	for _, mode := range []DeclareMode{DeclareNone, DeclareSupport} {
		ctx := testContext(t, 20*time.Second)
		top := Topology{Declare: mode, Delays: testTiers}
		err := b.Consume(ctx, q, h, ConsumeOptions{Topology: top})
		require.ErrorIs(t, err, ErrQueueNotFound, "Consume with "+mode.String())
		assert.Contains(t, err.Error(), q, mode.String()+" error")
		require.NoError(t, ctx.Err(), mode.String()+": context (Consume returned at once, not at the deadline)")
	}
	_, err := b.Len(testContext(t, 20*time.Second), q)
	require.ErrorIs(t, err, ErrQueueNotFound, "Len of a missing queue")
}

// A work queue that exists with other arguments: DeclareAll fails with a
// text that names DeclareSupport, and DeclareSupport works.
func testOtherArguments(t *testing.T, be backend) {
	b, _ := be.open(t, Options{})
	q := queueName(t)
	top := Topology{Delays: testTiers}
	ctx := testContext(t, 30*time.Second)
	t.Cleanup(func() { _ = b.Delete(context.Background(), q, top) })
	// Declare the work queue as a user would, without a dead-letter
	// exchange.
	err := b.do(ctx, "declare", func(s session) error { return s.Declare(ctx, []queueSpec{{Name: q}}) })
	require.NoError(t, err, "declare the user's queue")

	h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	err = b.Consume(ctx, q, h, ConsumeOptions{Topology: top})
	require.ErrorIs(t, err, ErrQueueArguments, "Consume with DeclareAll")
	assert.Contains(t, err.Error(), "DeclareSupport", "error")
	assert.Contains(t, err.Error(), q, "error")

	top.Declare = DeclareSupport
	require.NoError(t, b.Declare(ctx, q, top), "Declare with DeclareSupport")
	require.NoError(t, b.Publish(ctx, "", q, amqp.Publishing{Body: []byte("x")}), "Publish")
	got := make(chan struct{}, 1)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(cctx, q, rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
			got <- struct{}{}
			return rabbitmw.Permanent(errBoom) // to the dead-letter queue DeclareSupport declared
		}), ConsumeOptions{Topology: top})
	}()
	select {
	case <-got:
	case <-time.After(20 * time.Second):
		t.Fatal("DeclareSupport consumer got nothing")
	}
	cancel()
	require.NoError(t, <-done, "Consume after cancel")
	n, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err, "Len(dlq)")
	assert.Equal(t, 1, n, "Len(dlq)")
}

// A server that is down at start: Consume keeps trying, with backoff, and
// returns nil when its context is done; on the memory server, it consumes
// once the server is up.
func testServerDown(t *testing.T, be backend) {
	logs := fixtures.NewLogRecorder(t)
	opts := Options{Logger: slog.New(logs), ReconnectMin: 20 * time.Millisecond, ReconnectMax: 100 * time.Millisecond}
	var b *Broker
	var mem *brokertest.Server
	if be.real {
		testenv.RabbitMQURL(t) // the real backend runs where RabbitMQ does
		b = New("amqp://guest:guest@127.0.0.1:1/", opts)
		t.Cleanup(func() { b.Close() })
	} else {
		b, mem = be.open(t, opts)
		mem.SetDown(true)
	}
	q := queueName(t)
	h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	start := time.Now() // before the context, whose deadline counts from its making
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	err := b.Consume(ctx, q, h, ConsumeOptions{})
	took := time.Since(start)
	require.NoError(t, err, "Consume when its context is done")
	if took < 700*time.Millisecond {
		t.Errorf("Consume returned after %v; want >= 700ms (its context)", took)
	}
	retries := logs.Count("WARN", "broker: reconnecting", "unreachable")
	if retries < 2 || retries > 200 {
		t.Errorf("connection attempts logged in 700ms = %d; want from 2 to 200 (no hot loop)", retries)
	}
	if mem != nil {
		// Each retry logged follows an attempt the server saw and
		// refused; the last attempt may not have been logged yet.
		if dials := mem.Stats().Dials; dials < retries || dials > retries+1 {
			t.Errorf("connection attempts seen by the server = %d; want %d or %d (the retries logged, and maybe one more)", dials, retries, retries+1)
		}
	}

	pctx, pcancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer pcancel()
	err = b.Publish(pctx, "", q, amqp.Publishing{})
	require.ErrorIs(t, err, context.DeadlineExceeded, "Publish to a server that is down")
	require.ErrorIs(t, err, ErrUnreachable, "Publish to a server that is down")

	if mem == nil {
		return
	}
	// The memory server comes up: the consumer connects and consumes.
	handled := make(chan struct{}, 1)
	cctx, ccancel := context.WithCancel(context.Background())
	defer ccancel()
	done := make(chan error, 1)
	go func() {
		done <- b.Consume(cctx, q, rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
			handled <- struct{}{}
			return nil
		}), ConsumeOptions{Topology: Topology{Delays: testTiers}})
	}()
	// It tries while the server is down, then the server comes up.
	dials := mem.Stats().Dials
	require.Eventually(t, func() bool {
		return mem.Stats().Dials >= dials+2
	}, 20*time.Second, 10*time.Millisecond, "consumer did not try to connect while the server was down")
	mem.SetDown(false)
	require.Eventually(t, func() bool {
		_, err := b.Len(testContext(t, 5*time.Second), q)
		return err == nil
	}, 20*time.Second, 10*time.Millisecond, "consumer did not declare its queue once the server was up")
	require.NoError(t, b.Publish(testContext(t, 20*time.Second), "", q, amqp.Publishing{}), "Publish once the server is up")
	select {
	case <-handled:
	case <-time.After(20 * time.Second):
		t.Fatal("consumer did not consume once the server was up")
	}
	ccancel()
	require.NoError(t, <-done, "Consume after cancel")
}

// Deleting the queue cancels the consumer: Consume returns
// ErrConsumerCancelled naming the queue, instead of hanging.
func testConsumerCancelled(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return nil
	}), ConsumeOptions{})
	f.publish("c1", []byte("x"), nil)
	require.Eventually(t, func() bool { return j.effected() == 1 }, 20*time.Second, 10*time.Millisecond, "message not handled")
	require.NoError(t, f.b.Delete(testContext(t, 20*time.Second), f.q, f.top), "Delete")
	err := r.wait(t, 20*time.Second)
	require.ErrorIs(t, err, ErrConsumerCancelled, "Consume of a deleted queue")
	assert.Contains(t, err.Error(), f.q, "error")
	// Declare again for the cleanup's Delete.
	require.NoError(t, f.b.Declare(testContext(t, 20*time.Second), f.q, f.top), "Declare")
}

// Publish: confirmed, persistent by default, with a generated message id;
// the caller's message is not modified; ErrClosed after Close.
func testPublishConfirms(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 20*time.Second)
	msg := amqp.Publishing{Body: []byte("hello"), Headers: amqp.Table{"a": "b"}}
	require.NoError(t, f.b.Publish(ctx, "", f.q, msg), "Publish")
	assert.Equal(t, "", msg.MessageId, "caller's MessageId after Publish")
	assert.Equal(t, uint8(0), msg.DeliveryMode, "caller's DeliveryMode after Publish")
	assert.Equal(t, 1, f.length(f.q), "Len after a confirmed publish")
	got := f.drain(f.q)
	if len(got) != 1 {
		t.Fatalf("queue held %d messages; want 1", len(got))
	}
	if !hexID.MatchString(got[0].MessageId) {
		t.Errorf("generated MessageId = %q; want 32 hex digits", got[0].MessageId)
	}
	assert.Equal(t, uint8(amqp.Persistent), got[0].DeliveryMode, "DeliveryMode")
	assert.Equal(t, []byte("hello"), got[0].Body, "body")
	assert.Equal(t, "b", got[0].Headers["a"], "header a")

	require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: "mine", DeliveryMode: amqp.Transient}), "Publish")
	got = f.drain(f.q)
	if len(got) != 1 {
		t.Fatalf("queue held %d messages; want 1", len(got))
	}
	assert.Equal(t, "mine", got[0].MessageId, "MessageId")
	assert.Equal(t, uint8(amqp.Transient), got[0].DeliveryMode, "DeliveryMode")

	err := f.b.Publish(ctx, "", f.q, amqp.Publishing{Headers: amqp.Table{"bad": struct{}{}}})
	require.ErrorIs(t, err, ErrInvalidMessage, "Publish with a struct header")

	b, _ := be.open(t, Options{})
	require.NoError(t, b.Declare(ctx, f.q, f.top), "Declare")
	require.NoError(t, b.Publish(ctx, "", f.q, amqp.Publishing{}), "Publish")
	require.NoError(t, b.Close(), "Close")
	require.ErrorIs(t, b.Publish(ctx, "", f.q, amqp.Publishing{}), ErrClosed, "Publish after Close")
	_, err = b.Len(ctx, f.q)
	require.ErrorIs(t, err, ErrClosed, "Len after Close")
	require.NoError(t, b.Close(), "second Close")
}

var hexID = regexp.MustCompile("^[0-9a-f]{32}$")

// Publish of an unroutable message, or to a missing exchange:
// ErrUnroutable, and publishing goes on.
func testPublishUnroutable(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 20*time.Second)
	err := f.b.Publish(ctx, "", f.q+"-no-such-queue", amqp.Publishing{Body: []byte("x")})
	require.ErrorIs(t, err, ErrUnroutable, "Publish to a key with no queue")
	err = f.b.Publish(ctx, "rabbitmw-no-such-exchange", f.q, amqp.Publishing{Body: []byte("x")})
	require.ErrorIs(t, err, ErrUnroutable, "Publish to a missing exchange")
	assert.Contains(t, err.Error(), "rabbitmw-no-such-exchange", "error")
	require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{Body: []byte("x")}), "Publish after unroutable ones")
	assert.Equal(t, 1, f.length(f.q), "Len")
	f.drain(f.q)
}

// Concurrent publishes, routable and not, each get their own result.
func testPublishConcurrent(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 30*time.Second)
	const n = 200
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			key := f.q
			if i%2 == 1 {
				key = f.q + "-nowhere"
			}
			errs[i] = f.b.Publish(ctx, "", key, amqp.Publishing{MessageId: fmt.Sprintf("p%d", i), Body: []byte("x")})
		})
	}
	wg.Wait()
	for i, err := range errs {
		if i%2 == 0 && err != nil {
			t.Errorf("Publish(p%d, routable) = %v; want nil", i, err)
		}
		if i%2 == 1 && !errors.Is(err, ErrUnroutable) {
			t.Errorf("Publish(p%d, unroutable) = %v; want ErrUnroutable", i, err)
		}
	}
	got := f.drain(f.q)
	assert.Equal(t, n/2, len(got), "messages in the queue")
	for _, d := range got {
		var i int
		if _, err := fmt.Sscanf(d.MessageId, "p%d", &i); err != nil || i%2 != 0 {
			t.Errorf("queue holds %q; want only even ids", d.MessageId)
		}
	}
}
