package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/benchstack"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// postgresName is the PostgreSQL inbox: broker.Consume, the recommended
// stack over pgstore, and pgstore.Handler, whose transaction commits the
// done mark with the effect. The effect is a row inserted in that
// transaction, as a real inbox's would be, so the figures include what
// the business pays for its own write, and nothing a real consumer would
// not pay.
const postgresName = "rabbitmw-postgres"

// pgRoundTrips is a pgx tracer that counts the statements a pool sends,
// each one round trip (BEGIN and COMMIT included; pgx prepares a statement
// once per connection, on the pool's warm-up). A statement made under a
// context that carries a delivery's probe is also counted on the probe.
type pgRoundTrips struct{ n atomic.Int64 }

func (r *pgRoundTrips) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	r.n.Add(1)
	onProbe(ctx)
	return ctx
}

func (r *pgRoundTrips) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// pgRun is one run's database: a pool that counts its round trips, the
// store on tables of the run's own, and the effects table.
type pgRun struct {
	pool    *pgxpool.Pool
	st      *pgstore.Store
	rt      *pgRoundTrips
	effects string
}

// newPgRun makes the run's tables, named after its key prefix, and a pool
// of conns connections, warmed up.
func (e *env) newPgRun(ctx context.Context, prefix string, conns int) (*pgRun, error) {
	cfg, err := pgxpool.ParseConfig(e.cfg.postgresURL)
	if err != nil {
		return nil, fmt.Errorf("-postgres: %w", err)
	}
	r := &pgRun{rt: new(pgRoundTrips)}
	cfg.ConnConfig.Tracer = r.rt
	cfg.MaxConns, cfg.MinConns = int32(conns+2), int32(conns+2)
	if r.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(prefix))
	table := "rmwbench_" + hex.EncodeToString(sum[:8])
	r.effects = table + "_effects"
	r.st = pgstore.New(r.pool, pgstore.Options{Table: table})
	if err := r.st.Migrate(ctx); err != nil {
		r.close()
		return nil, fmt.Errorf("PostgreSQL at %s: %w (start it, or set -postgres / DATABASE_URL)", e.cfg.postgresURL, err)
	}
	if _, err := r.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+r.effects+` (id text NOT NULL)`); err != nil {
		r.close()
		return nil, err
	}
	// Warm every connection: the statements of the store are prepared
	// per connection, once; that is not what is measured.
	for range 2 {
		for i := 0; i < conns+2; i++ {
			r.st.Claim(ctx, "warm-up", "warm-up", time.Millisecond)
		}
	}
	return r, nil
}

// close drops the run's tables and closes its pool.
func (r *pgRun) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r.st.Close()
	table := strings.TrimSuffix(r.effects, "_effects")
	r.pool.Exec(ctx, `DROP TABLE IF EXISTS `+table+`, `+table+`_failures, `+r.effects)
	r.pool.Close()
}

// consumePostgres consumes queue with broker.Consume, the recommended
// stack over the run's store and the transactional handler.
func consumePostgres(ctx context.Context, url, queue string, opts broker.ConsumeOptions, pg *pgRun, rec *recorder) error {
	insert := `INSERT INTO ` + pg.effects + ` (id) VALUES ($1)`
	business := pgstore.Handler(pg.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if _, err := tx.Exec(ctx, insert, d.MessageId); err != nil {
			return err
		}
		rec.effect(d.MessageId)
		return nil
	}, pgstore.HandlerOptions{})
	return consumeStack(ctx, url, queue, opts, benchstack.Recommended(pg.st), business, true, rec)
}

// postgresPIDs returns the processes of the PostgreSQL server on this
// machine (command name postgres): the postmaster and its backends.
func postgresPIDs() []int {
	var pids []int
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		comm, err := os.ReadFile(filepath.Join(d, "comm"))
		if err != nil || strings.TrimSpace(string(comm)) != "postgres" {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(d)); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// postgresCPU returns the CPU time of the PostgreSQL server's processes,
// or -1 if it runs elsewhere. It sums the live processes: a backend that
// ends during a run takes its share with it, which the bench's pools,
// open for the whole run, do not.
func postgresCPU() time.Duration {
	pids := postgresPIDs()
	if len(pids) == 0 {
		return -1
	}
	var sum time.Duration
	for _, pid := range pids {
		if t := procCPU(pid); t > 0 {
			sum += t
		}
	}
	return sum
}
