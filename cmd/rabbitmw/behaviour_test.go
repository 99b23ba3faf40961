package main

import (
	"context"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// deadPort returns a loopback address where nothing listens.
func deadPort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// silentServer returns the address of a server that accepts connections
// and never says a word.
func silentServer(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	var conns []net.Conn
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String()
}

// A server that refuses or does not answer: the command fails at once
// (within --timeout), exit 1, with one line that names the server and
// why, and no password.
func TestUnreachableServer(t *testing.T) {
	for _, c := range []struct {
		name, addr, why string
	}{
		{"refused", deadPort(t), "connection refused"},
		{"silent", silentServer(t), "did not answer within 1s"},
	} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			url := "amqp://guest:secret@" + c.addr + "/"
			_, stderr, code := cli(t, url, nil, "dlq", "ls", "-q", "orders", "--timeout", "1s")
			assert.Less(t, time.Since(start), 15*time.Second)
			expectCode(t, "dlq ls", code, exitFailed, stderr)
			assert.Equal(t, 1, strings.Count(stderr, "\n"), "stderr: %s", stderr)
			assert.Contains(t, stderr, "RabbitMQ at amqp://guest:xxxxx@"+c.addr)
			assert.Contains(t, stderr, c.why)
			assert.NotContains(t, stderr, "secret")
		})
	}
	t.Run("redis", func(t *testing.T) {
		addr := deadPort(t)
		_, stderr, code := cli(t, "", nil, "key", "k", "--redis", addr, "--timeout", "1s")
		expectCode(t, "key", code, exitFailed, stderr)
		assert.Contains(t, stderr, "Redis at "+addr)
		assert.NotContains(t, stderr, "failed to dial after", "go-redis's own line")
		assert.Equal(t, 1, strings.Count(stderr, "\n"), "stderr: %s", stderr)
	})
}

// What operators expect of a command: --version, long and short flags,
// an error printed once with a hint, help listing only the subcommand's
// flags, one exit code for "not found", replay --all.
func TestOperatorExpectations(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	out, stderr, code := cli(t, url, nil, "--version")
	expectCode(t, "--version", code, exitOK, stderr)
	assert.True(t, strings.HasPrefix(out, "rabbitmw "), "--version printed %q", out)

	_, stderr, code = cli(t, url, nil, "dlq", "ls", "--queue", q)
	expectCode(t, "dlq ls --queue", code, exitOK, stderr)

	_, stderr, code = cli(t, url, nil, "dlq", "ls", "-q", q, "--nope")
	expectCode(t, "unknown flag", code, exitUsage, stderr)
	assert.Equal(t, 1, strings.Count(stderr, "\n"), "stderr: %s", stderr)
	assert.Contains(t, stderr, "-nope")
	assert.Contains(t, stderr, "rabbitmw dlq ls -h")
	_, stderr, code = cli(t, url, nil, "frobnicate")
	expectCode(t, "unknown command", code, exitUsage, stderr)
	assert.Equal(t, 1, strings.Count(stderr, "\n"), "stderr: %s", stderr)

	out, stderr, code = cli(t, url, nil, "dlq", "export", "-h")
	expectCode(t, "export -h", code, exitOK, stderr)
	assert.Contains(t, out, "-q, --queue")
	assert.Contains(t, out, "--limit")
	assert.NotContains(t, out, "json", "export writes JSON Lines whatever the flags")
	out, _, _ = cli(t, url, nil, "dlq", "ls", "-h")
	assert.Contains(t, out, "--json")
	assert.NotContains(t, out, "--to")

	_, stderr, notFoundQueue := cli(t, url, nil, "dlq", "ls", "-q", q+"-missing")
	_, _, notFoundMessage := cli(t, url, nil, "dlq", "show", "-q", q, "nope")
	assert.Equal(t, exitNotFound, notFoundQueue, "a missing queue (stderr: %s)", stderr)
	assert.Equal(t, exitNotFound, notFoundMessage, "a missing message")

	require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: "a", Headers: faulty(q, "E", "boom", time.Now())}))
	out, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q, "--all")
	expectCode(t, "dlq replay --all", code, exitOK, stderr)
	assert.Contains(t, out, "replayed 1 of 1")
	assert.Equal(t, []string{"a"}, drain(t, b, q))
	_, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q)
	expectCode(t, "dlq replay without --all or a filter", code, exitRefused, stderr)
}

// An import of messages that are still in the dead-letter queue is
// refused, and nothing is published; --allow-duplicates imports them.
func TestImportRefusesDuplicates(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, id := range []string{"a", "b"} {
		require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: id, Headers: faulty(q, "E", "boom", time.Now())}))
	}
	exported, stderr, code := cli(t, url, nil, "dlq", "export", "-q", q)
	expectCode(t, "dlq export", code, exitOK, stderr)

	_, stderr, code = cli(t, url, []byte(exported), "dlq", "import", "-q", q)
	expectCode(t, "dlq import of messages still there", code, exitRefused, stderr)
	assert.Contains(t, stderr, `"a"`)
	assert.Contains(t, stderr, "--allow-duplicates")
	n, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err)
	assert.Equal(t, 2, n, "the refused import published")

	_, stderr, code = cli(t, url, []byte(exported), "dlq", "import", "-q", "another", "--to", q+".dlq")
	expectCode(t, "dlq import --to the same dead-letter queue", code, exitRefused, stderr)

	_, stderr, code = cli(t, url, []byte(exported), "dlq", "import", "-q", q, "--allow-duplicates")
	expectCode(t, "dlq import --allow-duplicates", code, exitOK, stderr)
	assert.Equal(t, []string{"a", "b", "a", "b"}, drain(t, b, q+".dlq"))
}

// onceServer returns the address of a proxy to target that lets the
// first connection through, then refuses every other: a server that
// answers the command's first connection, then goes away.
func onceServer(t *testing.T, target string) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		defer close(done)
		c, err := ln.Accept()
		ln.Close() // the next connections are refused
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", target)
		if err != nil {
			c.Close()
			return
		}
		mu.Lock()
		conns = append(conns, c, up)
		mu.Unlock()
		copied := make(chan struct{})
		go func() { _, _ = io.Copy(up, c); up.Close(); close(copied) }()
		_, _ = io.Copy(c, up)
		c.Close()
		<-copied
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		<-done
	})
	return ln.Addr().String()
}

// A server that answered the command's first connection and then went
// away: the command fails within --timeout (and a little more) with one
// line naming the server, rather than try to reach it again for ever.
func TestServerGoneAfterTheFirstConnection(t *testing.T) {
	url := testenv.RabbitMQURL(t)
	u, err := amqp.ParseURI(url)
	require.NoError(t, err)
	addr := onceServer(t, net.JoinHostPort(u.Host, strconv.Itoa(u.Port)))
	u.Host, u.Port = "127.0.0.1", 0
	_, port, _ := net.SplitHostPort(addr)
	u.Port, _ = strconv.Atoi(port)
	start := time.Now()
	_, stderr, code := cli(t, u.String(), nil, "dlq", "ls", "-q", "orders", "--timeout", "2s")
	took := time.Since(start)
	expectCode(t, "dlq ls", code, exitFailed, stderr)
	assert.Less(t, took, 15*time.Second, "the command's run")
	assert.Equal(t, 1, strings.Count(stderr, "\n"), "stderr: %s", stderr)
	assert.Contains(t, stderr, "RabbitMQ at amqp://"+addr)
	assert.Contains(t, stderr, "did not answer again within 2s")
}
