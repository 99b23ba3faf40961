// Command bench measures the throughput and CPU cost of rabbitmw against a
// plain amqp091 consumer, Watermill, and the hand-written Redis and
// PostgreSQL patterns that it replaces, on a real RabbitMQ, Redis and
// PostgreSQL, prints one table, and says which performance targets are
// met or missed, with the figures. BENCHMARKS.md holds its results and how
// to read them.
//
// bench is a module of its own, so that what it compares against
// (Watermill) is never a dependency of the library. From this directory:
//
//	go run . -rounds 5             # the contenders, 20,000 messages of 12 bytes each run
//	go run . -rounds 5 -size 1024  # the same with 1 KB bodies
//	go run . -sweep -out sweep.svg # the prefetch × workers grid, plotted
//	go run . -scale -out scale.svg # CPU per message as things grow, plotted
//	go run . -latency -n 2000      # publish-to-ack latency at 200 msgs/s
//	go run . -outbox -n 20000      # the outbox's relay against direct publishing (outbox.go)
//	go run . -plot sweep.json -out sweep.svg # the plot again, from its results
//	go run . -stack-only           # the stack in process; no servers needed
//	go run . -only plain,rabbitmw-redis -n 50000 -json out.json
//
// For each round and each contender, in an order that reverses from round
// to round (so that a noisy machine hurts all of them alike), bench
// declares a fresh queue, publishes -n messages to it with confirms (not
// timed), then starts the contender in a process of its own (this program
// again, with -child: see child.go) and times from its first effect to its
// last ack. On its per-delivery path the contender has the work itself and
// an atomic count, nothing else. bench reads the CPU time of that process,
// of Redis, of a local RabbitMQ and of the PostgreSQL processes serving
// it, counts the Redis commands the server ran (INFO commandstats), and
// checks that every message's effect happened exactly once.
//
// The contenders, all at the same prefetch and workers:
//
//	plain               amqp091 consumer, workers goroutines on the delivery
//	                    channel, an ack per message: the baseline
//	plain-multi         one goroutine that acks with multiple=true every 16
//	                    deliveries: the limit of acking
//	hand-written        the usual hand-written Redis pattern (SETNX ...)
//	watermill           Watermill's AMQP router with its Deduplicator (in
//	                    process memory), Retry and Recoverer
//	rabbitmw-memory     broker.Consume, the recommended stack, memory store
//	rabbitmw-redis      the same over the Redis store, at its defaults
//	rabbitmw-redis-unbatched rabbitmw-redis with NoBatching
//	rabbitmw-redis-dup  rabbitmw-redis with -dup of the message ids repeated;
//	                    only when -only names it
//	hand-written-pg     the hand-written one-transaction PostgreSQL inbox:
//	                    BEGIN; INSERT ... ON CONFLICT DO NOTHING; the
//	                    effect (a row); COMMIT
//	rabbitmw-postgres   the PostgreSQL inbox: the stack over pgstore and
//	                    pgstore.Handler, the same effect in its transaction
//	rabbitmw-postgres-group rabbitmw-postgres with group commit
//	                    (HandlerOptions.GroupCommit 32); only when -only
//	                    names it
//	rabbitmw-pgstore    the stack over pgstore, the effect in memory; only
//	                    when -only names it
//
// BENCH_CHILD_CPUPROFILE=PATH writes a CPU profile of each child's run to
// PATH.<contender>.pprof (pair it with -only and -rounds 1).
//
// CPU is reported as milliseconds per 1,000 messages, with RabbitMQ's idle
// CPU (measured for 2 s at start-up) subtracted. The common prefetch and
// workers are the broker's defaults unless -prefetch or -workers say
// otherwise.
//
// bench uses queues, Redis keys and tables whose names start with a prefix
// unique to the run ("rmwbench-..."), and deletes them when a run ends, so
// it can share the servers with other work. RABBITMQ_URL and REDIS_ADDR
// stand for -amqp and -redis, DATABASE_URL for -postgres.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"
)

// config is what the flags say.
type config struct {
	amqpURL     string
	redisAddr   string
	postgresURL string
	n           int
	size        int
	dup         float64
	rounds      int
	prefetch    int // 0: the broker's default
	workers     int // 0: the broker's default
	sweep       bool
	scale       bool // -scale: CPU per message as things grow
	latency     bool // -latency: publish→ack latency at a light load
	outbox      bool // -outbox: the relay against direct confirmed publishing
	rate        int  // -rate: its messages per second
	only        []string
	jsonPath    string
	timeout     time.Duration
	persistent  bool
	stack       bool
	stackOnly   bool
	cpuProfile  string

	sweepWorkers  []int
	sweepPrefetch []prefetchSpec
	sweepOut      string // -out: the plot, with its table and JSON beside it
	plot          string // -plot: replot this sweep's JSON, and exit
}

func main() {
	if len(os.Args) == 3 && os.Args[1] == "-child" {
		// A contender's run, in a process of its own (see child.go).
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
		defer stop()
		if err := runChild(ctx, os.Args[2], os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, "bench -child:", err)
			os.Exit(1)
		}
		return
	}
	cfg, err := parseFlags(os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if cfg.cpuProfile != "" {
		f, err := os.Create(cfg.cpuProfile)
		if err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(2)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			fmt.Fprintln(os.Stderr, "bench:", err)
			os.Exit(2)
		}
		defer pprof.StopCPUProfile()
	}
	if err := run(ctx, cfg); err != nil {
		stop()
		pprof.StopCPUProfile()
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func parseFlags(args []string) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.StringVar(&cfg.amqpURL, "amqp", envOr("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"), "AMQP URL of the RabbitMQ server")
	fs.StringVar(&cfg.redisAddr, "redis", envOr("REDIS_ADDR", "127.0.0.1:6379"), "address of the Redis server")
	fs.StringVar(&cfg.postgresURL, "postgres", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"), "URL of the PostgreSQL database of rabbitmw-postgres")
	fs.IntVar(&cfg.n, "n", 20000, "messages per run (-sweep: 5000)")
	fs.IntVar(&cfg.size, "size", 12, "message body size in bytes")
	fs.Float64Var(&cfg.dup, "dup", 0.2, "fraction of the messages of rabbitmw-redis-dup that repeat an earlier message's id")
	fs.IntVar(&cfg.rounds, "rounds", 3, "rounds; each runs every contender once")
	fs.IntVar(&cfg.prefetch, "prefetch", 0, "prefetch of every contender (default: the broker's default)")
	fs.IntVar(&cfg.workers, "workers", 0, "workers of every contender (default: the broker's default)")
	fs.BoolVar(&cfg.latency, "latency", false, "measure publish-to-ack latency at a light load instead: -n messages (use about 2000) published at -rate (contenders plain, rabbitmw-redis, rabbitmw-redis-unbatched, unless -only)")
	fs.IntVar(&cfg.rate, "rate", 200, "-latency, -outbox: messages per second")
	fs.BoolVar(&cfg.outbox, "outbox", false, "measure the transactional outbox instead: its relay's msgs/s and CPU against direct confirmed publishing (-n messages, -rounds), and commit-to-delivery latency with NOTIFY and with the poll alone (500 messages at -rate)")
	fs.BoolVar(&cfg.scale, "scale", false, "measure CPU per message as body size, workers, messages and consumer processes grow instead (contenders plain and rabbitmw-redis, unless -only); -out FILE.svg plots it")
	fs.BoolVar(&cfg.sweep, "sweep", false, "run the prefetch × workers grid instead (contenders plain, rabbitmw-redis and rabbitmw-redis-unbatched, unless -only)")
	only := fs.String("only", "", "comma-separated contenders to run (default: all but rabbitmw-redis-dup and rabbitmw-pgstore; for -sweep: plain,rabbitmw-redis,rabbitmw-redis-unbatched)")
	fs.StringVar(&cfg.jsonPath, "json", "", "also write the results as JSON to this file")
	fs.DurationVar(&cfg.timeout, "timeout", 5*time.Minute, "the longest one contender may take to consume one run")
	fs.BoolVar(&cfg.persistent, "persistent", true, "publish persistent messages (delivery mode 2), as broker.Publish does")
	fs.BoolVar(&cfg.stack, "stack", true, "also measure the whole stack in process (testing.Benchmark, memory store) for the per-delivery targets")
	fs.BoolVar(&cfg.stackOnly, "stack-only", false, "only measure the stack in process (no servers needed), and exit")
	fs.StringVar(&cfg.cpuProfile, "cpuprofile", "", "write a CPU profile of the whole command to this file (pair it with -only)")
	sw := fs.String("sweep-workers", "4,16,64", "-sweep: the workers of the grid")
	sp := fs.String("sweep-prefetch", "8,32,128", "-sweep: the prefetch of the grid: counts, or multiples of the workers such as 2x")
	fs.StringVar(&cfg.plot, "plot", "", "write the plot and tables of -out again from this JSON of an earlier -sweep -out, and exit (no servers needed)")
	fs.StringVar(&cfg.sweepOut, "out", "", "-sweep: write the plot as an SVG to this file, and beside it the same name with .md (the tables) and .json (the results)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	setFlags := make(map[string]bool)
	fs.Visit(func(f *flag.Flag) { setFlags[f.Name] = true })
	switch {
	case cfg.n < 1:
		return cfg, errors.New("-n must be at least 1")
	case cfg.size < 0:
		return cfg, errors.New("-size must not be negative")
	case cfg.dup < 0 || cfg.dup >= 1:
		return cfg, errors.New("-dup must be in [0, 1)")
	case cfg.rounds < 1:
		return cfg, errors.New("-rounds must be at least 1")
	case cfg.prefetch < 0 || cfg.prefetch > 65535:
		return cfg, errors.New("-prefetch must be in [0, 65535]")
	case cfg.workers < 0:
		return cfg, errors.New("-workers must not be negative")
	case cfg.rate < 1:
		return cfg, errors.New("-rate must be at least 1")
	case cfg.timeout <= 0:
		return cfg, errors.New("-timeout must be positive")
	}
	var err error
	if cfg.sweepWorkers, err = intList(*sw); err != nil {
		return cfg, fmt.Errorf("-sweep-workers: %w", err)
	}
	for f := range strings.SplitSeq(*sp, ",") {
		spec, err := parsePrefetch(f)
		if err != nil {
			return cfg, fmt.Errorf("-sweep-prefetch: %w", err)
		}
		cfg.sweepPrefetch = append(cfg.sweepPrefetch, spec)
	}
	if cfg.sweep && !setFlags["n"] {
		cfg.n = sweepMessages
	}
	if cfg.sweepOut != "" && !cfg.sweep && !cfg.scale && cfg.plot == "" {
		return cfg, errors.New("-out needs -sweep, -scale or -plot")
	}
	if cfg.plot != "" && cfg.sweepOut == "" {
		return cfg, errors.New("-plot needs -out")
	}
	if *only != "" {
		for _, name := range strings.Split(*only, ",") {
			name = strings.TrimSpace(name)
			if !knownContender(name) {
				return cfg, fmt.Errorf("-only: unknown contender %q (known: %s)", name, strings.Join(contenderNames, ", "))
			}
			cfg.only = append(cfg.only, name)
		}
	}
	return cfg, nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// intList parses "1,4,8" into positive integers.
func intList(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 1 {
			return nil, fmt.Errorf("%q is not a positive integer", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// run connects, measures what cfg asks for, prints it, and cleans up.
func run(ctx context.Context, cfg config) error {
	if cfg.plot != "" {
		return replot(cfg.plot, cfg.sweepOut)
	}
	if cfg.stackOnly {
		sc := measureStack()
		sc.print(os.Stdout)
		return writeJSON(cfg.jsonPath, sc)
	}
	e, err := connect(ctx, cfg)
	if err != nil {
		return err
	}
	defer e.close()

	// The settings broker.Consume applies: its defaults, and the common
	// setting that the flags ask for (the defaults when they ask nothing).
	defPrefetch, defWorkers, err := brokerSettings(ctx, 0, 0)
	if err != nil {
		return err
	}
	prefetch, workers, err := brokerSettings(ctx, cfg.prefetch, cfg.workers)
	if err != nil {
		return err
	}
	defaults := prefetch == defPrefetch && workers == defWorkers

	out := os.Stdout
	e.machine.print(out)
	if cfg.latency {
		return runLatency(ctx, e, cfg, prefetch, workers)
	}
	if cfg.outbox {
		return runOutbox(ctx, e, cfg)
	}
	if cfg.scale {
		res, err := runScale(ctx, e, cfg)
		if err != nil {
			return err
		}
		res.Machine = e.machine
		res.print(out)
		if err := res.writeFiles(cfg.sweepOut); err != nil {
			return err
		}
		return writeJSON(cfg.jsonPath, res)
	}
	if cfg.sweep {
		res, err := runSweep(ctx, e, cfg, defPrefetch, defWorkers)
		if err != nil {
			return err
		}
		res.Machine = e.machine
		res.print(out)
		if err := res.writeFiles(cfg.sweepOut); err != nil {
			return err
		}
		return writeJSON(cfg.jsonPath, res)
	}
	res, err := runCompare(ctx, e, cfg, prefetch, workers, defaults)
	if err != nil {
		return err
	}
	res.Machine = e.machine
	res.print(out)
	return writeJSON(cfg.jsonPath, res)
}
