package broker

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/internal/fixtures"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// frameMax is the frame size of the test servers: RabbitMQ's default, which
// the memory server takes too. maxProps is what a header frame's payload
// may hold: the frame less its header (7 bytes) and end (1).
const (
	frameMax = 131072
	maxProps = frameMax - 8
	// headroom is what Publish leaves of a frame for the headers added
	// when a message is retried or dead-lettered.
	headroom = 8 << 10
)

// propsSize is the size of the header frame payload of a message with
// MessageId id, DeliveryMode set and one header "pad" holding a string of
// pad bytes: class, weight, body size and flags (14), the delivery mode
// (1), the id (1+len), the table (4, then 1+3 for the key and 5+pad for the
// value).
func propsSize(id string, pad int) int { return 14 + 1 + 1 + len(id) + 4 + 1 + 3 + 5 + pad }

// padFor returns the pad that gives a message with MessageId id a header
// frame payload of size bytes.
func padFor(id string, size int) int { return size - propsSize(id, 0) }

// checkFrameMax fails t unless the server's frame size is frameMax.
func (f *fixture) checkFrameMax(t *testing.T) {
	t.Helper()
	if f.mem != nil {
		return
	}
	ctx := testContext(t, 20*time.Second)
	require.NoError(t, f.b.do(ctx, "frame size", func(s session) error {
		if n := s.(*amqpSession).conn.Config.FrameSize; n != frameMax {
			t.Skipf("the server's frame_max is %d; the test expects %d", n, frameMax)
		}
		return nil
	}), "session")
}

// sharedSession returns the Broker's shared session (nil if none).
func (f *fixture) sharedSession() session {
	f.b.sem <- struct{}{}
	defer func() { <-f.b.sem }()
	return f.b.sess
}

// A message that AMQP cannot carry, or that amqp091 could not read back, is
// refused at once with ErrInvalidMessage, before anything is sent: the
// error names the field and the limit (and does not hold the value),
// Publish does not retry it (it returns under a context without
// deadline), and the shared connection is untouched.
func testPublishInvalid(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	f.checkFrameMax(t)
	ctx := testContext(t, 20*time.Second)
	require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{Body: []byte("before")}), "Publish")
	before := f.sharedSession()

	long := strings.Repeat("v", 10<<10)
	nest := func(depth int) any {
		v := any("bottom")
		for range depth {
			v = amqp.Table{"d": v}
		}
		return v
	}
	entries := func(n int) amqp.Table {
		t := amqp.Table{}
		for i := range n {
			t[strconv.Itoa(i)] = nil
		}
		return t
	}
	type tc struct {
		name          string
		exchange, key string
		msg           amqp.Publishing
		want          []string // in the error text
	}
	cases := []tc{
		{name: "MessageId", msg: amqp.Publishing{MessageId: long}},
		{name: "CorrelationId", msg: amqp.Publishing{CorrelationId: long}},
		{name: "ReplyTo", msg: amqp.Publishing{ReplyTo: long}},
		{name: "Type", msg: amqp.Publishing{Type: long}},
		{name: "AppId", msg: amqp.Publishing{AppId: long}},
		{name: "UserId", msg: amqp.Publishing{UserId: long}},
		{name: "ContentType", msg: amqp.Publishing{ContentType: long}},
		{name: "ContentEncoding", msg: amqp.Publishing{ContentEncoding: long}},
		{name: "Expiration", msg: amqp.Publishing{Expiration: long}},
	}
	for i := range cases {
		cases[i].want = []string{cases[i].name, "10240 bytes", "255"}
	}
	cases = append(cases,
		tc{name: "256 bytes", msg: amqp.Publishing{MessageId: strings.Repeat("x", 256)}, want: []string{"MessageId", "256 bytes", "255"}},
		// RabbitMQ refuses these by closing the channel, which ends the
		// shared session and fails the publishes in flight beside them.
		tc{name: "Expiration not a number", msg: amqp.Publishing{Expiration: "60s"}, want: []string{"Expiration", "milliseconds"}},
		tc{name: "Expiration negative", msg: amqp.Publishing{Expiration: "-1"}, want: []string{"Expiration", "negative"}},
		tc{name: "Expiration a fraction", msg: amqp.Publishing{Expiration: "1.5"}, want: []string{"Expiration", "milliseconds"}},
		tc{name: "Expiration with a space", msg: amqp.Publishing{Expiration: " 5"}, want: []string{"Expiration", "milliseconds"}},
		tc{name: "Expiration over ten years", msg: amqp.Publishing{Expiration: "315360000001"}, want: []string{"Expiration", "315360000000"}},
		tc{name: "routing key", key: long, want: []string{"routing key", "255"}},
		tc{name: "exchange", exchange: long, want: []string{"exchange", "255"}},
		tc{name: "header name", msg: amqp.Publishing{Headers: amqp.Table{long: "v"}}, want: []string{"header", "name", "255"}},
		tc{name: "nested header name", msg: amqp.Publishing{Headers: amqp.Table{"outer": amqp.Table{long: int32(1)}}}, want: []string{`"outer"`, "name", "255"}},
		tc{name: "name in a table in an array", msg: amqp.Publishing{Headers: amqp.Table{"list": []any{"a", amqp.Table{long: true}}}}, want: []string{`"list"[1]`, "255"}},
		tc{name: "struct value", msg: amqp.Publishing{Headers: amqp.Table{"bad": struct{}{}}}, want: []string{`"bad"`, "struct {}"}},
		tc{name: "map value", msg: amqp.Publishing{Headers: amqp.Table{"m": map[string]any{"a": "b"}}}, want: []string{`"m"`, "map[string]interface {}", "amqp.Table"}},
		tc{name: "uint64 value", msg: amqp.Publishing{Headers: amqp.Table{"u": uint64(1)}}, want: []string{`"u"`, "uint64"}},
		tc{name: "int beyond 32 bits", msg: amqp.Publishing{Headers: amqp.Table{"i": 1 << 40}}, want: []string{`"i"`, "32-bit"}},
		tc{name: "nested too deep", msg: amqp.Publishing{Headers: amqp.Table{"deep": nest(33)}}, want: []string{`"deep"`, "32"}},
		tc{name: "too many entries", msg: amqp.Publishing{Headers: amqp.Table{"wide": entries(8193)}}, want: []string{`"wide"`, "8192"}},
		tc{name: "beyond a frame", msg: amqp.Publishing{MessageId: "big", Headers: amqp.Table{"pad": strings.Repeat("p", 200<<10)}},
			want: []string{"frame", strconv.Itoa(frameMax)}},
		tc{name: "into the headroom", msg: amqp.Publishing{MessageId: "near", Headers: amqp.Table{"pad": strings.Repeat("p", padFor("near", maxProps-headroom+1))}},
			want: []string{"frame", "8 KiB"}},
	)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			key := c.key
			if key == "" {
				key = f.q
			}
			done := make(chan error, 1)
			go func() { done <- f.b.Publish(context.Background(), c.exchange, key, c.msg) }()
			var err error
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				t.Fatalf("Publish still running after 10s, under a context without deadline; want a refusal at once")
			}
			require.ErrorIs(t, err, ErrInvalidMessage, "Publish")
			for _, w := range c.want {
				assert.Contains(t, err.Error(), w, "error")
			}
			if n := len(err.Error()); n > 500 {
				t.Errorf("error text is %d bytes; want the field named, not its value", n)
			}
		})
	}
	// Messages at the limits go, and amqp091 reads them back (drain).
	atLimits := []amqp.Publishing{
		{MessageId: strings.Repeat("i", 255), CorrelationId: strings.Repeat("c", 255), Headers: amqp.Table{strings.Repeat("k", 255): "v"}},
		{MessageId: "edge", Headers: amqp.Table{"pad": strings.Repeat("p", padFor("edge", maxProps-headroom))}},
		{Headers: amqp.Table{"deep": nest(32), "wide": entries(8192)}},
		// Expirations that RabbitMQ takes, at the edges of its reading.
		{Expiration: "315360000000"}, {Expiration: "+5"}, {Expiration: "-0"}, {Expiration: "007"},
	}
	for i, m := range atLimits {
		require.NoError(t, f.b.Publish(ctx, "", f.q, m), "Publish at the limits "+strconv.Itoa(i))
	}
	// Nothing invalid was sent, and the shared connection is the same.
	assert.Equal(t, 1+len(atLimits), f.length(f.q), "messages in the queue")
	if f.sharedSession() != before {
		t.Errorf("the shared session was replaced; want it untouched")
	}
	assert.Equal(t, 0, f.logs.Count("failed; retrying"), "retry warnings")
	for _, r := range f.logs.All() {
		if len(r) > 2000 {
			t.Errorf("a log record of %d bytes: %.200s…; want no value printed whole", len(r), r)
		}
	}
	f.drain(f.q)
}

// The session refuses a message whose header frame would not fit in a
// frame less its header and end, and sends one that just fits: the size is
// counted exactly. (RabbitMQ takes up to frame_max bytes, and closes the
// connection beyond; but amqp091's reader refuses more than frame_max − 8,
// and a consumer would lose its connection at each delivery of such a
// message.)
func testPublishFrameBoundary(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	f.checkFrameMax(t)
	ctx := testContext(t, 20*time.Second)
	msg := func(pad int) amqp.Publishing {
		return amqp.Publishing{MessageId: "b", DeliveryMode: amqp.Persistent, Headers: amqp.Table{"pad": strings.Repeat("p", pad)}}
	}
	err := f.b.do(ctx, "publish", func(s session) error { return s.Publish(ctx, "", f.q, msg(padFor("b", maxProps))) })
	require.NoError(t, err, "session publish of a header frame that just fits")
	err = f.b.do(ctx, "publish", func(s session) error { return s.Publish(ctx, "", f.q, msg(padFor("b", maxProps)+1)) })
	require.ErrorIs(t, err, ErrInvalidMessage, "session publish of a header frame one byte too big")
	assert.Equal(t, 1, f.length(f.q), "messages in the queue")
	assert.Equal(t, 0, f.logs.Count("failed; retrying"), "retry warnings")
	f.drain(f.q)
}

// publishRaw publishes msg on the shared session, as a producer that does
// not leave Publish's headroom would.
func (f *fixture) publishRaw(t *testing.T, msg amqp.Publishing) {
	t.Helper()
	ctx := testContext(t, 20*time.Second)
	msg.DeliveryMode = amqp.Persistent
	require.NoError(t, f.b.do(ctx, "publish", func(s session) error { return s.Publish(ctx, "", f.q, msg) }), "session publish")
}

// A message whose dead-letter copy would not fit in a frame with its fault
// headers (here: a long error text) is dead-lettered with its error cut
// short, and the original's headers kept; it is handled once.
func testDeadLetterCopyCutToFit(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	f.checkFrameMax(t)
	long := strings.Repeat("e", 3000)
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return rabbitmw.Permanent(errors.New("refused: " + long))
	}), ConsumeOptions{})
	pad := padFor("cut", maxProps-2000)
	f.publishRaw(t, amqp.Publishing{MessageId: "cut", Body: []byte("body"), Headers: amqp.Table{"pad": strings.Repeat("p", pad)}})
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "nothing dead-lettered")
	require.NoError(t, r.stop(t), "Consume after cancel")
	assert.Equal(t, 1, len(j.callsOf("cut")), "handler calls")
	dead := f.onlyDeadLetter()
	assert.Equal(t, []byte("body"), dead.Body, "body")
	kept, _ := dead.Headers["pad"].(string)
	assert.Equal(t, pad, len(kept), "pad header kept")
	text, _ := dead.Headers[HeaderError].(string)
	assert.Contains(t, text, "refused: eee", HeaderError)
	assert.Contains(t, text, "cut", HeaderError)
	if len(text) > 600 {
		t.Errorf("%s is %d bytes; want it cut short", HeaderError, len(text))
	}
	// What an operator needs to replay it stays: the attempt count, the
	// queue, and the route it was published by.
	assert.Equal(t, int64(1), dead.Headers[rabbitmw.HeaderAttempts], rabbitmw.HeaderAttempts)
	assert.Equal(t, f.q, dead.Headers[HeaderOriginalQueue], HeaderOriginalQueue)
	assert.Equal(t, "", dead.Headers[HeaderOriginalExchange], HeaderOriginalExchange)
	assert.Equal(t, f.q, dead.Headers[HeaderOriginalRoutingKey], HeaderOriginalRoutingKey)
	assert.Equal(t, 0, f.length(f.q), "queue "+f.q)
}

// A message whose delay copy would leave too little of a frame for what a
// delay adds (here: the original is near the limit) is dead-lettered
// instead, with the reason; it is handled once, never looped.
func testDelayCopyTooBigIsDeadLettered(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	f.checkFrameMax(t)
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
	}), ConsumeOptions{})
	pad := padFor("near", maxProps-4000)
	f.publishRaw(t, amqp.Publishing{MessageId: "near", Body: []byte("body"), Headers: amqp.Table{"pad": strings.Repeat("p", pad)}})
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "nothing dead-lettered")
	require.NoError(t, r.stop(t), "Consume after cancel")
	assert.Equal(t, 1, len(j.callsOf("near")), "handler calls")
	assert.Equal(t, 1, f.logs.Count("WARN", "delay copy cannot be sent", `message_id="near"`), "records at Warn of the broker's dead-letter")
	dead := f.onlyDeadLetter()
	text, _ := dead.Headers[HeaderError].(string)
	assert.Contains(t, text, "boom", HeaderError)
	assert.Contains(t, text, "delay copy", HeaderError)
	assert.Contains(t, text, "frame", HeaderError)
	assert.Equal(t, "error", dead.Headers[HeaderErrorType], HeaderErrorType)
	kept, _ := dead.Headers["pad"].(string)
	assert.Equal(t, pad, len(kept), "pad header kept")
	assert.Equal(t, 0, f.length(f.q), "queue "+f.q)
	for _, tr := range testTiers {
		if n := f.length(f.q + ".delay." + tierName(tr)); n != 0 {
			t.Errorf("delay queue %s holds %d; want 0", tierName(tr), n)
		}
	}
}

// A message whose dead-letter copy cannot be sent even cut short (the
// original fills its frame) is rejected: the work queue's dead-letter
// arguments take it to the dead-letter queue; it is handled once, and the
// reason is logged at Error.
func testCopyThatCannotBeSentIsRejected(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	f.checkFrameMax(t)
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		j.record(d)
		return rabbitmw.Permanent(errBoom)
	}), ConsumeOptions{})
	f.publishRaw(t, amqp.Publishing{MessageId: "full", Body: []byte("body"), Headers: amqp.Table{"pad": strings.Repeat("p", padFor("full", maxProps-100))}})
	// RabbitMQ adds x-death when it dead-letters the message, which then
	// no longer fits in a frame: amqp091 cannot read it back, so the test
	// only counts it.
	require.Eventually(t, func() bool { return f.polledLength(f.q+".dlq") == 1 }, 20*time.Second, 10*time.Millisecond, "nothing in the dead-letter queue")
	require.NoError(t, r.stop(t), "Consume after cancel")
	assert.Equal(t, 1, len(j.callsOf("full")), "handler calls")
	assert.Equal(t, 0, f.length(f.q), "queue "+f.q)
	assert.Equal(t, 1, f.logs.Count("ERROR", "rejected", "full"), "Error records about the rejected message")
}

// checkPublishing counts the header frame exactly as amqp091 writes it:
// the size field of the frame on the wire, for a message with every
// property and a header of every type, is the size it returns.
func TestRabbitMQPropertiesSizeIsTheWireSize(t *testing.T) {
	ctx := testContext(t, time.Minute)
	px, s := dialViaStallProxy(t, ctx, "rabbitmw test properties size")
	defer s.Close()
	msgs := []amqp.Publishing{
		{},
		{MessageId: "m"},
		{
			ContentType: "text/plain", ContentEncoding: "gzip", DeliveryMode: amqp.Persistent, Priority: 3,
			CorrelationId: "c", ReplyTo: "r", Expiration: "60000", MessageId: "id", Timestamp: time.Unix(1700000000, 0),
			Type: "t", UserId: "guest", AppId: "a", Headers: fixtures.AllTypes(), Body: []byte("body"),
		},
	}
	for i, msg := range msgs {
		want, err := transport.CheckPublishing("", "nowhere", msg)
		require.NoError(t, err, "checkPublishing")
		px.record()
		// No queue has that name: the server returns it.
		require.ErrorIs(t, s.Publish(ctx, "", "nowhere", msg), ErrUnroutable, "publish")
		if got := px.headerFrameSize(t); got != want {
			t.Errorf("message %d: header frame of %d bytes on the wire; checkPublishing says %d", i, got, want)
		}
	}
}

// RabbitMQ routes a message by the strings of its CC and BCC headers as
// by its routing key (sender-selected distribution), and takes each as an
// array of strings: it refuses a header of another type by closing the
// channel, which fails the publishes in flight beside it, and skips an
// element that is not a string, so that the message misses a queue
// without a word. Publish refuses both with ErrInvalidMessage, naming the
// header, before anything is sent: the shared session stays, and the good
// publish after each goes. An array of strings, empty or not, goes.
func testPublishInvalidSenderKeys(t *testing.T, be backend) {
	f := setup(t, be, Topology{})
	ctx := testContext(t, 20*time.Second)
	require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{Body: []byte("before")}), "Publish")
	before := f.sharedSession()
	sent := 1
	for _, c := range []struct {
		name, header string
		v            any
		want         string
	}{
		{"a CC string", "CC", f.q, "not an array of strings"},
		{"a BCC string", "BCC", f.q, "not an array of strings"},
		{"a CC table", "CC", amqp.Table{f.q: true}, "not an array of strings"},
		{"a void CC", "CC", nil, "not an array of strings"},
		{"a CC of bytes", "CC", []byte(f.q), "not an array of strings"},
		{"an int in CC", "CC", []any{f.q, int32(7)}, "not a string"},
		{"bytes in BCC", "BCC", []any{[]byte(f.q)}, "not a string"},
		{"an array in BCC", "BCC", []any{[]any{f.q}}, "not a string"},
		{"a void in CC", "CC", []any{nil}, "not a string"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: "bad", Headers: amqp.Table{c.header: c.v}})
			require.ErrorIs(t, err, ErrInvalidMessage, "Publish")
			assert.Contains(t, err.Error(), strconv.Quote(c.header), "the error names the header")
			assert.Contains(t, err.Error(), c.want)
			require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: "good"}), "the publish after")
			sent++
		})
	}
	for _, h := range []amqp.Table{
		{"CC": []any{f.q}, "BCC": []any{}},
		{"CC": []any{}, "cc": "not routed by", "nested": amqp.Table{"CC": "not routed by"}},
	} {
		require.NoError(t, f.b.Publish(ctx, "", f.q, amqp.Publishing{MessageId: "good", Headers: h}), "Publish with %v", h)
		sent++
	}
	assert.Equal(t, sent, f.length(f.q), "messages in the queue: the good ones alone")
	if f.sharedSession() != before {
		t.Errorf("the shared session was replaced; want it untouched")
	}
	f.drain(f.q)
}
