package relay_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	noopmetric "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/otelmw"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/pgstore/relay"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fixture is an outbox on a table of its own, a broker, and a queue of
// its own, all removed when the test ends.
type fixture struct {
	t     *testing.T
	pool  *pgxpool.Pool
	ob    *pgstore.Outbox
	table string
	b     *broker.Broker
	queue string
}

func unique(prefix string) string {
	b := make([]byte, 6)
	rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// closeWhenDone closes pool when the test ends. pool.Close waits for every
// connection to come back. It hung now and then, with no goroutine left
// holding a connection: a relay stopped while its dispatch set HoldFor
// leaked the dispatch's connection (fixed; see pgstore's
// TestOutboxDispatchThatFailsReleasesItsConnection), and a relay stopped
// while a statement was in flight left its connection to be closed in
// the background (fixed; see
// TestRelayStopGivesBackTheConnectionOfAStatementInFlight). A bounded
// wait turns such a leak into a failure that says what the pool held,
// rather than a test binary that hangs until its timeout.
func closeWhenDone(t *testing.T, pool *pgxpool.Pool) {
	t.Cleanup(func() {
		closed := make(chan struct{})
		go func() { pool.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(15 * time.Second):
			st := pool.Stat()
			t.Errorf("pool.Close blocked 15 s: acquired %d, constructing %d, idle %d, total %d", st.AcquiredConns(), st.ConstructingConns(), st.IdleConns(), st.TotalConns())
		}
	})
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	url := testenv.PostgresURL(t)
	amqpURL := testenv.RabbitMQURL(t)
	pool, err := pgxpool.New(context.Background(), url)
	require.NoError(t, err)
	closeWhenDone(t, pool)
	table := unique("rmwtest_outbox_")
	t.Cleanup(func() { pool.Exec(context.Background(), `DROP TABLE IF EXISTS `+table) })
	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: table})
	require.NoError(t, ob.Migrate(context.Background()))
	b := broker.New(amqpURL, broker.Options{})
	t.Cleanup(func() { b.Close() })
	f := &fixture{t: t, pool: pool, ob: ob, table: table, b: b, queue: unique("rmwtest.outbox.")}
	f.declare(f.queue)
	return f
}

func (f *fixture) declare(queue string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	top := broker.Topology{Delays: []time.Duration{time.Second}}
	require.NoError(f.t, f.b.Declare(ctx, queue, top))
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		f.b.Delete(ctx, queue, top)
	})
}

// write writes n messages to key in one transaction, committed unless
// rollback, and returns their ids.
func (f *fixture) write(key string, n int, rollback bool) []string {
	f.t.Helper()
	ctx := context.Background()
	tx, err := f.pool.Begin(ctx)
	require.NoError(f.t, err)
	defer tx.Rollback(ctx)
	var ids []string
	for i := range n {
		id, err := f.ob.Write(ctx, tx, "", key, amqp.Publishing{Body: fmt.Appendf(nil, "%d", i), Headers: amqp.Table{"n": int32(i)}})
		require.NoError(f.t, err)
		ids = append(ids, id)
	}
	if !rollback {
		require.NoError(f.t, tx.Commit(ctx))
	}
	return ids
}

// run runs r until the test ends, and checks that it returns nil.
func (f *fixture) run(r *relay.Relay) (stop func()) {
	_, stop = f.start(r)
	return stop
}

// start runs r as run does, and returns also the context that r runs
// under, done once stop is called.
func (f *fixture) start(r *relay.Relay) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-done:
				assert.NoError(f.t, err)
			case <-time.After(30 * time.Second):
				f.t.Error("Run did not return 30s after its context was cancelled")
			}
		})
	}
	f.t.Cleanup(stop)
	return ctx, stop
}

// drain takes the messages of the queue until it has want of them (or
// 20 s pass), and returns the count of each message id.
func (f *fixture) drain(want int) map[string]int {
	f.t.Helper()
	return f.drainWithin(want, 20*time.Second)
}

// drainWithin is drain, which gives up after d.
func (f *fixture) drainWithin(want int, d time.Duration) map[string]int {
	f.t.Helper()
	got := map[string]int{}
	total := 0
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for total < want && ctx.Err() == nil {
		d, ok, err := f.b.Get(ctx, f.queue)
		if ctx.Err() != nil {
			break
		}
		require.NoError(f.t, err)
		if !ok {
			time.Sleep(20 * time.Millisecond) // waits for the relay's sends
			continue
		}
		require.NoError(f.t, d.Ack(false))
		got[d.MessageId]++
		total++
	}
	return got
}

func (f *fixture) stats() pgstore.OutboxStats {
	s, err := f.ob.Stats(context.Background())
	require.NoError(f.t, err)
	return s
}

func once(ids []string) map[string]int {
	m := map[string]int{}
	for _, id := range ids {
		m[id] = 1
	}
	return m
}

// A committed message arrives, with the id given at write time; one of a
// transaction that rolled back never does. With a poll of an hour, only
// the notification of the commit can wake the relay.
func TestRelaySendsCommittedRowsOnNotification(t *testing.T) {
	f := newFixture(t)
	f.run(relay.New(f.ob, f.b, relay.Options{PollInterval: time.Hour}))
	first := f.write(f.queue, 1, false)
	assert.Equal(t, once(first), f.drain(1))

	f.write(f.queue, 5, true)
	ids := f.write(f.queue, 50, false)
	assert.Equal(t, once(ids), f.drain(50))
	require.Eventually(t, func() bool { return f.stats().Sent == 51 }, 10*time.Second, 20*time.Millisecond)
	assert.Equal(t, pgstore.OutboxStats{Sent: 51}, f.stats())
	left, err := f.b.Len(context.Background(), f.queue)
	require.NoError(t, err)
	assert.Zero(t, left, "nothing of the rolled-back transaction")
}

func TestRelayPollsWithoutNotifications(t *testing.T) {
	f := newFixture(t)
	f.run(relay.New(f.ob, f.b, relay.Options{NoListen: true, PollInterval: 50 * time.Millisecond, Retention: -1}))
	ids := f.write(f.queue, 20, false)
	assert.Equal(t, once(ids), f.drain(20))
	require.Eventually(t, func() bool { return f.stats() == pgstore.OutboxStats{} }, 10*time.Second, 20*time.Millisecond,
		"with a negative retention, confirmed rows are deleted")
}

// A message that no queue takes is returned by RabbitMQ: its row is
// parked, with the reason, and sent once an operator retries it.
func TestRelayParksUnroutableMessages(t *testing.T) {
	f := newFixture(t)
	var parked atomic.Int64
	stop := f.run(relay.New(f.ob, f.b, relay.Options{PollInterval: 50 * time.Millisecond, Observer: relay.Observer{
		Dispatched: func(_ context.Context, _, p, _ int) { parked.Add(int64(p)) },
	}}))
	missing := unique("rmwtest.outbox.missing.")
	lost := f.write(missing, 3, false)
	ids := f.write(f.queue, 3, false)
	assert.Equal(t, once(ids), f.drain(3), "a parked row does not hold the others back")
	// The relay reports a dispatch after its commit: the rows may be
	// parked a moment before the Observer hears of it.
	require.Eventually(t, func() bool { return f.stats().Parked == 3 && parked.Load() >= 3 }, 10*time.Second, 20*time.Millisecond,
		"3 rows parked, and reported parked to the Observer")
	rows, err := f.ob.List(context.Background(), pgstore.OutboxFilter{State: "parked"})
	require.NoError(t, err)
	require.Len(t, rows, 3)
	for _, r := range rows {
		assert.Contains(t, lost, r.MessageID)
		assert.Contains(t, r.Error, "unroutable")
		assert.Equal(t, 1, r.Attempts)
	}

	// The operator binds the queue and retries.
	f.declare(missing)
	n, err := f.ob.Retry(context.Background(), nil)
	require.NoError(t, err)
	assert.Equal(t, int64(3), n)
	f.queue = missing
	assert.Equal(t, once(lost), f.drain(3))
	stop() // every dispatch reported
	assert.Equal(t, int64(3), parked.Load(), "rows reported parked")
}

// A message that RabbitMQ refuses by closing the channel (here a UserId
// that is not the connection's user) is parked alone, with its reason:
// the refusal does not say which publish it was, and the rows in flight
// beside it on the channel, refused with it, are sent (again) one at a
// time, so that only the row refused alone is parked.
func TestRelayParksOnlyTheRowThatTheServerRefused(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	var bad string
	var good []string
	require.NoError(t, pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
		for i := range 50 {
			m := amqp.Publishing{Body: fmt.Appendf(nil, "%d", i)}
			if i == 25 {
				m.UserId = "nobody"
			}
			id, err := f.ob.Write(ctx, tx, "", f.queue, m)
			if i == 25 {
				bad = id
			} else {
				good = append(good, id)
			}
			if err != nil {
				return err
			}
		}
		return nil
	}))
	rows := f.sendParkingOnly(bad, good)
	if len(rows) > 0 {
		assert.Contains(t, rows[0].Error, "nobody")
	}
}

// A row to an exchange that does not exist is parked, and only it, when
// the rows beside it go to an exchange named as the virtual host is
// (here "/"; a vhost "shop" with an exchange "shop" is as likely): the
// server's reason for closing the channel ("no exchange 'missing' in vhost
// '/'") names the vhost too, and must not be read as naming theirs.
func TestRelayParksOnlyTheRowToAMissingExchange(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	const vhostNamed = "/"
	conn, err := amqp.Dial(testenv.RabbitMQURL(t))
	require.NoError(t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(t, err)
	// Auto-deleted with its last binding, when the last test that bound
	// a queue to it deleted its queue: a test run beside this one may
	// use it too.
	require.NoError(t, ch.ExchangeDeclare(vhostNamed, "direct", false, true, false, false, nil))
	require.NoError(t, ch.QueueBind(f.queue, f.queue, vhostNamed, false, nil))
	missing := unique("rmwtest.missing.")
	var bad string
	var good []string
	require.NoError(t, pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
		for i := range 50 {
			exchange := vhostNamed
			if i == 25 {
				exchange = missing
			}
			id, err := f.ob.Write(ctx, tx, exchange, f.queue, amqp.Publishing{Body: fmt.Appendf(nil, "%d", i)})
			if err != nil {
				return err
			}
			if i == 25 {
				bad = id
			} else {
				good = append(good, id)
			}
		}
		return nil
	}))
	f.sendParkingOnly(bad, good)
}

// sendParkingOnly runs a relay until no row is pending, and checks that
// the row of message id bad alone was parked and that every row of good
// reached the queue (some maybe twice: those that the server took before
// a channel closed for bad, sent again). It returns the parked rows.
func (f *fixture) sendParkingOnly(bad string, good []string) []pgstore.OutboxRow {
	t := f.t
	t.Helper()
	ctx := context.Background()
	f.run(relay.New(f.ob, f.b, relay.Options{Senders: 1, PollInterval: 20 * time.Millisecond}))
	require.Eventually(t, func() bool { return f.stats().Pending == 0 }, 10*time.Second, 20*time.Millisecond)
	rows, err := f.ob.List(ctx, pgstore.OutboxFilter{State: "parked"})
	require.NoError(t, err)
	var parked []string
	for _, r := range rows {
		parked = append(parked, r.MessageID)
		if r.MessageID != bad {
			t.Logf("row %d to %q parked: %s", r.ID, r.Exchange, r.Error)
		}
	}
	assert.Equal(t, []string{bad}, parked, "parked rows")
	n, err := f.b.Len(ctx, f.queue)
	require.NoError(t, err)
	got := f.drain(n)
	var unsent int
	for _, id := range good {
		if got[id] == 0 {
			unsent++
		}
	}
	assert.Zero(t, unsent, "rows that the server did not refuse, not sent")
	return rows
}

// A publisher that fails for a while: no confirm, so the rows stay
// pending, count the attempts, and are sent once RabbitMQ is back.
type flaky struct {
	relay.Publisher
	failures atomic.Int64 // publishes left to fail
	calls    atomic.Int64
}

func (p *flaky) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	p.calls.Add(1)
	if p.failures.Add(-1) >= 0 {
		return fmt.Errorf("%w: test: RabbitMQ is down", broker.ErrConnectionLost)
	}
	return p.Publisher.Publish(ctx, exchange, key, msg)
}

func TestRelayKeepsRowsWhoseConfirmDidNotCome(t *testing.T) {
	f := newFixture(t)
	p := &flaky{Publisher: f.b}
	p.failures.Store(12)
	f.run(relay.New(f.ob, p, relay.Options{BatchSize: 4, PollInterval: 50 * time.Millisecond, BackoffMin: time.Millisecond, BackoffMax: 20 * time.Millisecond}))
	ids := f.write(f.queue, 4, false)
	assert.Equal(t, once(ids), f.drain(4))
	assert.GreaterOrEqual(t, p.calls.Load(), int64(16))
	require.Eventually(t, func() bool { return f.stats().Sent == 4 }, 10*time.Second, 20*time.Millisecond)
	rows, err := f.ob.List(context.Background(), pgstore.OutboxFilter{})
	require.NoError(t, err)
	attempts := 0
	for _, r := range rows {
		attempts += r.Attempts
		assert.Equal(t, "sent", r.State)
	}
	assert.Equal(t, 12, attempts)
}

// While RabbitMQ cannot be reached, the relay itself backs off between
// dispatches, rather than walk the backlog a batch at a time giving
// each row a wait of its own: in a second, with waits of 150 ms on
// average, it tries a handful of rows, not hundreds.
func TestRelayBacksOffWhileRabbitMQIsDown(t *testing.T) {
	f := newFixture(t)
	p := &flaky{Publisher: f.b}
	p.failures.Store(math.MaxInt64)
	f.write(f.queue, 200, false)
	f.run(relay.New(f.ob, p, relay.Options{BatchSize: 1, Senders: 1, PollInterval: time.Hour, BackoffMin: 300 * time.Millisecond, BackoffMax: 300 * time.Millisecond}))
	require.Never(t, func() bool { return p.calls.Load() >= 50 }, time.Second, 10*time.Millisecond, "publishes while RabbitMQ is down")
	assert.Equal(t, int64(200), f.stats().Pending)
}

// A publisher whose confirms come only after the relay was told to stop:
// Run waits for them, and records the rows sent, so that no relay sends
// them again. Each Publish says on started that the relay sent it, then
// waits for stopped before it publishes.
type late struct {
	relay.Publisher
	started chan<- struct{}
	stopped <-chan struct{}
}

func (p *late) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	p.started <- struct{}{}
	<-p.stopped
	return p.Publisher.Publish(ctx, exchange, key, msg)
}

// The stop comes once the relay is publishing the batch (every Publish has
// started), and the publishes go on only after it: Run's context is done
// before any confirm can come.
func TestRelayStopWaitsForTheConfirmsInFlight(t *testing.T) {
	f := newFixture(t)
	const n = 5
	started, stopped := make(chan struct{}, n), make(chan struct{})
	p := &late{Publisher: f.b, started: started, stopped: stopped}
	ctx, stop := f.start(relay.New(f.ob, p, relay.Options{PollInterval: 20 * time.Millisecond, Observer: relay.Observer{
		Extract: func(ctx context.Context, _ map[string]string) context.Context { return ctx },
	}}))
	context.AfterFunc(ctx, func() { close(stopped) })
	ids := f.write(f.queue, n, false) // one transaction: one batch takes them all
	for i := range n {
		select {
		case <-started:
		case <-time.After(10 * time.Second):
			t.Fatalf("%d of %d publishes started 10 s after the write", i, n)
		}
	}
	stop()
	assert.Equal(t, pgstore.OutboxStats{Sent: n}, f.stats())
	assert.Equal(t, once(ids), f.drain(n))
}

// Several relays on one outbox share its rows: each message is sent once.
func TestRelaysShareTheOutbox(t *testing.T) {
	f := newFixture(t)
	const n = 400
	var ids []string
	for range 4 {
		ids = append(ids, f.write(f.queue, n/4, false)...)
	}
	var sent atomic.Int64
	var stops []func()
	for range 3 {
		stops = append(stops, f.run(relay.New(f.ob, f.b, relay.Options{BatchSize: 10, PollInterval: 20 * time.Millisecond, Observer: relay.Observer{
			Dispatched: func(_ context.Context, s, _, _ int) { sent.Add(int64(s)) },
		}})))
	}
	assert.Equal(t, once(ids), f.drain(n))
	require.Eventually(t, func() bool { return f.stats().Sent == n }, 10*time.Second, 20*time.Millisecond)
	// A relay reports a dispatch after its commit: the counts are read
	// once every relay has returned.
	for _, stop := range stops {
		stop()
	}
	assert.Equal(t, int64(n), sent.Load(), "confirmed sends")
	left, err := f.b.Len(context.Background(), f.queue)
	require.NoError(t, err)
	assert.Zero(t, left, "no copy")
}

// refusing is a publisher that returns err for every message.
type refusing struct{ err error }

func (p refusing) Publish(context.Context, string, string, amqp.Publishing) error { return p.err }

// What the relay does with a row whose publish failed, by the error: it
// parks only what sending again cannot mend, and keeps the others pending,
// to be sent again after its backoff.
func TestRelayParksOnlyWhatCannotSucceed(t *testing.T) {
	for _, tc := range []struct {
		name, state string
		err         error
	}{
		{"returned", "parked", broker.ErrUnroutable},
		{"invalid", "parked", fmt.Errorf("%w: header too big", broker.ErrInvalidMessage)},
		{"refused, channel closed", "parked", &amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED", Server: true, Recover: true}},
		{"nacked", "pending", broker.ErrNacked},
		{"no confirm", "pending", broker.ErrConnectionLost},
		{"connection closed by the server", "pending", &amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED", Server: true}},
		// The server closed the channel for another publish (to an
		// exchange that does not exist), and the context ended while the
		// broker published this one again: as broker.Broker.Publish words
		// it.
		{"no confirm, after a channel closed for another publish", "pending", fmt.Errorf("broker: publish: %w (last error: %w)", context.DeadlineExceeded,
			fmt.Errorf("%w: publish channel closed: %w", broker.ErrConnectionLost, &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no exchange 'other' in vhost '/'", Server: true, Recover: true}))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			f.write(f.queue, 1, false)
			f.run(relay.New(f.ob, refusing{tc.err}, relay.Options{Senders: 1, PollInterval: 20 * time.Millisecond, BackoffMin: time.Millisecond, BackoffMax: 10 * time.Millisecond}))
			var row pgstore.OutboxRow
			require.Eventually(t, func() bool {
				rows, err := f.ob.List(context.Background(), pgstore.OutboxFilter{})
				if err != nil || len(rows) != 1 {
					return false
				}
				row = rows[0]
				return row.State == "parked" || row.Attempts >= 3
			}, 10*time.Second, 10*time.Millisecond)
			assert.Equal(t, tc.state, row.State)
			assert.Equal(t, tc.err.Error(), row.Error)
		})
	}
}

// A message that RabbitMQ nacks is one it cannot take now (here a queue at
// its length limit that rejects publishes; in a cluster, a quorum queue
// electing its leader): its row stays pending, and is sent again after its
// own backoff (its retry_at), never parked, and confirmed once the queue
// has room. With a poll of an hour and no write, only the relay's wake at
// the rows' retry_at sends them again. The relay says so at Warn once per
// failed dispatch at most, with the reason, not once per row.
func TestRelayKeepsNackedRowsPending(t *testing.T) {
	f := newFixture(t)
	full := f.declareFull()

	const n = 3
	ids := f.write(full, n, false)
	logs := &recorder{}
	var failedDispatches, parked atomic.Int64
	stop := f.run(relay.New(f.ob, f.b, relay.Options{
		Logger: slog.New(logs), Senders: 1, PollInterval: time.Hour,
		BackoffMin: 10 * time.Millisecond, BackoffMax: 100 * time.Millisecond,
		Observer: relay.Observer{Dispatched: func(_ context.Context, _, p, failed int) {
			parked.Add(int64(p))
			if failed > 0 {
				failedDispatches.Add(1)
			}
		}},
	}))

	// Nacked and sent again while the queue is full: each row has been
	// tried twice or more, and none is parked.
	retriedOrParked := func() bool {
		rows, err := f.ob.List(context.Background(), pgstore.OutboxFilter{})
		if err != nil {
			return false
		}
		for _, r := range rows {
			if r.State == "parked" {
				return true
			}
			if r.Attempts < 2 {
				return false
			}
		}
		return len(rows) == n
	}
	require.Eventually(t, retriedOrParked, 10*time.Second, 20*time.Millisecond)
	rows, err := f.ob.List(context.Background(), pgstore.OutboxFilter{})
	require.NoError(t, err)
	require.Len(t, rows, n)
	for _, r := range rows {
		require.Equal(t, "pending", r.State, "a nacked row stays pending")
		assert.Contains(t, r.Error, "nack")
	}
	assert.Zero(t, parked.Load())

	// The queue drains: the rows go through, each once.
	f.queue = full
	got := f.drain(1 + n)
	assert.Equal(t, 1, got["blocker"])
	delete(got, "blocker")
	assert.Equal(t, once(ids), got)
	require.Eventually(t, func() bool { return f.stats().Sent == n }, 10*time.Second, 20*time.Millisecond)
	stop()
	assert.Equal(t, pgstore.OutboxStats{Sent: n}, f.stats())
	left, err := f.b.Len(context.Background(), full)
	require.NoError(t, err)
	assert.Zero(t, left, "no copy")

	// One record per failed dispatch, not one per row.
	warns := logs.find(slog.LevelWarn, "nack")
	require.NotEmpty(t, warns)
	assert.LessOrEqual(t, int64(len(warns)), failedDispatches.Load())
}

// declareFull declares a queue of its own that holds one message at most
// and nacks what is published beyond (overflow reject-publish), deleted
// when the test ends, publishes the message "blocker" into it, and
// returns its name.
func (f *fixture) declareFull() string {
	f.t.Helper()
	full := unique("rmwtest.outbox.full.")
	conn, err := amqp.Dial(testenv.RabbitMQURL(f.t))
	require.NoError(f.t, err)
	defer conn.Close()
	ch, err := conn.Channel()
	require.NoError(f.t, err)
	_, err = ch.QueueDeclare(full, false, false, false, false, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	require.NoError(f.t, err)
	f.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		f.b.Delete(ctx, full, broker.Topology{Declare: broker.DeclareNone})
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(f.t, f.b.Publish(ctx, "", full, amqp.Publishing{MessageId: "blocker", Body: []byte("blocker")}))
	return full
}

// Rows that RabbitMQ keeps nacking (a queue that stays full) do not hold
// back the rows written after them for other queues: neither when they
// fill a batch, nor when one of them comes in each batch, nor when they
// fill many batches (20 here, each of which the default backoff would
// follow with a longer wait), with the default backoff.
func TestRelayNackedRowsDoNotHoldBackTheOthers(t *testing.T) {
	for _, tc := range []struct {
		name          string
		stuck, others int
		batch         int
		within        time.Duration // for the others to arrive; 0 means 20 s
	}{
		{"a batch of them", 5, 20, 5, 0},
		{"one in each batch", 1, 300, 10, 0},
		{"many batches of them", 100, 5, 5, 3 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			full := f.declareFull()
			f.write(full, tc.stuck, false)
			ids := f.write(f.queue, tc.others, false)
			f.run(relay.New(f.ob, f.b, relay.Options{BatchSize: tc.batch, Senders: 1, PollInterval: 50 * time.Millisecond}))
			within := cmp.Or(tc.within, 20*time.Second)
			got := f.drainWithin(tc.others, within)
			require.Equal(t, once(ids), got, "%d of %d arrived within %s", len(got), tc.others, within)
			require.Eventually(t, func() bool { return f.stats().Sent == int64(tc.others) }, 10*time.Second, 20*time.Millisecond)
			s := f.stats()
			assert.Equal(t, int64(tc.stuck), s.Pending, "the nacked rows stay pending")
			assert.Zero(t, s.Parked)
		})
	}
}

// A recorder is a slog.Handler that keeps its records.
type recorder struct {
	mu      sync.Mutex
	records []slog.Record
}

func (h *recorder) Enabled(context.Context, slog.Level) bool { return true }
func (h *recorder) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *recorder) WithGroup(string) slog.Handler            { return h }

func (h *recorder) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.records = append(h.records, r.Clone())
	return nil
}

// find returns the records at level whose message or attributes contain
// text.
func (h *recorder) find(level slog.Level, text string) []slog.Record {
	h.mu.Lock()
	defer h.mu.Unlock()
	var found []slog.Record
	for _, r := range h.records {
		s := r.Message
		r.Attrs(func(a slog.Attr) bool { s += " " + a.String(); return true })
		if r.Level == level && strings.Contains(s, text) {
			found = append(found, r)
		}
	}
	return found
}

// With otelmw wired in (the writer's trace context stored by Inject, given
// back by Extract, the broker's publish observed), the relay's send span
// is a child of the writer's span, and the message carries the send's
// context to the next service.
func TestRelayContinuesTheWritersTrace(t *testing.T) {
	f := newFixture(t)
	spans := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))
	t.Cleanup(func() { tp.Shutdown(context.Background()) })
	tel := otelmw.New(otelmw.Options{TracerProvider: tp, MeterProvider: noopmetric.NewMeterProvider(), Propagator: propagation.TraceContext{}})
	ot := tel.Outbox(f.ob.Table())
	ob := pgstore.NewOutbox(f.pool, pgstore.OutboxOptions{Table: f.ob.Table(), Inject: ot.Inject})
	b := broker.New(testenv.RabbitMQURL(t), broker.Options{Observer: tel.Broker()})
	t.Cleanup(func() { b.Close() })

	ctx, writer := tp.Tracer("test").Start(context.Background(), "process orders")
	require.NoError(t, pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
		_, err := ob.Write(ctx, tx, "", f.queue, amqp.Publishing{Body: []byte("ship")})
		return err
	}))
	writer.End()
	f.run(relay.New(ob, b, relay.Options{PollInterval: 50 * time.Millisecond, Observer: relay.Observer{Extract: ot.Extract, Dispatched: ot.Dispatched}}))

	var d *amqp.Delivery
	require.Eventually(t, func() bool {
		var ok bool
		var err error
		d, ok, err = f.b.Get(context.Background(), f.queue)
		return err == nil && ok
	}, 10*time.Second, 20*time.Millisecond)
	require.NoError(t, d.Ack(false))
	var send sdktrace.ReadOnlySpan
	require.Eventually(t, func() bool { // it ends with the confirm, which may follow the delivery
		for _, s := range spans.Ended() {
			if s.Name() == "send "+f.queue {
				send = s
			}
		}
		return send != nil
	}, 10*time.Second, 10*time.Millisecond, "the relay's send span")
	assert.Equal(t, writer.SpanContext().TraceID(), send.SpanContext().TraceID())
	assert.Equal(t, writer.SpanContext().SpanID(), send.Parent().SpanID(), "the send's parent is the writer's span")
	assert.Contains(t, d.Headers["traceparent"], send.SpanContext().SpanID().String(), "the message carries the send's context")
}

// A relay stopped while a statement of its dispatch waits on the database
// lets the statement end, and gives the connection back to the pool, open,
// before Run returns. A statement cut by the stop costs its connection:
// pgx closes it in the background (a cancel request, then up to 15 s),
// and the pool holds it as acquired until then, so that a pool.Close right
// after Run waited for it. Here the take waits for a lock that the test
// holds on the outbox's table, and the test lets it go once the stop had
// time to cut it.
func TestRelayStopGivesBackTheConnectionOfAStatementInFlight(t *testing.T) {
	f := newFixture(t)
	cfg := f.pool.Config()
	var closed atomic.Int64
	cfg.BeforeClose = func(*pgx.Conn) { closed.Add(1) }
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	closeWhenDone(t, pool)
	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: f.ob.Table()})
	f.write(f.queue, 1, false)

	ctx := context.Background()
	lock, err := f.pool.Begin(ctx)
	require.NoError(t, err)
	release := sync.OnceValue(func() error { return lock.Rollback(ctx) })
	defer release()
	table := pgx.Identifier{f.ob.Table()}.Sanitize()
	_, err = lock.Exec(ctx, `LOCK TABLE `+table+` IN EXCLUSIVE MODE`)
	require.NoError(t, err)

	rctx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() {
		done <- relay.New(ob, f.b, relay.Options{Senders: 1, NoListen: true, PollInterval: 20 * time.Millisecond, StopTimeout: 10 * time.Second}).Run(rctx)
	}()
	require.Eventually(t, func() bool { // the take waits for the lock
		var waiting int
		err := f.pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE relation = $1::regclass AND NOT granted`, table).Scan(&waiting)
		return err == nil && waiting > 0
	}, 10*time.Second, 10*time.Millisecond)

	stop()
	select {
	case err = <-done: // the take was cut
	case <-time.After(500 * time.Millisecond): // it still waits
		require.NoError(t, release())
		select {
		case err = <-done:
		case <-time.After(20 * time.Second):
			t.Fatal("Run did not return 20 s after its stop")
		}
	}
	require.NoError(t, err)
	acquired := pool.Stat().AcquiredConns()
	require.Eventually(t, func() bool { return pool.Stat().AcquiredConns() == 0 }, 20*time.Second, 10*time.Millisecond)
	assert.Zero(t, acquired, "connections out of the pool when Run returned")
	assert.Zero(t, closed.Load(), "connections closed by the stop")
	require.NoError(t, release())
	assert.Equal(t, int64(1), f.stats().Pending, "the row stays pending, for the next relay")
}

// Sent rows past the retention are deleted as fast as they pile up, not
// a fixed number a minute: a relay that sends more rows than one
// deletion takes catches up with them. Here a deletion takes ten rows
// (ten times BatchSize), and thirty rows are past the retention.
func TestRelayDeletesEverySentRowPastTheRetention(t *testing.T) {
	f := newFixture(t)
	f.write(f.queue, 30, false)
	table := pgx.Identifier{f.ob.Table()}.Sanitize()
	_, err := f.pool.Exec(context.Background(), `UPDATE `+table+` SET state = 'sent', sent_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	require.Equal(t, pgstore.OutboxStats{Sent: 30}, f.stats())

	f.run(relay.New(f.ob, f.b, relay.Options{BatchSize: 1, Senders: 1, NoListen: true, PollInterval: 20 * time.Millisecond, Retention: time.Hour}))
	assert.Eventually(t, func() bool { return f.stats().Sent == 0 }, 10*time.Second, 20*time.Millisecond)
	assert.Zero(t, f.stats().Sent, "sent rows past the retention left after 10 s")
}

// The copy that a consumer gets carries every property and header of the
// message as written, each header of its AMQP type (a header string
// that is not UTF-8, a negative zero and an empty body included): the
// outbox's table and the relay change nothing. (An AMQP timestamp holds
// whole seconds.)
func TestRelaySendsTheMessageAsWritten(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	ts := time.Unix(1700000000, 0)
	msg := amqp.Publishing{
		ContentType: "application/json", ContentEncoding: "gzip", Priority: 3, DeliveryMode: 1,
		CorrelationId: "c1", ReplyTo: "replies", Expiration: "60000", Timestamp: ts,
		Type: "order.paid", UserId: "guest", AppId: "shop", MessageId: "probe",
		Headers: amqp.Table{
			"bool": true, "i8": int8(-8), "u8": uint8(8), "i16": int16(-16), "u16": uint16(16),
			"i32": int32(-32), "u32": uint32(32), "i64": int64(-1 << 62),
			"f32": float32(1.5), "f64": 2.25, "s": "text", "b": []byte{0, 1, 2}, "ts": ts,
			"dec": amqp.Decimal{Scale: 2, Value: 1234}, "nil": nil, "bin": "\xff\x00", "negz": math.Copysign(0, -1),
			"table": amqp.Table{"inner": "x", "deeper": amqp.Table{"n": int32(1)}},
			"array": []any{"a", int64(2), amqp.Table{"k": false}}, "empty": []byte{},
		},
		Body: []byte{},
	}
	require.NoError(t, pgx.BeginFunc(ctx, f.pool, func(tx pgx.Tx) error {
		_, err := f.ob.Write(ctx, tx, "", f.queue, msg)
		return err
	}))
	f.run(relay.New(f.ob, f.b, relay.Options{PollInterval: 20 * time.Millisecond}))
	var d *amqp.Delivery
	require.Eventually(t, func() bool {
		var ok bool
		var err error
		d, ok, err = f.b.Get(ctx, f.queue)
		return err == nil && ok
	}, 10*time.Second, 20*time.Millisecond)
	require.NoError(t, d.Ack(false))
	got := amqp.Publishing{ContentType: d.ContentType, ContentEncoding: d.ContentEncoding, Priority: d.Priority, DeliveryMode: d.DeliveryMode,
		CorrelationId: d.CorrelationId, ReplyTo: d.ReplyTo, Expiration: d.Expiration, Timestamp: d.Timestamp, Type: d.Type, UserId: d.UserId, AppId: d.AppId,
		MessageId: d.MessageId, Headers: d.Headers, Body: d.Body}
	assert.Equal(t, msg, got)
	assert.True(t, math.Signbit(d.Headers["negz"].(float64)), "negative zero")
}

// A relay with a PublishTimeout of a month still sends: its rows' hold
// (PublishTimeout + StopTimeout + 15 s) is over what PostgreSQL's
// idle_in_transaction_session_timeout takes.
func TestRelayWithALongPublishTimeout(t *testing.T) {
	f := newFixture(t)
	f.run(relay.New(f.ob, f.b, relay.Options{PublishTimeout: 30 * 24 * time.Hour, PollInterval: 50 * time.Millisecond}))
	ids := f.write(f.queue, 3, false)
	assert.Equal(t, once(ids), f.drainWithin(3, 5*time.Second))
}
