// Command example shows every guarantee of rabbitmw in one run: it
// publishes a set of scenarios (ordinary messages, duplicates, a redelivery
// of a message already done, a message that fails until its cause is
// fixed, a handler that panics once, a message without a message_id, a
// handler slower than its lease, two consumers racing on duplicates),
// consumes them to the end with the recommended stack, then, as an
// operator would, fixes the cause of the failing message and replays it
// from the dead-letter queue. It prints what happened to each message, and
// exits 0 only if every business effect happened exactly once and the
// failing message reached the dead-letter queue with its fault headers
// before its replay succeeded.
//
// With no flags it needs no servers: it runs on the in-memory broker and an
// embedded Redis (miniredis). With -amqp and -redis it runs the same
// scenarios against real servers:
//
//	go run ./example
//	go run ./example -amqp amqp://guest:guest@127.0.0.1:5672/ -redis 127.0.0.1:6379
//
// With -postgres URL it runs the scenarios a second time over the
// PostgreSQL inbox (store/pgstore) in that database: each effect is a row
// inserted in the transaction that commits the message's done mark. Then
// it runs a chain of two services: A consumes orders with the inbox and,
// in the same transaction, writes a shipment request into the outbox
// (pgstore.Outbox); a relay (store/pgstore/relay) sends it; B consumes the
// shipments with an inbox of its own. Each order must take effect once in
// A and once in B, and a message written by a transaction that rolled
// back must never leave.
//
//	go run ./example -postgres postgres://postgres@127.0.0.1:5432/test
//
// RABBITMQ_URL and REDIS_ADDR stand for the flags. -v prints the log
// records of the stack and the broker.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

func main() {
	var cfg config
	flag.StringVar(&cfg.amqpURL, "amqp", os.Getenv("RABBITMQ_URL"), "AMQP URL of a RabbitMQ server (default: the in-memory broker)")
	flag.StringVar(&cfg.redisAddr, "redis", os.Getenv("REDIS_ADDR"), "address of a Redis server (default: an embedded miniredis)")
	flag.StringVar(&cfg.postgresURL, "postgres", "", "URL of a PostgreSQL database: run the scenarios a second time over the PostgreSQL inbox there")
	flag.DurationVar(&cfg.timeout, "timeout", time.Minute, "how long the scenarios may take")
	verbose := flag.Bool("v", false, "print the log records of the stack and the broker")
	flag.BoolVar(&cfg.trace, "trace", false, "trace the run with OpenTelemetry and print each message's trace as a tree")
	metrics := flag.String("metrics", "", "serve the run's OpenTelemetry metrics to Prometheus at http://`ADDR`/metrics, until interrupted")
	flag.Parse()

	cfg.logger = slog.New(slog.DiscardHandler)
	if *verbose {
		cfg.logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	redis.SetLogger(redisstore.Logging(cfg.logger)) // go-redis's own lines, through the same logger
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	var err error
	if cfg.metrics, err = listenMetrics(*metrics); err != nil {
		fmt.Fprintln(os.Stderr, "example: -metrics:", err)
		os.Exit(2)
	}
	cfg.serving = func(addr string) {
		fmt.Fprintf(os.Stderr, "example: done; serving metrics at http://%s/metrics until interrupted\n", addr)
		<-ctx.Done()
	}

	runs := []config{cfg}
	if cfg.postgresURL != "" {
		pg := cfg
		pg.inbox = true
		runs = append(runs, pg)
		// One metrics server, for the last run.
		runs[0].metrics, runs[0].serving = nil, nil
	}
	ok := true
	for i, c := range runs {
		if i > 0 {
			fmt.Println()
		}
		rep, err := run(ctx, c)
		if err != nil {
			fmt.Fprintln(os.Stderr, "example:", err)
			os.Exit(2)
		}
		rep.print(os.Stdout)
		if rep.spans != nil {
			rep.spans.print(os.Stdout)
		}
		ok = ok && rep.ok()
	}
	if cfg.postgresURL != "" {
		fmt.Println()
		rep, err := runChain(ctx, cfg)
		if err != nil {
			fmt.Fprintln(os.Stderr, "example:", err)
			os.Exit(2)
		}
		rep.print(os.Stdout)
		ok = ok && rep.ok()
	}
	if !ok {
		os.Exit(1)
	}
}

// config says where the example runs.
type config struct {
	amqpURL   string // "" for the in-memory broker
	redisAddr string // "" for an embedded miniredis
	// postgresURL, with inbox, runs over the PostgreSQL inbox there
	// instead of Redis: pgstore, and each effect a row committed with its
	// done mark.
	postgresURL string
	inbox       bool
	timeout     time.Duration
	logger      *slog.Logger
	trace       bool         // -trace: collect the spans, for report.spans
	metrics     net.Listener // -metrics: serve Prometheus on it; nil for none
	// serving, if set, is called with the metrics server's address once
	// the run is over, before the server stops.
	serving func(addr string)
}

func (c config) describe(w io.Writer) {
	broker, redis := "the in-memory broker", "an embedded Redis (miniredis)"
	if c.amqpURL != "" {
		broker = "RabbitMQ at " + redactURL(c.amqpURL)
	}
	if c.redisAddr != "" {
		redis = "Redis at " + c.redisAddr
	}
	if c.inbox {
		redis = "the PostgreSQL inbox at " + redactURL(c.postgresURL) + " (effects committed with their done marks)"
	}
	fmt.Fprintf(w, "rabbitmw example: %s, %s, two consumers\n\n", broker, redis)
}
