package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// waitingInput is standard input that nothing is written to, as a
// terminal the operator typed nothing into: waiting is closed at its
// first read.
type waitingInput struct {
	*io.PipeReader
	once    sync.Once
	waiting chan struct{}
}

func (in *waitingInput) Read(p []byte) (int, error) {
	in.once.Do(func() { close(in.waiting) })
	return in.PipeReader.Read(p)
}

// dlq import stops at Ctrl-C while it waits for its input (an operator
// who forgot "< file"), publishing nothing, to the dead-letter queue (whose
// input is read whole first) or --to a queue.
func TestImportInterruptedWhileReadingInput(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	interrupted := errors.New("interrupt signal received")
	for _, args := range [][]string{
		{"dlq", "import", "-q", q, "--amqp", url},
		{"dlq", "import", "-q", q, "--to", q, "--amqp", url},
	} {
		pr, pw := io.Pipe()
		in := &waitingInput{PipeReader: pr, waiting: make(chan struct{})}
		rctx, interrupt := context.WithCancelCause(ctx)
		var stdout, stderr bytes.Buffer
		code := make(chan int, 1)
		go func() { code <- run(rctx, args, in, &stdout, &stderr) }()
		<-in.waiting
		interrupt(interrupted)
		select {
		case c := <-code:
			assert.Equal(t, exitFailed, c, "%v: exit code", args)
			assert.Contains(t, stderr.String(), "interrupt signal received", "%v", args)
			assert.Regexp(t, `nothing imported|imported 0 message\(s\)`, stderr.String(), "%v", args)
		case <-time.After(20 * time.Second):
			t.Errorf("%v: still waiting for its input 20 s after Ctrl-C", args)
			pw.Close()
			<-code
		}
		pw.Close()
		n, err := b.Len(ctx, q)
		require.NoError(t, err)
		assert.Zero(t, n, "%v: messages in the work queue", args)
		n, err = b.Len(ctx, q+".dlq")
		require.NoError(t, err)
		assert.Zero(t, n, "%v: messages in the dead-letter queue", args)
	}
}

// fullDisk takes the first room bytes written to it, and fails the
// writes after.
type fullDisk struct {
	bytes.Buffer
	room int
}

func (d *fullDisk) Write(p []byte) (int, error) {
	n := min(len(p), d.room-d.Len())
	d.Buffer.Write(p[:n])
	if n < len(p) {
		return n, errors.New("no space left on device")
	}
	return n, nil
}

// dlq export to an output that fills up midway counts, as exported, the
// messages whose line is whole in the output, and leaves the dead-letter
// queue as it was.
func TestExportToAFullDisk(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n = 200
	deadLetters(t, b, q, n)
	out := &fullDisk{room: 10000}
	var stderr bytes.Buffer
	code := run(ctx, []string{"dlq", "export", "-q", q, "--amqp", url}, strings.NewReader(""), out, &stderr)
	assert.Equal(t, exitFailed, code, "exit code")
	assert.Contains(t, stderr.String(), "no space left on device")
	whole := bytes.Count(out.Bytes(), []byte("\n"))
	assert.Contains(t, stderr.String(), fmt.Sprintf("exported %d message(s)", whole), "the messages whose line is whole in the output")
	left, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err)
	assert.Equal(t, n, left, "messages in the dead-letter queue")
}

// dlq import to the dead-letter queue, which reads its input whole first,
// refuses a file with a line that is not an exported message before it
// publishes anything: once fixed, the file imports whole, where a file
// half imported would be refused (its first messages still in the queue)
// or, with --allow-duplicates, doubled.
func TestImportRefusesABadLineFirst(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var lines []string
	for i := range 5 {
		m, err := deadletter.ExportMessage(q+".dlq", &amqp.Delivery{MessageId: fmt.Sprintf("m%d", i), Body: []byte("body")})
		require.NoError(t, err)
		line, err := json.Marshal(m)
		require.NoError(t, err)
		lines = append(lines, string(line)+"\n")
	}
	good := strings.Join(lines, "")
	bad := strings.Join(lines[:2], "") + lines[2][:40] + "\n" + strings.Join(lines[3:], "")
	var stdout, stderr bytes.Buffer
	args := []string{"dlq", "import", "-q", q, "--amqp", url}
	code := run(ctx, args, strings.NewReader(bad), &stdout, &stderr)
	assert.Equal(t, exitFailed, code, "exit code: %s", stderr.String())
	assert.Contains(t, stderr.String(), "line 3")
	assert.Contains(t, stderr.String(), "nothing imported")
	n, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err)
	assert.Zero(t, n, "messages in the dead-letter queue after the bad file")
	stderr.Reset()
	code = run(ctx, args, strings.NewReader(good), &stdout, &stderr)
	assert.Equal(t, exitOK, code, "the file fixed: %s", stderr.String())
	n, err = b.Len(ctx, q+".dlq")
	require.NoError(t, err)
	assert.Equal(t, 5, n, "messages in the dead-letter queue after the file fixed")
}

// A negative --limit is bad usage for every command that takes one, as for
// dlq replay: a purge with --limit -1 (a slip for 1) removes nothing.
func TestNegativeLimit(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	deadLetters(t, b, q, 3)
	for _, cmd := range []string{"ls", "replay", "purge", "export"} {
		args := []string{"dlq", cmd, "-q", q, "--limit", "-1", "--amqp", url}
		if cmd == "replay" || cmd == "purge" {
			args = append(args, "--all")
		}
		var stdout, stderr bytes.Buffer
		code := run(ctx, args, strings.NewReader(""), &stdout, &stderr)
		assert.Equal(t, exitUsage, code, "%v: exit code: %s", args, stderr.String())
		assert.Contains(t, stderr.String(), "--limit", "%v", args)
	}
	n, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err)
	assert.Equal(t, 3, n, "messages in the dead-letter queue")
}

// foreignDeadLetters puts in the dead-letter queue of q a message whose
// x-rabbitmw-original-queue names another queue, declared, between two of
// q's own; it returns the other queue's name.
func foreignDeadLetters(t *testing.T, b *broker.Broker, q string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	other := q + "-other"
	require.NoError(t, b.Declare(ctx, other, broker.Topology{}))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		assert.NoError(t, b.Delete(ctx, other, broker.Topology{}))
	})
	for _, m := range []struct{ id, queue string }{{"own", q}, {"foreign", other}, {"own-2", q}} {
		require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: m.id,
			Headers: faulty(m.queue, "error", "boom", time.Now())}))
	}
	return other
}

// dlq replay sends a dead letter of q's dead-letter queue back to q only:
// one whose x-rabbitmw-original-queue header names another queue (forged,
// or stale) is refused, exit 3, naming the message and both queues, and
// nothing moves; --to q sends them all to q.
func TestReplayRefusesAnotherQueue(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	other := foreignDeadLetters(t, b, q)
	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{"dlq", "replay", "-q", q, "--all", "--amqp", url}, strings.NewReader(""), &stdout, &stderr)
	assert.Equal(t, exitRefused, code, "exit code: %s", stderr.String())
	for _, want := range []string{`"foreign"`, `"` + other + `"`, `"` + q + `.dlq"`, "--to"} {
		assert.Contains(t, stderr.String(), want)
	}
	for queue, want := range map[string]int{q: 0, other: 0, q + ".dlq": 3} {
		n, err := b.Len(ctx, queue)
		require.NoError(t, err)
		assert.Equal(t, want, n, "messages in %s", queue)
	}

	stdout.Reset()
	stderr.Reset()
	code = run(ctx, []string{"dlq", "replay", "-q", q, "--all", "--to", q, "--amqp", url}, strings.NewReader(""), &stdout, &stderr)
	assert.Equal(t, exitOK, code, "--to %s: exit code: %s", q, stderr.String())
	assert.ElementsMatch(t, []string{"own", "foreign", "own-2"}, drain(t, b, q), "the work queue")
	n, err := b.Len(ctx, other)
	require.NoError(t, err)
	assert.Zero(t, n, "messages in %s", other)
}

// rawControls are characters that must not reach the operator's terminal
// from a dead letter: an escape sequence's ESC, a carriage return, a bell,
// a tab, a vertical tab, a form feed, a C1 control (CSI) and a
// right-to-left override.
var rawControls = []string{"\x1b", "\r", "\a", "\t", "\v", "\f", "\u009b", "\u202e"}

// noRawControls fails t if out holds a character of rawControls.
func noRawControls(t *testing.T, what, out string) {
	t.Helper()
	for _, c := range rawControls {
		assert.NotContains(t, out, c, "%s printed %q:\n%s", what, c, out)
	}
}

// A dead letter comes from any publisher: dlq ls and dlq show print its
// id, queues, error type, error, properties, headers and body escaped
// where they hold control characters (an escape sequence, a carriage
// return, a bell, a C1 control, a bidi override), so that they neither
// break the table nor rewrite the operator's terminal; ls shortens the
// error without cutting an escape in two; --json keeps every byte; the
// errors that name the messages quote them.
func TestDLQEscapesWhatIsNotPrintable(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const (
		id        = "m\x1b[2J\a1"
		queue     = "orders\x1b]0;owned\x07"
		errType   = "*x.\x1b[31mError"
		host      = "h\x1b[5m"
		firstErr  = "first\x1b[3m"
		expires   = "60000\x1b[2J"
		note      = "x-note\x1b[8m"
		noteValue = "v\u202ev"
		corrID    = "c\x1b[1m"
		typ       = "t\a"
		appID     = "app\u202e"
		id2       = "p\u009b2"
		from      = "q\x1b[2K"
		reason    = "expired\r"
	)
	// The error is cut at 60 runes in the table, among escaped characters.
	why := "refused:\r\x1b[1A fake\nline " + strings.Repeat("x", 30) + "\x1b[2J\x1b[H\u009b31m\u202e\a tail of the error"
	body := "line one\n\x1b[2Jline two\r\n"
	h := faulty(queue, errType, why, time.Now())
	h[broker.HeaderHost] = host
	h[broker.HeaderFirstError] = firstErr
	h[broker.HeaderOriginalExpiration] = expires
	h[note] = noteValue
	h["x-nested"] = amqp.Table{"inner": "a\rb", "list": []any{"\x1b[H"}}
	require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: id, CorrelationId: corrID, Type: typ, AppId: appID,
		Headers: h, Body: []byte(body)}))
	require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: id2,
		Headers: amqp.Table{"x-first-death-queue": from, "x-first-death-reason": reason}}))

	// dlq ls: a line a message, each field escaped.
	out, stderr, code := cli(t, url, nil, "dlq", "ls", "-q", q)
	expectCode(t, "dlq ls", code, exitOK, stderr)
	noRawControls(t, "dlq ls", out)
	lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
	require.Len(t, lines, 4, "a header, two messages and the count:\n%s", out)
	for _, want := range []string{strconv.Quote(id), strconv.Quote(queue), strconv.Quote(errType)} {
		assert.Contains(t, lines[1], want)
	}
	assert.Contains(t, lines[2], strconv.Quote(id2))
	assert.Contains(t, lines[2], "("+strconv.Quote(from)+", "+strconv.Quote(reason)+")")
	// The error cell, the last column: at most 60 runes, the escaped start
	// of the error on one line, its quotes closed, and "…".
	col := strings.LastIndex(lines[0], "ERROR")
	cell := string([]rune(lines[1])[col:])
	assert.LessOrEqual(t, utf8.RuneCountInString(cell), 60, "error cell %s", cell)
	shown, ok := strings.CutSuffix(cell, "…")
	require.True(t, ok, "error cell %s is not cut", cell)
	start, err := strconv.Unquote(shown)
	require.NoError(t, err, "error cell %s: an escape cut in two, or the quotes not closed", cell)
	assert.True(t, strings.HasPrefix(oneLine(why), start), "error cell %s is not the start of the error", cell)
	assert.Greater(t, len(start), len("refused: fake line "), "error cell %s", cell)

	// dlq groups: the error type and the error's pattern escaped.
	out, stderr, code = cli(t, url, nil, "dlq", "groups", "-q", q)
	expectCode(t, "dlq groups", code, exitOK, stderr)
	noRawControls(t, "dlq groups", out)
	assert.Contains(t, out, strconv.Quote(errType))

	// dlq ls --json keeps every byte.
	out, stderr, code = cli(t, url, nil, "dlq", "ls", "-q", q, "--json")
	expectCode(t, "dlq ls --json", code, exitOK, stderr)
	var listed []deadletter.Message
	require.NoError(t, json.Unmarshal([]byte(out), &listed), out)
	require.Len(t, listed, 2)
	assert.Equal(t, id, listed[0].ID)
	assert.Equal(t, queue, listed[0].Queue)
	assert.Equal(t, errType, listed[0].ErrorType)
	assert.Equal(t, why, listed[0].Error)
	assert.Equal(t, firstErr, listed[0].FirstError)
	assert.Equal(t, host, listed[0].Host)
	assert.Equal(t, id2, listed[1].ID)
	assert.Equal(t, from, listed[1].DeadLetteredFrom)
	assert.Equal(t, reason, listed[1].Reason)

	// dlq show: every field, property, header name and value escaped; the
	// body a line at a time.
	out, stderr, code = cli(t, url, nil, "dlq", "show", "-q", q, id, id2)
	expectCode(t, "dlq show", code, exitOK, stderr)
	noRawControls(t, "dlq show", out)
	for _, want := range []string{
		strconv.Quote(id), strconv.Quote(queue), strconv.Quote(errType), strconv.Quote(why), strconv.Quote(firstErr),
		strconv.Quote(host), strconv.Quote(expires) + " ms", strconv.Quote(corrID), strconv.Quote(typ), strconv.Quote(appID),
		strconv.Quote(note) + ": " + strconv.Quote(noteValue), "inner: " + strconv.Quote("a\rb"), "[0]: " + strconv.Quote("\x1b[H"),
		"  line one\n  " + strconv.Quote("\x1b[2Jline two\r") + "\n",
		strconv.Quote(id2), strconv.Quote(from), strconv.Quote(reason),
	} {
		assert.Contains(t, out, want)
	}

	// dlq show --json keeps every byte.
	out, stderr, code = cli(t, url, nil, "dlq", "show", "-q", q, "--json", id)
	expectCode(t, "dlq show --json", code, exitOK, stderr)
	var shownJSON []struct {
		ID      string                     `json:"id"`
		Error   string                     `json:"error"`
		Message deadletter.ExportedMessage `json:"message"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &shownJSON), out)
	require.Len(t, shownJSON, 1)
	m := shownJSON[0]
	assert.Equal(t, id, m.ID)
	assert.Equal(t, why, m.Error)
	assert.Equal(t, id, m.Message.Properties.MessageID)
	assert.Equal(t, corrID, m.Message.Properties.CorrelationID)
	assert.Equal(t, typ, m.Message.Properties.Type)
	assert.Equal(t, appID, m.Message.Properties.AppID)
	require.Contains(t, m.Message.Headers, note)
	var v string
	require.NoError(t, json.Unmarshal(m.Message.Headers[note].Value, &v))
	assert.Equal(t, noteValue, v)
	raw, err := base64.StdEncoding.DecodeString(m.Message.Body)
	require.NoError(t, err)
	assert.Equal(t, body, string(raw))

	// The errors that name a message or a queue quote them: a missing id,
	// a replay refused for the messages' queues.
	_, stderr, code = cli(t, url, nil, "dlq", "show", "-q", q, "nope\x1b[2J")
	expectCode(t, "dlq show of a missing id", code, exitNotFound, stderr)
	noRawControls(t, "dlq show of a missing id", stderr)
	assert.Contains(t, stderr, strconv.Quote("nope\x1b[2J"))
	_, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q, "--id", id)
	expectCode(t, "dlq replay of a message of another queue", code, exitRefused, stderr)
	noRawControls(t, "dlq replay of a message of another queue", stderr)
	assert.Contains(t, stderr, strconv.Quote(id)+" names "+strconv.Quote(queue))
	n, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err)
	assert.Equal(t, 2, n, "messages in the dead-letter queue")
}

// clip escapes first and then cuts, between two characters: what it
// returns is at most n runes, and is printable's form of s or of a start
// of s followed by "…", its quotes closed.
func TestClip(t *testing.T) {
	for _, s := range []string{
		"orders.paid: payment gateway failed",
		"café über alles",
		"a\x1b[2Jb\x1b[Hc\u009b31m\u202ed",
		"\x1b\x1b\x1b\x1b\x1b\x1b",
		`"quoted" text`,
		"bytes\xff\xfe and more",
		"",
	} {
		for n := 1; n <= len(s)*6+4; n++ {
			got := clip(s, n)
			assert.LessOrEqual(t, utf8.RuneCountInString(got), n, "clip(%q, %d) = %s", s, n, got)
			if got == printable(s) {
				continue
			}
			shown, ok := strings.CutSuffix(got, "…")
			if !assert.True(t, ok, "clip(%q, %d) = %s: cut without a …", s, n, got) {
				continue
			}
			start := shown
			if strings.HasPrefix(shown, `"`) {
				var err error
				start, err = strconv.Unquote(shown)
				if !assert.NoError(t, err, "clip(%q, %d) = %s", s, n, got) {
					continue
				}
			}
			assert.True(t, strings.HasPrefix(s, start), "clip(%q, %d) = %s: not a start of s", s, n, got)
			assert.Equal(t, printable(start), shown, "clip(%q, %d)", s, n)
		}
	}
	assert.Equal(t, "orders…", clip("orders.paid", 7))
	assert.Equal(t, `"a\x1b"…`, clip("a\x1b[2J", 8))
	assert.Equal(t, "a…", clip("a\x1b[2J", 7), "an escape is never cut in two")
}

// printBody prints a body a line at a time, escaped, and cuts a long one
// at the start of a character.
func TestPrintBody(t *testing.T) {
	for _, tc := range []struct {
		body  string
		limit int
		want  string
	}{
		{"{\"a\": 1}\n", 100, "  {\"a\": 1}\n"},
		{"one\ntwo", 100, "  one\n  two\n"},
		{"ok\n\x1b[2Jbad\r\n", 100, "  ok\n  \"\\x1b[2Jbad\\r\"\n"},
		{"", 100, "  \n"},
		{"xé", 2, "  x… (2 bytes more)\n"},
		{"ab\U0001F600", 5, "  ab… (4 bytes more)\n"},
		{"a\xffb\nc", 100, "  \"a\\xffb\\nc\"\n"},
	} {
		var buf bytes.Buffer
		printBody(&buf, []byte(tc.body), tc.limit)
		assert.Equal(t, tc.want, buf.String(), "printBody(%q, %d)", tc.body, tc.limit)
	}
}

// A listing of a quorum dead-letter queue, which counts every message a
// listing puts back as a delivery of it, and drops it past its delivery
// limit (RabbitMQ 4.0 sets 20 by default), says so, with the count of the
// most listed message; a classic one's does not.
func TestDLQListWarnsOfAQuorumQueue(t *testing.T) {
	for _, quorum := range []bool{true, false} {
		t.Run(fmt.Sprintf("quorum %t", quorum), func(t *testing.T) {
			url := testenv.RabbitMQURL(t)
			b := broker.New(url, broker.Options{})
			t.Cleanup(func() { b.Close() })
			q := queueName(t)
			top := broker.Topology{QuorumSupport: quorum}
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			require.NoError(t, b.Declare(ctx, q, top))
			t.Cleanup(func() { assert.NoError(t, b.Delete(context.Background(), q, top)) })
			deadLetters(t, b, q, 1)

			var stderr string
			for range 3 {
				out, errOut, code := cli(t, url, nil, "dlq", "ls", "-q", q)
				expectCode(t, "dlq ls", code, 0, errOut)
				require.Contains(t, out, "m0")
				stderr = errOut
			}
			if !quorum {
				assert.NotContains(t, stderr, "quorum", "a classic dead-letter queue")
				return
			}
			assert.Contains(t, stderr, q+".dlq is a quorum queue")
			// RabbitMQ 3.10 counts from the first read: 0, 1, then 2.
			assert.Regexp(t, `delivered [12] time\(s\)`, stderr)
			assert.Contains(t, stderr, "delivery limit")
		})
	}
}
