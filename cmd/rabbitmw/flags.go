package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

const defaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// common are the flags every command that talks to RabbitMQ has.
type common struct {
	urls  urlList
	queue string
	json  bool
}

// urlList is a repeatable flag of AMQP URLs, each value one URL or
// several separated by commas.
type urlList []string

func (l *urlList) String() string { return strings.Join(*l, ",") }

func (l *urlList) Set(v string) error {
	for u := range strings.SplitSeq(v, ",") {
		if u = strings.TrimSpace(u); u == "" {
			return errors.New("empty URL")
		}
		*l = append(*l, u)
	}
	return nil
}

func (c *common) register(fs *flag.FlagSet, queue bool) {
	fs.Var(&c.urls, "amqp", "AMQP URL of the server; repeated or comma-separated for the nodes of a cluster (default $RABBITMQ_URL, else "+defaultURL+")")
	if queue {
		fs.StringVar(&c.queue, "q", "", "the work queue (required)")
	}
	fs.BoolVar(&c.json, "json", false, "print JSON instead of a table")
}

func (c *common) broker() *broker.Broker {
	urls := c.urls
	if len(urls) == 0 {
		if env := os.Getenv("RABBITMQ_URL"); env != "" {
			// A malformed list fails at the first connection, naming it.
			_ = urls.Set(env)
		}
	}
	opts := broker.Options{ReconnectMax: 2 * time.Second}
	switch len(urls) {
	case 0:
		return broker.New(defaultURL, opts)
	case 1:
		return broker.New(urls[0], opts)
	}
	return broker.NewCluster(broker.Addresses(urls), opts)
}

// newFlags returns a flag set that reports its errors to the caller.
func newFlags(name string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("rabbitmw "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	return fs
}

// parse parses args, flags and positional arguments in any order, and
// returns the positional ones.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return nil, &exitError{exitOK, errors.New("help shown")}
			}
			return nil, &exitError{exitUsage, err}
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		if args[0] == "--" {
			return append(pos, args[1:]...), nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

// list is a repeatable, comma-separated flag.
type list []string

func (l *list) String() string { return strings.Join(*l, ",") }
func (l *list) Set(s string) error {
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			*l = append(*l, v)
		}
	}
	return nil
}

// when is a time flag: RFC 3339, or a duration before now.
type when struct{ t time.Time }

func (w *when) String() string {
	if w.t.IsZero() {
		return ""
	}
	return w.t.Format(time.RFC3339)
}

func (w *when) Set(s string) error {
	if d, err := time.ParseDuration(s); err == nil {
		w.t = time.Now().Add(-d)
		return nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return fmt.Errorf("%q is neither an RFC 3339 time nor a duration", s)
	}
	w.t = t
	return nil
}

// filterFlags are the flags that select dead-lettered messages.
type filterFlags struct {
	ids          list
	errorType    string
	since, until when
}

func (f *filterFlags) register(fs *flag.FlagSet) {
	fs.Var(&f.ids, "id", "select this message id (repeatable, or comma-separated)")
	fs.StringVar(&f.errorType, "error-type", "", "select this error type, as in the ERROR TYPE column")
	fs.Var(&f.since, "since", "select messages that failed at or after this time (RFC 3339, or a duration before now)")
	fs.Var(&f.until, "until", "select messages that failed before this time")
}

func (f *filterFlags) filter() deadletter.Filter {
	return deadletter.Filter{IDs: f.ids, ErrorType: f.errorType, Since: f.since.t, Until: f.until.t}
}

func (f *filterFlags) empty() bool {
	return len(f.ids) == 0 && f.errorType == "" && f.since.t.IsZero() && f.until.t.IsZero()
}

// storeFlags name a store and its key layout.
type storeFlags struct {
	redis         string
	postgres      string
	table         string
	prefix        string
	claimPrefix   string
	failurePrefix string
	namespace     string
}

func (s *storeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&s.redis, "redis", "", "Redis address (host:port) or URL (redis://...)")
	fs.StringVar(&s.postgres, "postgres", "", "PostgreSQL URL (postgres://...) of a pgstore")
	fs.StringVar(&s.table, "table", "", "pgstore Options.Table of the consumers (default "+strconv.Quote(pgstore.DefaultTable)+")")
	fs.StringVar(&s.prefix, "prefix", "", "redisstore.Options.Prefix of the consumers")
	fs.StringVar(&s.claimPrefix, "claim-prefix", "", `redisstore.Options.ClaimPrefix (default "msg:")`)
	fs.StringVar(&s.failurePrefix, "failure-prefix", "", `redisstore.Options.FailurePrefix (default "retry:")`)
	fs.StringVar(&s.namespace, "namespace", "", "the Keying.Namespace of the consumers' Retry and Dedup layers")
}

// inspectingStore is a store that the commands can inspect.
type inspectingStore interface {
	store.Store
	store.Inspector
}

// open returns the store the flags name, and a function that closes it.
func (s *storeFlags) open(ctx context.Context) (inspectingStore, func(), error) {
	switch {
	case s.redis != "" && s.postgres != "":
		return nil, nil, usageError("name one store: --redis or --postgres")
	case s.postgres != "":
		if s.prefix != "" || s.claimPrefix != "" || s.failurePrefix != "" {
			return nil, nil, usageError("--prefix, --claim-prefix and --failure-prefix are for --redis")
		}
		return s.openPostgres(ctx)
	case s.redis == "":
		return nil, nil, usageError("--redis or --postgres is required")
	case s.table != "":
		return nil, nil, usageError("--table is for --postgres")
	}
	var opts *redis.Options
	if strings.Contains(s.redis, "://") {
		var err error
		if opts, err = redis.ParseURL(s.redis); err != nil {
			return nil, nil, usageError("--redis: %v", err)
		}
	} else {
		opts = &redis.Options{Addr: s.redis}
	}
	opts.ContextTimeoutEnabled = true
	c := redis.NewClient(opts)
	st := redisstore.New(c, redisstore.Options{Prefix: s.prefix, ClaimPrefix: s.claimPrefix, FailurePrefix: s.failurePrefix})
	return st, func() { c.Close() }, nil
}

// openPostgres opens the pgstore of --postgres and --table, and checks that
// the database answers and holds the store's tables.
func (s *storeFlags) openPostgres(ctx context.Context) (inspectingStore, func(), error) {
	cfg, err := pgxpool.ParseConfig(s.postgres)
	if err != nil {
		return nil, nil, usageError("--postgres: %v", err)
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	}
	cfg.MaxConns = 2
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, fmt.Errorf("--postgres: %w", err)
	}
	st, err := newPgStore(pool, s.table)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	closeAll := func() {
		st.Close()
		pool.Close()
	}
	if err := st.Check(ctx); err != nil {
		closeAll()
		return nil, nil, err
	}
	return st, closeAll, nil
}

// newPgStore returns pgstore.New(pool, table), or a usage error where New
// panics: a bad table name is the operator's typing here, not a
// programmer's error.
func newPgStore(pool *pgxpool.Pool, table string) (st *pgstore.Store, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = usageError("--table: %v", r)
		}
	}()
	return pgstore.New(pool, pgstore.Options{Table: table}), nil
}

// key returns the store key of message key k, as Dedup and Retry write it.
func (s *storeFlags) key(k string) string {
	if s.namespace != "" {
		return s.namespace + ":" + k
	}
	return k
}
