package main

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// replayWindow is broker.Replay's number of messages in flight.
const replayWindow = 16

// binary is the command, built once by TestMain.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "rabbitmw-cmd-test")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "rabbitmw")
	if out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	// Every goroutine of the tests (consoles, consumers, browsers) ended.
	if err := goleak.Find(); code == 0 && err != nil {
		fmt.Fprintln(os.Stderr, "goleak:", err)
		code = 1
	}
	os.Exit(code)
}

// cli runs the command with args and stdin, and returns its output and
// exit code.
func cli(t *testing.T, url string, stdin []byte, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(os.Environ(), "RABBITMQ_URL="+url)
	cmd.Stdin = bytes.NewReader(stdin)
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return o.String(), e.String(), ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run %v: %v", args, err)
	}
	return o.String(), e.String(), 0
}

func expectCode(t *testing.T, what string, code, want int, stderr string) {
	t.Helper()
	if code != want {
		t.Fatalf("%s: exit code %d; want %d (stderr: %s)", what, code, want, stderr)
	}
}

func queueName(t *testing.T) string {
	var r [4]byte
	_, _ = rand.Read(r[:])
	return "rabbitmw-test-cli-" + strings.ReplaceAll(t.Name(), "/", "-") + "-" + hex.EncodeToString(r[:])
}

// faulty returns the headers the broker writes on a message it
// dead-lettered out of queue.
func faulty(queue, errType, text string, at time.Time) amqp.Table {
	return amqp.Table{
		broker.HeaderOriginalQueue: queue, broker.HeaderErrorType: errType, broker.HeaderError: text,
		broker.HeaderFailedAt: at, rabbitmw.HeaderAttempts: int64(3), broker.HeaderHost: "h",
		broker.HeaderProcess: "p[1]", broker.HeaderOriginalRoutingKey: queue, broker.HeaderOriginalExchange: "",
	}
}

// setupQueue declares a work queue of a name of its own, with its
// dead-letter queue, on the test's RabbitMQ, and deletes them at the end of
// t. It returns a Broker on that server, its URL and the queue's name.
func setupQueue(t *testing.T) (*broker.Broker, string, string) {
	t.Helper()
	url := testenv.RabbitMQURL(t)
	b := broker.New(url, broker.Options{})
	t.Cleanup(func() { b.Close() })
	q := queueName(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	require.NoError(t, b.Declare(ctx, q, broker.Topology{}))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		assert.NoError(t, b.Delete(ctx, q, broker.Topology{}))
	})
	return b, url, q
}

// deadLetters puts n messages, m0 to m(n-1), with the body "body", in the
// dead-letter queue of q, each with the header that names q its original
// queue.
func deadLetters(t *testing.T, b *broker.Broker, q string, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for i := range n {
		require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: fmt.Sprintf("m%d", i), Body: []byte("body"),
			Headers: amqp.Table{broker.HeaderOriginalQueue: q}}))
	}
}

func drain(t *testing.T, b *broker.Broker, queue string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var ids []string
	for {
		d, ok, err := b.Get(ctx, queue)
		require.NoError(t, err)
		if !ok {
			return ids
		}
		require.NoError(t, d.Ack(false))
		ids = append(ids, d.MessageId)
	}
}

// Every command, run as an operator runs it: output and exit codes.
func TestCLI(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	now := time.Now().UTC().Truncate(time.Second)
	pub := func(id string, h amqp.Table) {
		require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: id, Body: []byte("body " + id), Headers: h}))
	}
	pub("a", faulty(q, "*json.SyntaxError", "invalid character 'x'", now.Add(-2*time.Hour)))
	pub("b", faulty(q, "*errors.errorString", "payment gateway failed", now))
	pub("c", faulty(q, "*json.SyntaxError", "unexpected end of JSON input", now))
	pub("foreign", amqp.Table{"x-first-death-queue": q, "x-first-death-reason": "expired"})

	// Usage errors.
	_, stderr, code := cli(t, url, nil, "dlq", "ls")
	expectCode(t, "dlq ls without -q", code, exitUsage, stderr)
	_, stderr, code = cli(t, url, nil, "dlq", "ls", "-q", q, "--nope")
	expectCode(t, "unknown flag", code, exitUsage, stderr)
	_, stderr, code = cli(t, url, nil, "frobnicate")
	expectCode(t, "unknown command", code, exitUsage, stderr)
	_, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q, "--since", "someday")
	expectCode(t, "bad --since", code, exitUsage, stderr)
	_, _, code = cli(t, url, nil, "dlq", "ls", "-h")
	expectCode(t, "-h", code, exitOK, "")

	// ls, as a table and as JSON, with filters.
	out, stderr, code := cli(t, url, nil, "dlq", "ls", "-q", q)
	expectCode(t, "dlq ls", code, exitOK, stderr)
	for _, want := range []string{"ID", "ERROR TYPE", "a ", "*json.SyntaxError", "payment gateway failed", "(" + q + ", expired)", "4 message(s)"} {
		if !strings.Contains(out, want) {
			t.Errorf("dlq ls output lacks %q:\n%s", want, out)
		}
	}
	out, stderr, code = cli(t, url, nil, "dlq", "ls", "-q", q, "--json", "--error-type", "*json.SyntaxError", "--since", "1h")
	expectCode(t, "dlq ls --json", code, exitOK, stderr)
	var listed []deadletter.Message
	if err := json.Unmarshal([]byte(out), &listed); err != nil {
		t.Fatalf("dlq ls --json: %v\n%s", err, out)
	}
	if len(listed) != 1 || listed[0].ID != "c" || listed[0].Attempts != 3 || listed[0].Queue != q {
		t.Errorf("dlq ls --json --error-type --since = %+v; want c alone", listed)
	}

	// show.
	out, stderr, code = cli(t, url, nil, "dlq", "show", "b", "-q", q)
	expectCode(t, "dlq show", code, exitOK, stderr)
	for _, want := range []string{"payment gateway failed", "x-rabbitmw-attempts (int64): 3", "body b"} {
		if !strings.Contains(out, want) {
			t.Errorf("dlq show output lacks %q:\n%s", want, out)
		}
	}
	_, stderr, code = cli(t, url, nil, "dlq", "show", "-q", q, "nope")
	expectCode(t, "dlq show of a missing id", code, exitNotFound, stderr)

	// replay: refused without a destination, or to a missing queue, and
	// nothing moves; a dry run moves nothing; then a filtered replay.
	_, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q, "--all")
	expectCode(t, "dlq replay of a foreign message", code, exitRefused, stderr)
	if !strings.Contains(stderr, `"foreign"`) || !strings.Contains(stderr, "--to") {
		t.Errorf("refusal = %q; want it to name the message and --to", stderr)
	}
	_, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q, "--all", "--to", q+"-missing")
	expectCode(t, "dlq replay to a missing queue", code, exitNotFound, stderr)
	out, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q, "--id", "a,c", "--dry-run")
	expectCode(t, "dlq replay --dry-run", code, exitOK, stderr)
	if !strings.Contains(out, "would replay 2 of 4") {
		t.Errorf("dry run output:\n%s", out)
	}
	if n, _ := b.Len(ctx, q); n != 0 {
		t.Fatalf("work queue after refusals and a dry run holds %d; want 0", n)
	}

	rc := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t)})
	t.Cleanup(func() { rc.Close() })
	prefix := "rabbitmw-test-cli:" + q + ":"
	st := redisstore.New(rc, redisstore.Options{Prefix: prefix})
	for range 2 {
		_, err := st.Fail(ctx, "ns:a", time.Hour)
		require.NoError(t, err)
	}
	_, err := st.Claim(ctx, "ns:b", "web-7/4242/0a1b2c3d4e5f/1", time.Minute)
	require.NoError(t, err)
	t.Cleanup(func() { rc.Del(context.Background(), prefix+"msg:ns:b", prefix+"retry:ns:a") })

	out, stderr, code = cli(t, url, nil, "key", "a", "--redis", testenv.RedisAddr(t), "--prefix", prefix, "--namespace", "ns")
	expectCode(t, "key a", code, exitOK, stderr)
	if words := strings.Join(strings.Fields(out), " "); !strings.Contains(words, "state absent") || !strings.Contains(words, "failures 2") {
		t.Errorf("key a output:\n%s", out)
	}
	out, stderr, code = cli(t, url, nil, "key", "--json", "b", "--redis", "redis://"+testenv.RedisAddr(t), "--prefix", prefix, "--namespace", "ns")
	expectCode(t, "key b", code, exitOK, stderr)
	var ks struct {
		State string
		Host  string
		PID   int
		TTL   float64 `json:"ttl_seconds"`
	}
	if err := json.Unmarshal([]byte(out), &ks); err != nil || ks.State != "claimed" || ks.Host != "web-7" || ks.PID != 4242 || ks.TTL <= 0 {
		t.Errorf("key --json b = %+v (%v); want claimed by web-7, pid 4242, lease left\n%s", ks, err, out)
	}
	_, stderr, code = cli(t, url, nil, "key", "b")
	expectCode(t, "key without --redis", code, exitUsage, stderr)

	out, stderr, code = cli(t, url, nil, "dlq", "replay", "-q", q, "--id", "a", "--id", "c", "--reset-failures",
		"--redis", testenv.RedisAddr(t), "--prefix", prefix, "--namespace", "ns")
	expectCode(t, "dlq replay", code, exitOK, stderr)
	if !strings.Contains(out, "replayed 2 of 2 selected message(s) (4 in") {
		t.Errorf("replay output:\n%s", out)
	}
	if k, err := st.Inspect(ctx, "ns:a"); err != nil || k.Failures != 0 {
		t.Errorf("failures of a after the replay = %d, %v; want 0", k.Failures, err)
	}

	// export, purge, import.
	exported, stderr, code := cli(t, url, nil, "dlq", "export", "-q", q)
	expectCode(t, "dlq export", code, exitOK, stderr)
	if n := strings.Count(exported, "\n"); n != 2 || !strings.Contains(stderr, "exported 2") {
		t.Errorf("export: %d lines, stderr %q; want 2", n, stderr)
	}
	_, stderr, code = cli(t, url, nil, "dlq", "purge", "-q", q)
	expectCode(t, "dlq purge without a filter", code, exitRefused, stderr)
	out, stderr, code = cli(t, url, nil, "dlq", "purge", "-q", q, "--all")
	expectCode(t, "dlq purge --all", code, exitOK, stderr)
	if !strings.Contains(out, "removed 2 message(s)") {
		t.Errorf("purge output:\n%s", out)
	}
	_, stderr, code = cli(t, url, []byte(exported), "dlq", "import", "-q", q)
	expectCode(t, "dlq import", code, exitOK, stderr)
	_, stderr, code = cli(t, url, []byte("garbage\n"), "dlq", "import", "-q", q)
	expectCode(t, "dlq import of garbage", code, exitFailed, stderr)
	if got := drain(t, b, q+".dlq"); strings.Join(got, ",") != "b,foreign" {
		t.Errorf("dead-letter queue after export, purge, import = %v; want b, foreign", got)
	}
	got := drain(t, b, q)
	slices.Sort(got)
	if strings.Join(got, ",") != "a,c" {
		t.Errorf("work queue = %v; want a, c", got)
	}

	// topology.
	out, stderr, code = cli(t, url, nil, "topology", "show", "-q", q, "--json")
	expectCode(t, "topology show", code, exitOK, stderr)
	var rows []struct {
		Queue  string
		Exists bool
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil || len(rows) != 8 || !rows[0].Exists {
		t.Errorf("topology show --json = %+v, %v; want 8 queues, the work queue existing", rows, err)
	}
	_, stderr, code = cli(t, url, nil, "topology", "declare", "-q", q, "--quorum")
	expectCode(t, "topology declare with other arguments", code, exitRefused, stderr)
	_, stderr, code = cli(t, url, nil, "topology", "delete", "-q", q)
	expectCode(t, "topology delete", code, exitOK, stderr)
	_, stderr, code = cli(t, url, nil, "dlq", "ls", "-q", q)
	expectCode(t, "dlq ls of a deleted queue", code, exitNotFound, stderr)
}

// A replay of 10,000 messages, its process killed midway with SIGKILL and
// run again: every message is back in the work queue, none lost, and at
// most those in flight at the kill (the replay's window) twice.
func TestReplayKilledMidway(t *testing.T) {
	const n = 10000
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	h := faulty(q, "*errors.errorString", "boom", time.Now())
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < n; i += 16 {
				if err := b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: fmt.Sprintf("m%05d", i), Body: []byte("x"), Headers: h}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}

	start := time.Now()
	cmd := exec.Command(binary, "dlq", "replay", "-q", q, "--all", "--amqp", url)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	var atKill int
	for atKill < n/3 {
		select {
		case err := <-exited:
			t.Fatalf("replay ended before the kill: %v (%s)", err, stderr.String())
		case <-time.After(20 * time.Millisecond):
		}
		var err error
		atKill, err = b.Len(ctx, q)
		require.NoError(t, err)
	}
	if err := cmd.Process.Kill(); err != nil { // SIGKILL
		t.Fatal(err)
	}
	<-exited
	killedAt := time.Since(start)
	// The server requeues what the dead connection held once it has seen
	// the connection close: until then, the messages that the replay held
	// and had not sent are in neither queue.
	lengths := func() (inQ, inDLQ int) {
		inQ, _ = b.Len(ctx, q)
		inDLQ, _ = b.Len(ctx, q+".dlq")
		return inQ, inDLQ
	}
	requeued := assert.Eventually(t, func() bool { inQ, inDLQ := lengths(); return inQ+inDLQ >= n }, 30*time.Second, 20*time.Millisecond)
	inQ, inDLQ := lengths()
	t.Logf("killed after %v with %d in the work queue; then %d in the work queue, %d in the dead-letter queue", killedAt, atKill, inQ, inDLQ)
	if !requeued || inQ+inDLQ < n {
		t.Fatalf("after the kill: %d + %d messages; want at least %d", inQ, inDLQ, n)
	}

	start = time.Now()
	out, errOut, code := cli(t, url, nil, "dlq", "replay", "-q", q, "--all")
	expectCode(t, "second replay", code, exitOK, errOut)
	t.Logf("second run: %s in %v", strings.TrimSpace(out), time.Since(start))

	counts := map[string]int{}
	for _, id := range drain(t, b, q) {
		counts[id]++
	}
	left := drain(t, b, q+".dlq")
	dups := 0
	for i := range n {
		id := fmt.Sprintf("m%05d", i)
		switch c := counts[id]; {
		case c == 0:
			t.Errorf("%s lost", id)
		case c > 1:
			dups += c - 1
		}
	}
	t.Logf("duplicates in the work queue: %d", dups)
	if dups > replayWindow || len(left) != 0 || len(counts) != n {
		t.Errorf("duplicates %d (want at most %d, the replay's window), left in the dead-letter queue %d (want 0), distinct %d (want %d)", dups, replayWindow, len(left), len(counts), n)
	}
}

// rabbitmw key --postgres reads a pgstore: a claimed key, a done one with
// failures, an absent one; and refuses a missing table and mixed flags.
func TestKeyPostgres(t *testing.T) {
	ctx := context.Background()
	url := testenv.PostgresURL(t)
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	b := make([]byte, 6)
	rand.Read(b)
	table := "rmwtest_cli_" + hex.EncodeToString(b)
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+table+`, `+table+`_failures`) })
	st := pgstore.New(pool, pgstore.Options{Table: table})
	t.Cleanup(st.Close)
	require.NoError(t, st.Migrate(ctx))
	_, err = st.Claim(ctx, "ns:b", "web-7/4242/0a1b2c3d4e5f/1", time.Minute)
	require.NoError(t, err)
	_, err = st.Claim(ctx, "ns:c", "t1", time.Minute)
	require.NoError(t, err)
	require.NoError(t, st.Complete(ctx, "ns:c", "t1", time.Hour))
	for range 3 {
		_, err := st.Fail(ctx, "ns:c", time.Hour)
		require.NoError(t, err)
	}

	out, stderr, code := cli(t, "", nil, "key", "b", "--postgres", url, "--table", table, "--namespace", "ns")
	expectCode(t, "key b --postgres", code, exitOK, stderr)
	words := strings.Join(strings.Fields(out), " ") // the table's columns, one space apart
	for _, want := range []string{"key ns:b", "state claimed", "owner host web-7, pid 4242", "lease left", "failures 0"} {
		if !strings.Contains(words, want) {
			t.Errorf("key b --postgres output lacks %q:\n%s", want, out)
		}
	}
	out, stderr, code = cli(t, "", nil, "key", "--json", "c", "--postgres", url, "--table", table, "--namespace", "ns")
	expectCode(t, "key c --postgres", code, exitOK, stderr)
	var ks struct {
		State       string
		TTL         float64 `json:"ttl_seconds"`
		Failures    int64
		FailuresTTL float64 `json:"failures_ttl_seconds"`
	}
	if err := json.Unmarshal([]byte(out), &ks); err != nil || ks.State != "done" || ks.TTL <= 1800 || ks.TTL > 3600 ||
		ks.Failures != 3 || ks.FailuresTTL <= 1800 || ks.FailuresTTL > 3600 {
		t.Errorf("key --json c --postgres = %+v (%v); want done for about an hour, 3 failures for about an hour\n%s", ks, err, out)
	}
	out, stderr, code = cli(t, "", nil, "key", "a", "--postgres", url, "--table", table)
	expectCode(t, "key a --postgres", code, exitOK, stderr)
	if words := strings.Join(strings.Fields(out), " "); !strings.Contains(words, "state absent") || !strings.Contains(words, "failures 0") {
		t.Errorf("key a --postgres output:\n%s", out)
	}

	_, stderr, code = cli(t, "", nil, "key", "b", "--postgres", url, "--table", table+"_missing")
	expectCode(t, "key --postgres of a missing table", code, exitFailed, stderr)
	if !strings.Contains(stderr, "does not exist") {
		t.Errorf("missing table: stderr %q; want it to say the table does not exist", stderr)
	}
	for name, args := range map[string][]string{
		"--redis and --postgres": {"--redis", "127.0.0.1:6379", "--postgres", url},
		"--postgres --prefix":    {"--postgres", url, "--prefix", "p:"},
		"--redis --table":        {"--redis", "127.0.0.1:6379", "--table", table},
		"a bad --table":          {"--postgres", url, "--table", "Bad-Name"},
	} {
		_, stderr, code = cli(t, "", nil, append([]string{"key", "b"}, args...)...)
		expectCode(t, "key "+name, code, exitUsage, stderr)
	}
}

// What a key's state means, and what the store cannot know: an absent key
// with no failures is also what a dead-lettered message leaves, since
// Retry resets its count and Dedup releases its claim when it
// dead-letters.
func TestKeySaysWhatTheStoreKnows(t *testing.T) {
	addr := testenv.RedisAddr(t)
	rc := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { rc.Close() })
	prefix := "rabbitmw-test-cli:" + queueName(t) + ":"
	st := redisstore.New(rc, redisstore.Options{Prefix: prefix})
	ctx := context.Background()
	_, err := st.Fail(ctx, "between", time.Hour)
	require.NoError(t, err)
	t.Cleanup(func() { rc.Del(context.Background(), prefix+"retry:between") })

	for _, c := range []struct {
		key  string
		want []string
	}{
		{"never-seen", []string{"state absent", "failures 0", "dead-lettered", "dlq show"}},
		{"between", []string{"state absent", "failures 1", "between attempts"}},
	} {
		out, stderr, code := cli(t, "", nil, "key", c.key, "--redis", addr, "--prefix", prefix)
		expectCode(t, "key "+c.key, code, exitOK, stderr)
		words := strings.Join(strings.Fields(out), " ")
		for _, w := range c.want {
			assert.Contains(t, words, w, "key %s:\n%s", c.key, out)
		}
		out, stderr, code = cli(t, "", nil, "key", "--json", c.key, "--redis", addr, "--prefix", prefix)
		expectCode(t, "key --json "+c.key, code, exitOK, stderr)
		var ks struct{ Meaning, Unknown string }
		require.NoError(t, json.Unmarshal([]byte(out), &ks), out)
		assert.NotEmpty(t, ks.Meaning, "key --json %s: no meaning\n%s", c.key, out)
	}
}

// A message without an id is listed and shown by its key; messages are
// selected by their error's text, and grouped by type and masked text.
func TestDLQKeysTextAndGroups(t *testing.T) {
	_, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	now := time.Now().UTC().Truncate(time.Second)
	b := broker.New(url, broker.Options{KeepEmptyMessageID: true})
	t.Cleanup(func() { b.Close() })
	pub := func(id, body string, h amqp.Table) {
		require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: id, Body: []byte(body), Headers: h}))
	}
	pub("", `{"order":7}`, faulty(q, "error", "decode order 7: unexpected EOF", now))
	pub("m8", "x", faulty(q, "error", "decode order 8: unexpected EOF", now))
	pub("m9", "y", faulty(q, "*json.SyntaxError", "payment Gateway said no", now))
	sum := md5.Sum([]byte(`{"order":7}`))
	key := hex.EncodeToString(sum[:])

	out, stderr, code := cli(t, url, nil, "dlq", "ls", "-q", q)
	expectCode(t, "dlq ls", code, exitOK, stderr)
	assert.Contains(t, out, key, "dlq ls lists the message without an id by its key")
	out, stderr, code = cli(t, url, nil, "dlq", "show", "-q", q, key)
	expectCode(t, "dlq show KEY", code, exitOK, stderr)
	assert.Contains(t, out, "decode order 7", "dlq show KEY")

	out, stderr, code = cli(t, url, nil, "dlq", "ls", "-q", q, "--error", "gateway SAID")
	expectCode(t, "dlq ls --error", code, exitOK, stderr)
	assert.Contains(t, out, "m9")
	assert.NotContains(t, out, "m8")
	assert.Contains(t, out, "1 message(s)")

	out, stderr, code = cli(t, url, nil, "dlq", "groups", "-q", q, "--json")
	expectCode(t, "dlq groups", code, exitOK, stderr)
	var groups []struct {
		ID, ErrorType, Pattern string
		Count                  int
	}
	require.NoError(t, json.Unmarshal([]byte(out), &groups), out)
	require.Len(t, groups, 2, out)
	assert.Equal(t, "decode order #: unexpected EOF", groups[0].Pattern)
	assert.Equal(t, 2, groups[0].Count)
	out, stderr, code = cli(t, url, nil, "dlq", "ls", "-q", q, "--group", groups[0].ID)
	expectCode(t, "dlq ls --group", code, exitOK, stderr)
	assert.Contains(t, out, "2 message(s)")
	assert.Contains(t, out, "m8")
}

// A command interrupted (Ctrl-C, SIGTERM) says so, whichever step it was
// at: not only "context canceled".
func TestInterruptedCommandSaysSo(t *testing.T) {
	_, url, q := setupQueue(t)
	for _, args := range [][]string{
		{"dlq", "ls", "-q", q},
		{"dlq", "replay", "-q", q, "--all"},
		{"dlq", "purge", "-q", q, "--all"},
		{"dlq", "export", "-q", q},
		{"topology", "show", "-q", q},
	} {
		ctx, interrupt := context.WithCancelCause(context.Background())
		interrupt(errors.New("interrupt signal received"))
		var stdout, stderr bytes.Buffer
		code := run(ctx, append(args, "--amqp", url), strings.NewReader(""), &stdout, &stderr)
		assert.Equal(t, exitFailed, code, "%v: exit code", args)
		assert.Contains(t, stderr.String(), "interrupted (interrupt signal received)", "%v", args)
	}
}

// rabbitmw with no command is bad usage: the usage goes to standard
// error, as for an unknown command, and standard output stays empty; asked
// for, with -h, it goes to standard output.
func TestUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		code int
	}{
		{nil, exitUsage},
		{[]string{"-h"}, exitOK},
		{[]string{"--help"}, exitOK},
	} {
		var stdout, stderr bytes.Buffer
		code := run(context.Background(), tc.args, strings.NewReader(""), &stdout, &stderr)
		assert.Equal(t, tc.code, code, "%q: exit code", tc.args)
		out, other := stdout.String(), stderr.String()
		if tc.code != exitOK {
			out, other = other, out
		}
		assert.Contains(t, out, "usage:", "%q", tc.args)
		assert.Empty(t, other, "%q", tc.args)
	}
}
