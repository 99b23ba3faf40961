package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
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
