//go:build reliability

package reliability_test

// Scenario 17, the outbox chain: service A consumes orders with the
// PostgreSQL inbox and, in the same transaction, writes a shipment message
// into the outbox; two relays send the outbox to RabbitMQ; service B
// consumes the shipments with the inbox. A fails after its outbox write
// at the first attempt of one order in ten: that transaction rolls back,
// and its message must never reach B. Meanwhile A, B and the relays are
// killed (SIGKILL) at random and restarted, their RabbitMQ connections
// are cut, and PostgreSQL (a cluster of the test's own, holding every
// table) is restarted once. Required: every order gives exactly one
// effect in A and exactly one shipment effect in B; no shipment of a
// rolled-back transaction; nothing parked, nothing dead-lettered.

import (
	"cmp"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

var chainBuild struct {
	once sync.Once
	path string
	err  error
}

// chainBinary builds reliability/internal/chain once per test binary, with
// the race detector when the tests have it.
func chainBinary(t *testing.T) string {
	t.Helper()
	chainBuild.once.Do(func() {
		gotool := filepath.Join(runtime.GOROOT(), "bin", "go")
		if _, err := os.Stat(gotool); err != nil {
			gotool = "go"
		}
		chainBuild.path = filepath.Join(binDir, "chain")
		args := []string{"build", "-o", chainBuild.path}
		if raceEnabled {
			args = append(args, "-race")
		}
		args = append(args, "github.com/rabbitmw/rabbitmw/reliability/internal/chain")
		if out, err := exec.Command(gotool, args...).CombinedOutput(); err != nil {
			chainBuild.err = fmt.Errorf("go %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	})
	require.NoError(t, chainBuild.err)
	return chainBuild.path
}

// chainRun is the scenario's servers, tables and processes.
type chainRun struct {
	t                 *testing.T
	db                *pgServer
	pool              *pgxpool.Pool
	b                 *broker.Broker
	prefix            string
	orders, shipments string
	amqpURL           string // through the proxy
	bin, logDir       string
	mu                sync.Mutex
	procs             map[string]*chainProc // by role slot: a, b, relay1, relay2
	starts            map[string]int
}

type chainProc struct {
	name, logPath string
	*child
}

func (c *chainRun) start(slot string) {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.starts[slot]++
	name := fmt.Sprintf("%s-%d", slot, c.starts[slot])
	role := strings.TrimRight(slot, "0123456789")
	p := &chainProc{name: name, logPath: filepath.Join(c.logDir, name+".log")}
	logFile, err := os.Create(p.logPath)
	require.NoError(c.t, err)
	defer logFile.Close()
	cmd := exec.Command(c.bin, "-role", role, "-name", name, "-amqp", c.amqpURL, "-pg", c.db.url,
		"-prefix", c.prefix, "-orders", c.orders, "-shipments", c.shipments, "-delays", "250ms,1s")
	cmd.Stderr = logFile
	if p.child, err = startChild(c.t, cmd, nil); err != nil {
		c.t.Fatalf("starting %s: %v", name, err)
	}
	c.procs[slot] = p
}

func (c *chainRun) kill(slot string) string {
	c.mu.Lock()
	p := c.procs[slot]
	c.mu.Unlock()
	p.kill()
	return p.name
}

func (c *chainRun) count(ctx context.Context, q string) int {
	var n int
	if err := c.pool.QueryRow(ctx, q).Scan(&n); err != nil {
		c.t.Logf("%s: %v", q, err)
		return -1
	}
	return n
}

func TestOutboxChain(t *testing.T) {
	const (
		orders = 1000
		dups   = 100 // orders published a second time, with the same id
		kills  = 9
		cuts   = 3
	)
	rabbitURL := testenv.RabbitMQURL(t)
	db := startPostgresServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	stamp := strconv.FormatInt(time.Now().UnixNano(), 36)
	c := &chainRun{
		t: t, db: db, prefix: "chain", bin: chainBinary(t), logDir: t.TempDir(),
		orders:    "rabbitmw-reliability-chain-orders-" + stamp,
		shipments: "rabbitmw-reliability-chain-shipments-" + stamp,
		procs:     map[string]*chainProc{}, starts: map[string]int{},
	}
	var err error
	c.pool, err = pgxpool.New(ctx, db.url)
	require.NoError(t, err)
	defer c.pool.Close()
	ob := pgstore.NewOutbox(c.pool, pgstore.OutboxOptions{Table: "chain_outbox"})
	require.NoError(t, ob.Migrate(ctx))
	for _, table := range []string{"chain_a", "chain_b"} {
		st := pgstore.New(c.pool, pgstore.Options{Table: table})
		err := st.Migrate(ctx)
		st.Close()
		require.NoError(t, err)
	}
	for _, ddl := range []string{
		`CREATE TABLE chain_a_effects (seq bigserial PRIMARY KEY, order_id text NOT NULL, process text NOT NULL)`,
		`CREATE TABLE chain_b_effects (seq bigserial PRIMARY KEY, order_id text NOT NULL, message_id text NOT NULL, process text NOT NULL)`,
		`CREATE TABLE chain_rolled_back (order_id text PRIMARY KEY, message_id text NOT NULL)`,
		`CREATE TABLE chain_b_deliveries (message_id text NOT NULL)`,
	} {
		_, err := c.pool.Exec(ctx, ddl)
		require.NoError(t, err)
	}

	c.b = broker.New(rabbitURL, broker.Options{ReconnectMin: 50 * time.Millisecond, ReconnectMax: time.Second})
	top := broker.Topology{Delays: []time.Duration{250 * time.Millisecond, time.Second}}
	for _, q := range []string{c.orders, c.shipments} {
		require.NoError(t, c.b.Declare(ctx, q, top))
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, q := range []string{c.orders, c.shipments} {
			assert.NoError(t, c.b.Delete(ctx, q, top), "deleting %s", q)
		}
		c.b.Close()
	})
	uri, err := amqp.ParseURI(rabbitURL)
	require.NoError(t, err)
	px := startProxy(t, fmt.Sprintf("%s:%d", uri.Host, uri.Port))
	host, port, _ := strings.Cut(px.addr, ":")
	uri.Host = host
	uri.Port, _ = strconv.Atoi(port)
	c.amqpURL = uri.String()
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, p := range c.procs {
			b, _ := os.ReadFile(p.logPath)
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			t.Logf("--- log of %s (last lines) ---\n%s", p.name, strings.Join(lines[max(0, len(lines)-20):], "\n"))
		}
	})

	slots := []string{"a", "b", "relay1", "relay2"}
	for _, s := range slots {
		c.start(s)
	}
	began := time.Now()
	rng := rand.New(rand.NewPCG(seed(t), 17))
	for i := range orders + dups {
		n := i
		if i >= orders {
			n = rng.IntN(orders) // a copy of an earlier order
		}
		order := fmt.Sprintf("order-%d", n)
		require.NoError(t, c.b.Publish(ctx, "", c.orders, amqp.Publishing{MessageId: order, Body: []byte(order)}))
	}
	t.Logf("published %d orders (%d of them twice) in %v", orders, dups, time.Since(began).Round(time.Millisecond))

	// Faults, spread over the progress of B's effects: kills of a random
	// process, connection cuts, one PostgreSQL restart at the middle.
	type fault struct {
		at   int // B's distinct effects
		what string
	}
	var faults []fault
	for i := range kills {
		faults = append(faults, fault{orders * (i + 1) / (kills + 2), "kill"})
	}
	for i := range cuts {
		faults = append(faults, fault{orders*(2*i+1)/(2*cuts+1) + 7, "cut"})
	}
	faults = append(faults, fault{orders / 2, "postgres"})
	slices.SortStableFunc(faults, func(x, y fault) int { return cmp.Compare(x.at, y.at) })
	killed := map[string]int{}
	distinctB := `SELECT count(DISTINCT order_id) FROM chain_b_effects`
	for _, f := range faults {
		for c.count(ctx, distinctB) < f.at {
			if ctx.Err() != nil {
				t.Fatalf("stalled before the %s at %d shipments: %d done", f.what, f.at, c.count(context.Background(), distinctB))
			}
			time.Sleep(20 * time.Millisecond) // B's progress, in the database
		}
		time.Sleep(time.Duration(rng.IntN(50)) * time.Millisecond)
		switch f.what {
		case "kill":
			slot := slots[rng.IntN(len(slots))]
			name := c.kill(slot)
			killed[strings.TrimRight(slot, "0123456789")]++
			c.start(slot)
			t.Logf("SIGKILL %s at %d shipments", name, f.at)
		case "cut":
			px.partition()
			time.Sleep(time.Second)
			px.heal()
			t.Logf("RabbitMQ connections cut for 1s at %d shipments", f.at)
		case "postgres":
			require.NoError(t, db.stop())
			time.Sleep(2 * time.Second)
			require.NoError(t, db.start())
			t.Logf("PostgreSQL stopped (immediate) for 2s and restarted at %d shipments", f.at)
		}
	}

	// Wait until every order has its shipment, and the outbox and the
	// queues are empty; then a while longer, for a late copy to show.
	for {
		done := c.count(ctx, distinctB) == orders &&
			c.count(ctx, `SELECT count(*) FROM chain_outbox WHERE state = 'pending'`) == 0
		if done {
			n1, _ := c.b.Len(ctx, c.orders)
			n2, _ := c.b.Len(ctx, c.shipments)
			done = n1 == 0 && n2 == 0
		}
		if done {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("not finished: %d of %d orders shipped", c.count(context.Background(), distinctB), orders)
		}
		time.Sleep(50 * time.Millisecond) // the processes' progress
	}
	time.Sleep(3 * time.Second) // a copy still on its way (a lease, a delay queue) would arrive by now
	for _, s := range slots {
		c.mu.Lock()
		p := c.procs[s]
		c.mu.Unlock()
		p.cmd.Process.Signal(os.Interrupt)
		if !p.wait(10 * time.Second) {
			t.Errorf("%s did not stop within 10s of SIGINT", p.name)
		}
	}
	took := time.Since(began)

	// The verdict.
	perOrder := func(table string) map[string]int {
		rows, err := c.pool.Query(context.Background(), `SELECT order_id, count(*) FROM `+table+` GROUP BY order_id`)
		require.NoError(t, err)
		defer rows.Close()
		m := map[string]int{}
		for rows.Next() {
			var id string
			var n int
			require.NoError(t, rows.Scan(&id, &n))
			m[id] = n
		}
		return m
	}
	a, b := perOrder("chain_a_effects"), perOrder("chain_b_effects")
	var once, twice, lost int
	for i := range orders {
		id := fmt.Sprintf("order-%d", i)
		switch {
		case b[id] == 0:
			lost++
			t.Errorf("%s: no shipment effect in B", id)
		case b[id] > 1:
			twice++
			t.Errorf("%s: %d shipment effects in B; want 1", id, b[id])
		default:
			once++
		}
		if a[id] != 1 {
			t.Errorf("%s: %d effects in A; want 1", id, a[id])
		}
	}
	rolledBack := c.count(context.Background(), `SELECT count(*) FROM chain_rolled_back`)
	leaked := c.count(context.Background(), `SELECT count(*) FROM chain_b_effects e JOIN chain_rolled_back r USING (message_id)`)
	if leaked != 0 {
		t.Errorf("%d shipments of rolled-back transactions reached B; want 0", leaked)
	}
	if rolledBack < orders/20 {
		t.Errorf("%d transactions rolled back after their outbox write; want about %d", rolledBack, orders/10)
	}
	stats, err := ob.Stats(context.Background())
	require.NoError(t, err)
	if stats.Parked != 0 || stats.Pending != 0 {
		t.Errorf("outbox: %+v; want nothing pending or parked", stats)
	}
	sends := c.count(context.Background(), `SELECT count(*) FROM chain_outbox`)
	resent := c.count(context.Background(), `SELECT count(*) FROM chain_outbox WHERE attempts > 0`)
	copies := c.count(context.Background(), `SELECT count(*) - count(DISTINCT message_id) FROM chain_b_deliveries`)
	var dead int
	for _, q := range []string{c.orders, c.shipments} {
		n, err := c.b.Len(context.Background(), q+".dlq")
		require.NoError(t, err)
		dead += n
	}
	if dead != 0 {
		t.Errorf("%d messages dead-lettered; want none", dead)
	}
	for _, p := range c.procs {
		b, _ := os.ReadFile(p.logPath)
		if strings.Contains(string(b), "DATA RACE") || strings.Contains(string(b), "panic: ") {
			t.Errorf("%s's log shows a data race or a panic", p.name)
		}
	}
	t.Logf("took %v; kills %v; %d rolled back after the outbox write; outbox rows %d (%d with a failed send); %d copies delivered to B and absorbed; %+v", took.Round(time.Millisecond), killed, rolledBack, sends, resent, copies, stats)
	record(t, row{
		Scenario:     "17 outbox chain: A (inbox + outbox) → relay → B (inbox)",
		Messages:     orders + dups,
		Duplicates:   dups,
		Faults:       fmt.Sprintf("%d × SIGKILL of A, B or one of 2 relays (A %d, B %d, relays %d) + restart; %d × RabbitMQ connections cut 1s; PostgreSQL restarted once", kills, killed["a"], killed["b"], killed["relay"], cuts),
		Once:         once,
		Twice:        twice,
		Lost:         lost,
		DeadLettered: dead,
		Note:         fmt.Sprintf("counted in B; %d orders failed after their outbox write (rolled back): %d of their messages reached B; %d copies (relay resends, redeliveries) reached B and were absorbed by its Dedup; took %v", rolledBack, leaked, copies, took.Round(time.Second)),
	})
}
