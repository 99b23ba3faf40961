package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// inbox is the PostgreSQL inbox of one run: the store on tables of the
// run's own, and the effects table beside them, all dropped at the end.
type inbox struct {
	pool    *pgxpool.Pool
	st      *pgstore.Store
	table   string
	effects string
}

func openInbox(ctx context.Context, url, table string) (*inbox, error) {
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("-postgres: %w", err)
	}
	in := &inbox{pool: pool, st: pgstore.New(pool, pgstore.Options{Table: table}), table: table, effects: table + "_effects"}
	if err := in.st.Migrate(ctx); err != nil { // fails fast if the database does not answer
		in.close()
		return nil, err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE `+in.effects+` (id text NOT NULL)`); err != nil {
		in.close()
		return nil, err
	}
	return in, nil
}

func (in *inbox) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	in.st.Close()
	in.pool.Exec(ctx, `DROP TABLE IF EXISTS `+in.table+`, `+in.table+`_failures, `+in.effects)
	in.pool.Close()
}

// handler is the business over the inbox: the scenario's behaviour, then
// the effect as a row in the transaction that commits the done mark. The
// report counts the effect once the commit succeeded.
func (in *inbox) handler(b *business) rabbitmw.Handler {
	insert := `INSERT INTO ` + in.effects + ` (id) VALUES ($1)`
	h := pgstore.Handler(in.st, func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
		key, err := middleware.Key(d)
		if err != nil {
			return rabbitmw.Permanent(err)
		}
		if err := b.decide(ctx, key, d); err != nil {
			return err
		}
		_, err = tx.Exec(ctx, insert, key)
		return err
	}, pgstore.HandlerOptions{RetryDelay: 200 * time.Millisecond})
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		err := h.Handle(ctx, d)
		if err == nil {
			if key, kerr := middleware.Key(d); kerr == nil {
				b.effect(key)
			}
		}
		return err
	})
}
