package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
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

// postgresGroupName is rabbitmw-postgres with group commit
// (pgstore.HandlerOptions.GroupCommit at its most, 32): deliveries that
// outnumber the groups (an eighth of the pool's connections) share their
// transactions, and commits.
const postgresGroupName = "rabbitmw-postgres-group"

// pgStoreName is the PostgreSQL store alone, as rabbitmw-redis is the Redis
// store: broker.Consume and the recommended stack over pgstore, the
// business recording in memory that it ran. Its figures are those of the
// store's claim and complete, to set beside the Redis store's.
const pgStoreName = "rabbitmw-pgstore"

// handPgName is the hand-written one-transaction inbox that the PostgreSQL
// inbox replaces: BEGIN; INSERT INTO inbox ... ON CONFLICT DO NOTHING (no
// row: a duplicate, rolled back and acked); the effect, the same row as
// rabbitmw-postgres's; COMMIT; ack. A failure nacks with requeue.
const handPgName = "hand-written-pg"

// pgRun is one run's database: a pool, the store on tables of the run's
// own, the effects table and the hand-written inbox's table.
type pgRun struct {
	app     string // the pool's application_name
	pids    []int  // the server's processes that serve it, for their CPU
	pool    *pgxpool.Pool
	st      *pgstore.Store
	effects string
	inbox   string
}

// newPgRun makes the run's tables, named after its key prefix, and a pool
// of conns connections, warmed up.
func newPgRun(ctx context.Context, url, prefix string, conns int) (*pgRun, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("-postgres: %w", err)
	}
	sum := sha256.Sum256([]byte(prefix))
	table := "rmwbench_" + hex.EncodeToString(sum[:8])
	r := &pgRun{app: table}
	cfg.ConnConfig.RuntimeParams["application_name"] = r.app
	cfg.MaxConns, cfg.MinConns = int32(conns+2), int32(conns+2)
	if r.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	r.effects, r.inbox = table+"_effects", table+"_inbox"
	r.st = pgstore.New(r.pool, pgstore.Options{Table: table})
	if err := r.st.Migrate(ctx); err != nil {
		r.close()
		return nil, fmt.Errorf("PostgreSQL at %s: %w (start it, or set -postgres / DATABASE_URL)", url, err)
	}
	if _, err := r.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+r.effects+` (id text NOT NULL);
		CREATE TABLE IF NOT EXISTS `+r.inbox+` (id text PRIMARY KEY)`); err != nil {
		r.close()
		return nil, err
	}
	// Warm every connection: the statements are prepared per connection,
	// once; that is not what is measured.
	var wg sync.WaitGroup
	for range conns + 2 {
		wg.Go(func() {
			r.st.Claim(ctx, "warm-up", "warm-up", time.Millisecond)
			r.pool.Exec(ctx, `SELECT 1 FROM `+r.inbox+` WHERE id = $1`, "warm-up")
		})
	}
	wg.Wait()
	if r.pids, err = r.serverPIDs(ctx); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// close drops the run's tables and closes its pool.
func (r *pgRun) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r.st.Close()
	table := strings.TrimSuffix(r.effects, "_effects")
	r.pool.Exec(ctx, `DROP TABLE IF EXISTS `+table+`, `+table+`_failures, `+r.effects+`, `+r.inbox)
	r.pool.Close()
}

// consumePostgres consumes queue with broker.Consume, the recommended
// stack over the run's store and the transactional handler, set by ho.
func consumePostgres(ctx context.Context, url, queue string, opts broker.ConsumeOptions, pg *pgRun, ho pgstore.HandlerOptions, cnt *counter) error {
	insert := `INSERT INTO ` + pg.effects + ` (id) VALUES ($1)`
	business := pgstore.Handler(pg.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		if _, err := tx.Exec(ctx, insert, d.MessageId); err != nil {
			return err
		}
		cnt.effect(d.MessageId)
		return nil
	}, ho)
	return consumeStack(ctx, url, queue, opts, benchstack.Recommended(pg.st), business, cnt)
}

// handInbox returns the hand-written one-transaction inbox (handPgName).
func handInbox(pg *pgRun, cnt *counter) func(context.Context, *amqp.Delivery) rabbitmw.Outcome {
	claim := `INSERT INTO ` + pg.inbox + ` (id) VALUES ($1) ON CONFLICT DO NOTHING`
	insert := `INSERT INTO ` + pg.effects + ` (id) VALUES ($1)`
	return func(ctx context.Context, d *amqp.Delivery) rabbitmw.Outcome {
		tx, err := pg.pool.Begin(ctx)
		if err != nil {
			return rabbitmw.Requeue
		}
		defer tx.Rollback(ctx)
		tag, err := tx.Exec(ctx, claim, d.MessageId)
		switch {
		case err != nil:
			return rabbitmw.Requeue
		case tag.RowsAffected() == 0:
			return rabbitmw.Duplicate
		}
		if _, err := tx.Exec(ctx, insert, d.MessageId); err != nil {
			return rabbitmw.Requeue
		}
		cnt.effect(d.MessageId)
		if tx.Commit(ctx) != nil {
			return rabbitmw.Requeue
		}
		return rabbitmw.Ack
	}
}

// serverPIDs returns the PostgreSQL processes that serve the run: the
// backends of its own pool (by their application_name) and the server's
// auxiliary processes (the WAL writer, the checkpointer, the background
// writer, autovacuum), children of the postmaster that work for every
// client, the run's commits included. Other clients' backends are left
// out. It returns nil if the server is not on this machine.
func (r *pgRun) serverPIDs(ctx context.Context) ([]int, error) {
	rows, err := r.pool.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = $1 OR backend_type <> 'client backend' ORDER BY pid`, r.app)
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL: the run's backends: %w", err)
	}
	pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL: the run's backends: %w", err)
	}
	var local []int
	for _, pid := range pids {
		if procCPU(int(pid)) >= 0 {
			local = append(local, int(pid))
		}
	}
	if len(local) < len(pids) {
		return nil, nil // another machine's, or another PID namespace's
	}
	return local, nil
}

// processesCPU returns the CPU time of pids together, or -1 if there are
// none. A process that ended since is left out: the run's pool and the
// auxiliary processes live through the run.
func processesCPU(pids []int) time.Duration {
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
