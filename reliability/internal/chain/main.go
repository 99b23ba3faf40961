// Command chain is one process of the reliability suite's outbox chain:
// service A, service B, or a relay, all over one PostgreSQL database.
//
//	-role a      consumes -orders with the PostgreSQL inbox (store table
//	             <-prefix>_a); in the inbox's transaction it inserts the
//	             order into <-prefix>_a_effects and writes a shipment
//	             message for -shipments into the outbox <-prefix>_outbox.
//	             For one order in ten (see failing) its first attempt fails
//	             after the write, so that the transaction rolls back: it
//	             first records the message id it wrote in
//	             <-prefix>_rolled_back, outside the transaction.
//	-role b      consumes -shipments with the inbox (store table
//	             <-prefix>_b) and inserts (order, message id, process) into
//	             <-prefix>_b_effects in the inbox's transaction; it records
//	             every delivery's message id in <-prefix>_b_deliveries
//	             first, outside any transaction.
//	-role relay  relays the outbox to RabbitMQ.
//
// The suite makes the tables, starts the processes, kills them (SIGKILL),
// and cuts their connections. On SIGTERM a process stops gracefully and
// exits 0. Logs (Warn and above) go to standard error.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/pgstore/relay"
)

type config struct {
	role, name, amqpURL, pgURL, prefix, orders, shipments string
	delays                                                []time.Duration
}

func main() {
	var c config
	var delays string
	fs := flag.NewFlagSet("chain", flag.ExitOnError)
	fs.StringVar(&c.role, "role", "", "a, b or relay")
	fs.StringVar(&c.name, "name", "", "this process's name, recorded with its effects")
	fs.StringVar(&c.amqpURL, "amqp", "", "RabbitMQ URL")
	fs.StringVar(&c.pgURL, "pg", "", "PostgreSQL URL")
	fs.StringVar(&c.prefix, "prefix", "", "prefix of the tables")
	fs.StringVar(&c.orders, "orders", "", "A's queue")
	fs.StringVar(&c.shipments, "shipments", "", "B's queue")
	fs.StringVar(&delays, "delays", "250ms,1s", "delay queues of both queues")
	fs.Parse(os.Args[1:])
	for _, s := range strings.Split(delays, ",") {
		d, err := time.ParseDuration(s)
		if err != nil {
			fmt.Fprintln(os.Stderr, "chain: -delays:", err)
			os.Exit(2)
		}
		c.delays = append(c.delays, d)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := run(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "chain:", err)
		os.Exit(1)
	}
}

// failing reports whether the first attempt of order fails after its
// outbox write: one order in ten.
func failing(order string) bool {
	h := fnv.New32a()
	h.Write([]byte(order))
	return h.Sum32()%10 == 0
}

func run(ctx context.Context, c config) error {
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With(slog.String("process", c.name))
	pool, err := pgxpool.New(ctx, c.pgURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	b := broker.New(c.amqpURL, broker.Options{Logger: logger, ReconnectMin: 50 * time.Millisecond, ReconnectMax: time.Second, Process: c.name})
	defer b.Close()
	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: c.prefix + "_outbox"})

	if c.role == "relay" {
		return relay.New(ob, b, relay.Options{
			Logger: logger, BatchSize: 50, PollInterval: 200 * time.Millisecond,
			PublishTimeout: 5 * time.Second, StopTimeout: 2 * time.Second,
			BackoffMin: 20 * time.Millisecond, BackoffMax: time.Second,
		}).Run(ctx)
	}

	var table, queue string
	var fn pgstore.TxFunc
	switch c.role {
	case "a":
		table, queue = c.prefix+"_a", c.orders
		fn = func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
			order := string(d.Body)
			if _, err := tx.Exec(ctx, `INSERT INTO `+c.prefix+`_a_effects (order_id, process) VALUES ($1, $2)`, order, c.name); err != nil {
				return err
			}
			id, err := ob.Write(ctx, tx, "", c.shipments, amqp.Publishing{ContentType: "text/plain", Body: d.Body})
			if err != nil {
				return err
			}
			if !failing(order) {
				return nil
			}
			var done bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM `+c.prefix+`_rolled_back WHERE order_id = $1)`, order).Scan(&done); err != nil || done {
				return err
			}
			if _, err := pool.Exec(ctx, `INSERT INTO `+c.prefix+`_rolled_back (order_id, message_id) VALUES ($1, $2)`, order, id); err != nil {
				return err
			}
			return errors.New("chain: the business fails after its outbox write, and its transaction rolls back")
		}
	case "b":
		table, queue = c.prefix+"_b", c.shipments
		fn = func(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+c.prefix+`_b_effects (order_id, message_id, process) VALUES ($1, $2, $3)`, string(d.Body), d.MessageId, c.name)
			return err
		}
	default:
		return fmt.Errorf("unknown role %q", c.role)
	}
	st := pgstore.New(pool, pgstore.Options{Table: table})
	defer st.Close()
	// B records each delivery, before Dedup, so that the suite can count
	// the copies Dedup absorbed (the relay's resends, RabbitMQ's
	// redeliveries). Best effort: a delivery during the database's outage
	// is not recorded.
	record := func(next rabbitmw.Handler) rabbitmw.Handler {
		if c.role != "b" {
			return next
		}
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			pool.Exec(ctx, `INSERT INTO `+c.prefix+`_b_deliveries (message_id) VALUES ($1)`, d.MessageId)
			return next.Handle(ctx, d)
		})
	}
	h := rabbitmw.Chain(
		record,
		middleware.Log(logger),
		middleware.Retry(st, middleware.RetryOptions{MaxAttempts: 100, Backoff: middleware.Exponential(250*time.Millisecond, time.Second)}),
		middleware.Recover(),
		middleware.Dedup(st, middleware.DedupOptions{Lease: 2 * time.Second, BusyDelay: 250 * time.Millisecond, UnavailableDelay: 250 * time.Millisecond}),
		middleware.Timeout(1500*time.Millisecond),
	)(pgstore.Handler(st, fn, pgstore.HandlerOptions{RetryDelay: 250 * time.Millisecond}))
	return b.Consume(ctx, queue, h, broker.ConsumeOptions{Workers: 8, Topology: broker.Topology{Delays: c.delays}, ShutdownTimeout: 3 * time.Second})
}
