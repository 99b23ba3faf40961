// Command consumer is the consumer process of the reliability suite: the
// recommended stack (Log, Retry, Recover, Dedup, Timeout) run by
// broker.Consume against RabbitMQ, in front of a business handler that
// records each effect it applies in Redis, so that the suite can count, for
// every message, how many times its effect happened and who applied it.
//
// The suite builds it, starts it, kills it (SIGKILL), stops it (SIGTERM:
// a graceful shutdown) and cuts it off from its servers. It is not meant
// for anything else.
//
// With -store postgres://…, the store is pgstore's inbox in that database,
// and the effect of a message is a row (id, consumer) inserted into the
// table <-store-prefix>_effects in the handler's transaction, which commits
// with the done mark; the suite counts effects there. Otherwise, effects,
// under the prefix P given by -effects-prefix, in the effects Redis
// (-effects):
//
//	P effect:<key>   the number of times the effect of the message with
//	                 idempotency key <key> was applied
//	P total          the number of effects applied, all messages
//	P distinct       the number of messages applied at least once
//	P log            one entry per effect, "<name> <key>", in order
//	P events         what slow handlers did: "start|cancelled|ignored
//	                 <name> <key> [cause]"; in poison mode, the "start" of
//	                 each slow order
//	P attempts:<key> handler calls for the message (modes slow, stubborn
//	                 and poison)
//	P deliveries:<key> deliveries of the message (with -count-deliveries)
//	P abandoned:<key> deliveries that found the message's last attempt
//	                 abandoned (Dedup's ErrAbandoned: a consumer died
//	                 holding it)
//	P abandoned      the same, all messages
//
// The four writes of an effect are one Lua script: atomic, so an effect
// is never counted without its log entry, or the reverse.
//
// On SIGTERM or SIGINT it shuts down gracefully, prints one JSON line of
// statistics on standard output and exits with status 0; on a fatal error
// of Consume it exits with status 1. Logs (Warn and above) go to standard
// error.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/reliability/internal/stats"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// config is the command line.
type config struct {
	amqpURL         string
	queue           string
	name            string
	storeAddr       string
	storePrefix     string
	storeCtxTimeout bool
	effectsAddr     string
	effectsPrefix   string
	workers         int
	prefetch        int
	lease           time.Duration
	busy            time.Duration
	unavailable     time.Duration
	groupCommit     int
	delays          []time.Duration
	quorum          bool
	quorumSupport   bool
	deliveryLimit   int
	timeout         time.Duration
	maxAttempts     int
	backoffMin      time.Duration
	backoffMax      time.Duration
	mode            string
	work            time.Duration
	hold            time.Duration
	countDeliveries bool
	shutdownTimeout time.Duration
	reconnectMax    time.Duration
}

func parseFlags(args []string) (config, error) {
	var c config
	var delays string
	fs := flag.NewFlagSet("consumer", flag.ContinueOnError)
	fs.StringVar(&c.amqpURL, "amqp", "amqp://guest:guest@127.0.0.1:5672/", "AMQP URL of RabbitMQ; the nodes of a cluster separated by commas")
	fs.StringVar(&c.queue, "queue", "", "work queue (required)")
	fs.StringVar(&c.name, "name", "consumer", "consumer name: in the effect log, and the process in fault headers")
	fs.StringVar(&c.storeAddr, "store", "127.0.0.1:6379", "address of the Redis that holds the idempotency store; a postgres:// URL selects the PostgreSQL inbox (pgstore, effects as rows in the handler's transaction)")
	fs.StringVar(&c.storePrefix, "store-prefix", "", "prefix of the store's keys; with PostgreSQL, the store's table (effects in <table>_effects)")
	fs.BoolVar(&c.storeCtxTimeout, "store-context-timeouts", false, "let the store's Redis client honour context deadlines (redis.Options.ContextTimeoutEnabled)")
	fs.StringVar(&c.effectsAddr, "effects", "127.0.0.1:6379", "address of the Redis that records effects")
	fs.StringVar(&c.effectsPrefix, "effects-prefix", "", "prefix of the effect keys (required)")
	fs.IntVar(&c.workers, "workers", 8, "handlers run at once")
	fs.IntVar(&c.prefetch, "prefetch", 0, "prefetch count (0: the broker's default, 2*workers)")
	fs.DurationVar(&c.lease, "lease", 0, "Dedup lease (0: the default, 5m)")
	fs.DurationVar(&c.busy, "busy", 0, "Dedup busy delay (0: the default)")
	fs.DurationVar(&c.unavailable, "unavailable", 0, "Dedup unavailable delay (0: the default)")
	fs.IntVar(&c.groupCommit, "group-commit", 0, "PostgreSQL inbox: pgstore.HandlerOptions.GroupCommit (0: off)")
	fs.StringVar(&delays, "delays", "", "delay tiers, comma-separated (empty: the broker's default)")
	fs.BoolVar(&c.quorum, "quorum", false, "the work queue is a quorum queue (Topology.Quorum)")
	fs.BoolVar(&c.quorumSupport, "quorum-support", false, "the dead-letter and delay queues are quorum queues (Topology.QuorumSupport)")
	fs.IntVar(&c.deliveryLimit, "delivery-limit", 0, "the quorum queue's delivery limit (Topology.DeliveryLimit)")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "Timeout layer: the handler's deadline")
	fs.IntVar(&c.maxAttempts, "max-attempts", 0, "Retry attempts (0: the default, 5)")
	fs.DurationVar(&c.backoffMin, "backoff-min", 0, "Retry backoff minimum (0: the default backoff)")
	fs.DurationVar(&c.backoffMax, "backoff-max", 0, "Retry backoff maximum")
	fs.StringVar(&c.mode, "mode", "normal", "business handler: normal, slow, stubborn or poison")
	fs.DurationVar(&c.work, "work", 0, "normal mode, and ok orders in poison mode: time spent before the effect")
	fs.DurationVar(&c.hold, "hold", 5*time.Second, "slow and stubborn modes: time spent before the effect; poison mode: the hold of a slow order")
	fs.BoolVar(&c.countDeliveries, "count-deliveries", false, "count the deliveries of each message")
	fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", 10*time.Second, "ConsumeOptions.ShutdownTimeout")
	fs.DurationVar(&c.reconnectMax, "reconnect-max", time.Second, "broker.Options.ReconnectMax (ReconnectMin is 50ms, or this if shorter)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case c.queue == "":
		return c, errors.New("-queue is required")
	case c.effectsPrefix == "":
		return c, errors.New("-effects-prefix is required")
	case c.mode != "normal" && c.mode != "slow" && c.mode != "stubborn" && c.mode != "poison":
		return c, fmt.Errorf("-mode %q: want normal, slow, stubborn or poison", c.mode)
	case (c.backoffMin == 0) != (c.backoffMax == 0):
		return c, errors.New("-backoff-min and -backoff-max go together")
	}
	if delays != "" {
		for _, s := range strings.Split(delays, ",") {
			d, err := time.ParseDuration(strings.TrimSpace(s))
			if err != nil {
				return c, fmt.Errorf("-delays: %w", err)
			}
			c.delays = append(c.delays, d)
		}
	}
	return c, nil
}

func main() {
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	st, err := run(ctx, cfg)
	out, _ := json.Marshal(st)
	fmt.Println(string(out))
	if err != nil {
		fmt.Fprintln(os.Stderr, "consumer:", err)
		os.Exit(1)
	}
}

type counters struct {
	deliveries, acked, duplicates, busy, unavailable, leaseLost, failed, deadLettered, effects, settleErrors atomic.Int64
}

func (c *counters) snapshot(name string, err error) stats.Consumer {
	s := stats.Consumer{
		Name:         name,
		Deliveries:   c.deliveries.Load(),
		Acked:        c.acked.Load(),
		Duplicates:   c.duplicates.Load(),
		Busy:         c.busy.Load(),
		Unavailable:  c.unavailable.Load(),
		LeaseLost:    c.leaseLost.Load(),
		Failed:       c.failed.Load(),
		DeadLettered: c.deadLettered.Load(),
		Effects:      c.effects.Load(),
		SettleErrors: c.settleErrors.Load(),
	}
	if err != nil {
		s.Error = err.Error()
	}
	return s
}

// observe is the outermost layer: it classifies each chain result.
func (c *counters) observe(next rabbitmw.Handler) rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		c.deliveries.Add(1)
		err := next.Handle(ctx, d)
		switch dec := rabbitmw.Decide(err); {
		case dec.Outcome == rabbitmw.Ack:
			c.acked.Add(1)
		case dec.Outcome == rabbitmw.Duplicate:
			c.duplicates.Add(1)
		case dec.Outcome == rabbitmw.DeadLetter:
			c.deadLettered.Add(1)
		case errors.Is(err, middleware.ErrBusy):
			c.busy.Add(1)
		case errors.Is(err, middleware.ErrLeaseLost):
			c.leaseLost.Add(1)
		case errors.Is(err, middleware.ErrStoreUnavailable):
			c.unavailable.Add(1)
		default:
			c.failed.Add(1)
		}
		return err
	})
}

func run(ctx context.Context, cfg config) (stats.Consumer, error) {
	var cnt counters

	effectsClient := redis.NewClient(&redis.Options{Addr: cfg.effectsAddr})
	defer effectsClient.Close()
	biz := &business{cfg: cfg, rdb: effectsClient, effects: &cnt.effects}
	var st store.Store
	var handler rabbitmw.Handler
	if pg := strings.HasPrefix(cfg.storeAddr, "postgres://") || strings.HasPrefix(cfg.storeAddr, "postgresql://"); pg {
		pool, err := pgxpool.New(ctx, cfg.storeAddr)
		if err != nil {
			return cnt.snapshot(cfg.name, err), err
		}
		defer pool.Close()
		pst := pgstore.New(pool, pgstore.Options{Table: cfg.storePrefix})
		defer pst.Close()
		if err := pst.Check(ctx); err != nil {
			return cnt.snapshot(cfg.name, err), err
		}
		biz.effectsTable = cfg.storePrefix + "_effects"
		st = pst
		handler = pgstore.Handler(pst, biz.inTx, pgstore.HandlerOptions{RetryDelay: cfg.unavailable, GroupCommit: cfg.groupCommit})
	} else {
		storeClient := redis.NewClient(&redis.Options{Addr: cfg.storeAddr, ContextTimeoutEnabled: cfg.storeCtxTimeout})
		defer storeClient.Close()
		st = redisstore.New(storeClient, redisstore.Options{Prefix: cfg.storePrefix})
		handler = biz.handler()
	}

	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).
		With(slog.String("consumer", cfg.name))

	retryOpts := middleware.RetryOptions{MaxAttempts: cfg.maxAttempts}
	if cfg.backoffMin > 0 {
		retryOpts.Backoff = middleware.Exponential(cfg.backoffMin, cfg.backoffMax)
	}
	// The recommended stack, written out rather than built by
	// middleware.Stack: the suite counts between its layers (Dedup's
	// delays alone are reachable through StackOptions.Dedup).
	layers := []rabbitmw.Middleware{cnt.observe}
	if cfg.countDeliveries {
		layers = append(layers, biz.countDeliveries)
	}
	layers = append(layers,
		middleware.Log(logger),
		middleware.Retry(st, retryOpts),
		middleware.Recover(),
		biz.countAbandoned,
		middleware.Dedup(st, middleware.DedupOptions{
			Lease:            cfg.lease,
			BusyDelay:        cfg.busy,
			UnavailableDelay: cfg.unavailable,
		}),
		middleware.Timeout(cfg.timeout),
	)
	h := rabbitmw.Chain(layers...)(handler)

	opts := broker.Options{
		Logger:       logger,
		ReconnectMin: min(50*time.Millisecond, cfg.reconnectMax),
		ReconnectMax: cfg.reconnectMax,
		Process:      cfg.name,
	}
	b := broker.New(cfg.amqpURL, opts)
	if urls := strings.Split(cfg.amqpURL, ","); len(urls) > 1 {
		b = broker.NewCluster(broker.Addresses(urls), opts)
	}
	defer b.Close()
	err := b.Consume(ctx, cfg.queue, h, broker.ConsumeOptions{
		Workers:         cfg.workers,
		Prefetch:        cfg.prefetch,
		Topology:        broker.Topology{Delays: cfg.delays, Quorum: cfg.quorum, QuorumSupport: cfg.quorumSupport, DeliveryLimit: cfg.deliveryLimit},
		ShutdownTimeout: cfg.shutdownTimeout,
		OnSettle: func(_ *amqp.Delivery, _ rabbitmw.Outcome, err error) {
			if err != nil {
				cnt.settleErrors.Add(1)
			}
		},
	})
	return cnt.snapshot(cfg.name, err), err
}
