package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/frameproxy"
)

// A second Ctrl-C stops a replay at once, where the first lets it finish
// the messages in flight for up to 5 s: the command says, at the first,
// that a second stops it at once; at the second, it exits 130 without
// waiting, and names the messages in flight, which may be both in the
// work queue and still in the dead-letter queue. On a server whose
// confirms never come, the replay has its window of 16 messages in
// flight, in the work queue, unconfirmed.
func TestSecondInterruptStopsAtOnce(t *testing.T) {
	b, amqpURL, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const n = 40
	deadLetters(t, b, q, n)
	// The server's publisher confirms (basic.ack) never reach the command.
	via := frameproxy.Start(t, amqpURL, func(dir frameproxy.Direction, f frameproxy.Frame) frameproxy.Verdict {
		if dir == frameproxy.FromServer && f.IsMethod(60, 80) {
			return frameproxy.Drop
		}
		return frameproxy.Pass
	})
	cmd := exec.Command(binary, "dlq", "replay", "-q", q, "--all", "--amqp", via)
	stderr, err := cmd.StderrPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			cmd.Process.Kill()
		}
	})
	var (
		mu    sync.Mutex
		lines []string
	)
	hint := make(chan struct{})
	exited := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		once := sync.OnceFunc(func() { close(hint) })
		for sc.Scan() {
			mu.Lock()
			lines = append(lines, sc.Text())
			mu.Unlock()
			if strings.Contains(sc.Text(), "again") {
				once()
			}
		}
		exited <- cmd.Wait()
	}()
	output := func() string {
		mu.Lock()
		defer mu.Unlock()
		return strings.Join(lines, "\n")
	}
	require.Eventually(t, func() bool {
		got, err := b.Len(ctx, q)
		return err == nil && got == replayWindow
	}, 20*time.Second, 10*time.Millisecond, "the window's messages in the work queue")

	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	select {
	case <-hint:
	case <-time.After(time.Second):
		t.Errorf("no word at the first Ctrl-C that a second stops at once: %q", output())
	}
	require.NoError(t, cmd.Process.Signal(os.Interrupt))
	second := time.Now()
	select {
	case <-exited:
	case <-time.After(30 * time.Second):
		t.Fatalf("the replay did not stop within 30 s of the second Ctrl-C: %q", output())
	}
	took := time.Since(second)
	assert.Less(t, took, 2*time.Second, "from the second Ctrl-C to the exit")
	assert.Equal(t, 130, cmd.ProcessState.ExitCode(), "exit code: %s", output())
	out := output()
	t.Logf("stderr:\n%s", out)
	assert.Contains(t, out, fmt.Sprintf("%d message(s)", replayWindow), "the messages in flight, counted")
	var unnamed []string
	for i := range replayWindow {
		if id := fmt.Sprintf("%q", fmt.Sprintf("m%d", i)); !strings.Contains(out, id) {
			unnamed = append(unnamed, id)
		}
	}
	assert.Empty(t, unnamed, "the messages in flight not named: %s", out)
	assert.Contains(t, out, q+".dlq")

	// Nothing is lost: those in flight are in both queues.
	require.Eventually(t, func() bool {
		got, err := b.Len(ctx, q+".dlq")
		return err == nil && got == n
	}, 20*time.Second, 10*time.Millisecond, "every message back in the dead-letter queue")
	got, err := b.Len(ctx, q)
	require.NoError(t, err)
	assert.Equal(t, replayWindow, got, "messages in the work queue")
}

// The first signal ends the command's context, with the signal as its
// cause, and says that a second stops it at once; the second closes the
// abort, and stop returns it. Without a signal, stop returns nil. The
// watch's goroutine ends at stop (TestMain checks for leaks).
func TestInterrupts(t *testing.T) {
	t.Run("two signals", func(t *testing.T) {
		sigs := make(chan os.Signal)
		var stderr bytes.Buffer
		ctx, in := watchInterrupts(context.Background(), sigs, &stderr)
		sigs <- os.Interrupt
		<-ctx.Done()
		assert.EqualError(t, context.Cause(ctx), "interrupt signal received")
		select {
		case <-in.abort:
			t.Error("aborted at the first signal")
		default:
		}
		sigs <- syscall.SIGTERM
		<-in.abort
		assert.Contains(t, stderr.String(), "interrupt again to stop at once")
		assert.Equal(t, syscall.SIGTERM, in.stop())
	})
	t.Run("none", func(t *testing.T) {
		ctx, in := watchInterrupts(context.Background(), make(chan os.Signal), io.Discard)
		assert.Nil(t, in.stop())
		assert.Error(t, ctx.Err(), "the context after stop")
	})
}
