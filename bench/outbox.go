package main

// -outbox: the cost of the transactional outbox (pgstore.Outbox and its
// relay) against publishing directly with confirms, in the same run.
//
// Throughput, for each round: "direct" publishes -n messages with
// broker.Publish from 100 goroutines at once (confirms, mandatory, as the
// relay does, with as many in flight as one relay's batch); "relay" first
// writes -n rows into an outbox (in transactions of 100, not timed), then
// starts one relay (store/pgstore/relay, its defaults: batches of 100) and
// times it from its start to its last confirm. Both report messages per
// second and CPU per 1,000 messages: this process, RabbitMQ, and for the
// relay the PostgreSQL processes that serve it.
//
// Latency: one writer commits a message per transaction at -rate, 500 of
// them, while the relay runs and a plain consumer reads the queue; the
// latency of a message is from the return of its commit to its delivery
// to the consumer. Once with NOTIFY (the relay's default) and once with
// the poll alone, both at the relay's default poll interval.

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/pgstore/relay"
)

// outboxInFlight is how many publishes the direct contender keeps in
// flight: the relay's default batch.
const outboxInFlight = 100

type outboxRun struct {
	Name      string   `json:"name"`
	Round     int      `json:"round"`
	Messages  int      `json:"messages"`
	Seconds   float64  `json:"seconds"`
	PerSecond float64  `json:"msgs_per_s"`
	CPU       cpuUsage `json:"cpu"`
}

type outboxLatency struct {
	Mode     string  `json:"mode"`
	Messages int     `json:"messages"`
	P50ms    float64 `json:"p50_ms"`
	P99ms    float64 `json:"p99_ms"`
	Maxms    float64 `json:"max_ms"`
}

type outboxResult struct {
	Machine   machine         `json:"machine"`
	Runs      []outboxRun     `json:"runs"`
	Ratio     float64         `json:"relay_to_direct"`
	Latencies []outboxLatency `json:"latencies"`
}

// outboxEnv is the run's pool (its connections named, for their CPU) and
// outbox table.
type outboxEnv struct {
	*env
	pool *pgxpool.Pool
	pg   *pgRun // for serverPIDs
	body []byte
}

func runOutbox(ctx context.Context, e *env, cfg config) error {
	pcfg, err := pgxpool.ParseConfig(cfg.postgresURL)
	if err != nil {
		return fmt.Errorf("-postgres: %w", err)
	}
	sum := sha256.Sum256([]byte(e.runID))
	app := "rmwbench_ob_" + hex.EncodeToString(sum[:6])
	pcfg.ConnConfig.RuntimeParams["application_name"] = app
	pcfg.MaxConns, pcfg.MinConns = 8, 4
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	oe := &outboxEnv{env: e, pool: pool, pg: &pgRun{pool: pool, app: app}, body: make([]byte, cfg.size)}
	for i := range oe.body {
		oe.body[i] = 'a' + byte(i%26)
	}
	res := outboxResult{Machine: e.machine}
	var direct, relayed []float64
	for round := 1; round <= cfg.rounds; round++ {
		for _, name := range inRoundOrder([]string{"direct", "relay"}, round) {
			var r outboxRun
			if name == "direct" {
				r, err = oe.direct(ctx, cfg.n)
			} else {
				r, err = oe.relay(ctx, cfg.n)
			}
			if err != nil {
				return fmt.Errorf("%s, round %d: %w", name, round, err)
			}
			r.Round = round
			fmt.Fprintf(os.Stderr, "outbox %-6s round %d: %s msgs/s\n", name, round, thousands(r.PerSecond))
			res.Runs = append(res.Runs, r)
			if name == "direct" {
				direct = append(direct, r.PerSecond)
			} else {
				relayed = append(relayed, r.PerSecond)
			}
		}
	}
	slices.Sort(direct)
	slices.Sort(relayed)
	res.Ratio = median(relayed) / median(direct)
	for _, notify := range []bool{true, false} {
		l, err := oe.latency(ctx, notify, 500, cfg.rate)
		if err != nil {
			return fmt.Errorf("latency: %w", err)
		}
		res.Latencies = append(res.Latencies, l)
	}
	res.print(os.Stdout)
	return writeJSON(cfg.jsonPath, res)
}

func (r outboxResult) print(w io.Writer) {
	fmt.Fprintln(w, "\noutbox: the relay against publishing directly with confirms (medians of the rounds)")
	fmt.Fprintln(w, "| contender | msgs/s | bench CPU ms/1k | RabbitMQ CPU ms/1k | PostgreSQL CPU ms/1k |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: |")
	for _, name := range []string{"direct", "relay"} {
		var rate, self, rabbit, pg []float64
		for _, run := range r.Runs {
			if run.Name == name {
				rate = append(rate, run.PerSecond)
				self = append(self, run.CPU.Self)
				rabbit = append(rabbit, run.CPU.Rabbit)
				pg = append(pg, run.CPU.Postgres)
			}
		}
		for _, s := range [][]float64{rate, self, rabbit, pg} {
			slices.Sort(s)
		}
		pgText := "—"
		if name == "relay" && median(pg) >= 0 {
			pgText = fmt.Sprintf("%.0f", median(pg))
		}
		fmt.Fprintf(w, "| %s | %s | %.0f | %.0f | %s |\n", name, thousands(median(rate)), median(self), median(rabbit), pgText)
	}
	verdict := "met"
	if r.Ratio < 0.8 {
		verdict = "missed"
	}
	fmt.Fprintf(w, "relay / direct: %.2f× (target ≥ 0.8×: %s)\n", r.Ratio, verdict)
	fmt.Fprintln(w, "\ncommit-to-delivery latency, one message per transaction")
	fmt.Fprintln(w, "| wake-up | messages | p50 | p99 | max |")
	fmt.Fprintln(w, "| --- | ---: | ---: | ---: | ---: |")
	for _, l := range r.Latencies {
		fmt.Fprintf(w, "| %s | %d | %.1f ms | %.1f ms | %.1f ms |\n", l.Mode, l.Messages, l.P50ms, l.P99ms, l.Maxms)
	}
}

// newOutbox makes an outbox table of its own, and returns it and the
// function that drops it.
func (oe *outboxEnv) newOutbox(ctx context.Context, name string) (*pgstore.Outbox, func(), error) {
	sum := sha256.Sum256([]byte(oe.runID + name))
	table := "rmwbench_outbox_" + hex.EncodeToString(sum[:6])
	ob := pgstore.NewOutbox(oe.pool, pgstore.OutboxOptions{Table: table})
	if err := ob.Migrate(ctx); err != nil {
		return nil, nil, fmt.Errorf("PostgreSQL at %s: %w (start it, or set -postgres / DATABASE_URL)", oe.cfg.postgresURL, err)
	}
	return ob, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		oe.pool.Exec(ctx, `DROP TABLE IF EXISTS `+table)
	}, nil
}

func (oe *outboxEnv) queue(ctx context.Context, name string) (string, func(), error) {
	q := oe.runID + "-outbox-" + name
	if err := oe.admin.Declare(ctx, q, topology); err != nil {
		return "", nil, err
	}
	return q, func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		oe.admin.Delete(ctx, q, topology)
	}, nil
}

func (oe *outboxEnv) direct(ctx context.Context, n int) (outboxRun, error) {
	q, drop, err := oe.queue(ctx, "direct")
	if err != nil {
		return outboxRun{}, err
	}
	defer drop()
	b := broker.New(oe.cfg.amqpURL, broker.Options{})
	defer b.Close()
	if err := b.Publish(ctx, "", q, amqp.Publishing{Body: oe.body}); err != nil { // connect, not timed
		return outboxRun{}, err
	}
	var next atomic.Int64
	next.Store(1)
	errs := make(chan error, outboxInFlight)
	before := oe.cpuTimes(ctx, nil)
	start := time.Now()
	var wg sync.WaitGroup
	for range outboxInFlight {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for next.Add(1) <= int64(n)+1 {
				if err := b.Publish(ctx, "", q, amqp.Publishing{ContentType: "application/octet-stream", Body: oe.body}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	took := time.Since(start)
	after := oe.cpuTimes(ctx, nil)
	close(errs)
	if err := <-errs; err != nil {
		return outboxRun{}, err
	}
	if got, err := oe.admin.Len(ctx, q); err != nil || got != n+1 {
		return outboxRun{}, fmt.Errorf("queue holds %d messages (%v); want %d", got, err, n+1)
	}
	return outboxRun{Name: "direct", Messages: n, Seconds: took.Seconds(), PerSecond: float64(n) / took.Seconds(), CPU: before.usage(after, int64(n))}, nil
}

func (oe *outboxEnv) relay(ctx context.Context, n int) (outboxRun, error) {
	q, drop, err := oe.queue(ctx, "relay")
	if err != nil {
		return outboxRun{}, err
	}
	defer drop()
	ob, dropTable, err := oe.newOutbox(ctx, "throughput")
	if err != nil {
		return outboxRun{}, err
	}
	defer dropTable()
	for i := 0; i < n; i += 100 {
		err := pgx.BeginFunc(ctx, oe.pool, func(tx pgx.Tx) error {
			for j := i; j < min(n, i+100); j++ {
				if _, err := ob.Write(ctx, tx, "", q, amqp.Publishing{ContentType: "application/octet-stream", Body: oe.body}); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return outboxRun{}, err
		}
	}
	b := broker.New(oe.cfg.amqpURL, broker.Options{})
	defer b.Close()
	if err := b.Publish(ctx, "", q+".dlq", amqp.Publishing{Body: oe.body}); err != nil { // connect, not timed
		return outboxRun{}, err
	}
	var sent atomic.Int64
	done := make(chan struct{})
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	r := relay.New(ob, b, relay.Options{Observer: relay.Observer{
		Dispatched: func(_ context.Context, s, parked, failed int) {
			if sent.Add(int64(s)) == int64(n) {
				close(done)
			}
		},
	}})
	pids, err := oe.pg.serverPIDs(ctx)
	if err != nil {
		return outboxRun{}, err
	}
	before := oe.cpuTimes(ctx, pids)
	start := time.Now()
	ran := make(chan error, 1)
	go func() { ran <- r.Run(rctx) }()
	select {
	case <-done:
	case err := <-ran:
		return outboxRun{}, fmt.Errorf("the relay ended: %v", err)
	case <-ctx.Done():
		return outboxRun{}, ctx.Err()
	}
	took := time.Since(start)
	after := oe.cpuTimes(ctx, pids)
	stop()
	<-ran
	if got, err := oe.admin.Len(ctx, q); err != nil || got != n {
		return outboxRun{}, fmt.Errorf("queue holds %d messages (%v); want %d", got, err, n)
	}
	return outboxRun{Name: "relay", Messages: n, Seconds: took.Seconds(), PerSecond: float64(n) / took.Seconds(), CPU: before.usage(after, int64(n))}, nil
}

// latency commits n messages, one per transaction, at rate a second, and
// measures each one's time from the commit's return to its delivery.
func (oe *outboxEnv) latency(ctx context.Context, notify bool, n, rate int) (outboxLatency, error) {
	mode := "NOTIFY"
	if !notify {
		mode = "poll alone"
	}
	q, drop, err := oe.queue(ctx, "latency")
	if err != nil {
		return outboxLatency{}, err
	}
	defer drop()
	ob, dropTable, err := oe.newOutbox(ctx, "latency-"+mode)
	if err != nil {
		return outboxLatency{}, err
	}
	defer dropTable()
	ch, err := oe.channel()
	if err != nil {
		return outboxLatency{}, err
	}
	defer ch.Close()
	deliveries, err := ch.Consume(q, "", true, false, false, false, nil)
	if err != nil {
		return outboxLatency{}, err
	}
	b := broker.New(oe.cfg.amqpURL, broker.Options{})
	defer b.Close()
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	ran := make(chan error, 1)
	go func() { ran <- relay.New(ob, b, relay.Options{NoListen: !notify}).Run(rctx) }()
	defer func() { stop(); <-ran }()

	var mu sync.Mutex
	committed := make(map[string]time.Time, n)
	var lat []int64
	got := make(chan struct{})
	go func() {
		defer close(got)
		for d := range deliveries {
			at := time.Now()
			mu.Lock()
			if c, ok := committed[d.MessageId]; ok {
				lat = append(lat, int64(at.Sub(c)))
			}
			done := len(lat) == n
			mu.Unlock()
			if done {
				return
			}
		}
	}()
	tick := time.NewTicker(time.Second / time.Duration(rate))
	defer tick.Stop()
	for range n {
		<-tick.C
		tx, err := oe.pool.Begin(ctx)
		if err != nil {
			return outboxLatency{}, err
		}
		id, err := ob.Write(ctx, tx, "", q, amqp.Publishing{Body: oe.body})
		if err != nil {
			tx.Rollback(ctx)
			return outboxLatency{}, err
		}
		mu.Lock() // held across the commit: the delivery may come before Commit returns
		if err := tx.Commit(ctx); err != nil {
			mu.Unlock()
			return outboxLatency{}, err
		}
		committed[id] = time.Now()
		mu.Unlock()
	}
	select {
	case <-got:
	case <-time.After(30 * time.Second):
		return outboxLatency{}, fmt.Errorf("%s: %d of %d messages delivered after 30 s", mode, len(lat), n)
	}
	slices.Sort(lat)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	return outboxLatency{Mode: mode, Messages: n, P50ms: ms(percentile(lat, 50)), P99ms: ms(percentile(lat, 99)), Maxms: ms(time.Duration(lat[len(lat)-1]))}, nil
}
