package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	neturl "net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

const defaultURL = "amqp://guest:guest@127.0.0.1:5672/"

// defaultTimeout is how long a command waits for a server to answer.
const defaultTimeout = 10 * time.Second

// common are the flags every command that talks to RabbitMQ has.
type common struct {
	urls  urlList
	queue string
	json  bool
}

// register adds --amqp, and -q/--queue if queue.
func (c *common) register(fs *flagSet, queue bool) {
	fs.Var(&c.urls, "amqp", "AMQP URL of the server; repeated or comma-separated for the nodes of a cluster (default $RABBITMQ_URL, else "+defaultURL+")")
	if queue {
		fs.StringVar(&c.queue, "queue", "", "the work queue (required)")
		fs.alias("q", "queue")
	}
}

// registerJSON adds --json, for the commands that print what they found.
func (c *common) registerJSON(fs *flagSet) {
	fs.BoolVar(&c.json, "json", false, "print JSON instead of a table")
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

// amqpURLs returns the URLs of the nodes: --amqp, else $RABBITMQ_URL,
// else the default.
func (c *common) amqpURLs() []string {
	urls := c.urls
	if len(urls) == 0 {
		if env := os.Getenv("RABBITMQ_URL"); env != "" {
			// An empty entry is skipped: there is no flag to blame.
			for u := range strings.SplitSeq(env, ",") {
				if u = strings.TrimSpace(u); u != "" {
					urls = append(urls, u)
				}
			}
		}
	}
	if len(urls) == 0 {
		urls = urlList{defaultURL}
	}
	return urls
}

// connect returns a Broker on the server, or on the nodes of a cluster,
// once one of them has answered within timeout: the Broker itself would
// wait for ever, reconnecting. obs is the Broker's Observer.
func (c *common) connect(timeout time.Duration, obs broker.Observer) (*broker.Broker, error) {
	urls := c.amqpURLs()
	var errs []error
	for _, url := range urls {
		conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(timeout), Locale: "en_US"})
		if err != nil {
			errs = append(errs, unreachable("RabbitMQ", redact(url), timeout, err))
			continue
		}
		conn.Close()
		opts := broker.Options{ReconnectMax: 2 * time.Second, Observer: obs}
		if len(urls) == 1 {
			return broker.New(url, opts), nil
		}
		return broker.NewCluster(broker.Addresses(urls), opts), nil
	}
	return nil, errors.Join(errs...)
}

// connectFor is connect for a command that ends. Besides the Broker, it
// returns the context to run the command under, which ends once the
// Broker has tried for timeout to reach the server and failed (a
// connection lost midway that does not come back, or its own first one),
// where the Broker would go on trying; e.lost then says why. The caller
// closes the Broker with closeBroker, which must be called.
func (c *common) connectFor(ctx context.Context, e *env) (b *broker.Broker, cctx context.Context, closeBroker func(), err error) {
	cctx, cancel := context.WithCancel(ctx)
	w := &downWatch{e: e, timeout: e.timeout, where: strings.Join(c.redactedURLs(), ", "), cancel: cancel}
	b, err = c.connect(e.timeout, broker.Observer{Reconnect: w.reconnect, Connect: w.connect})
	if err != nil {
		cancel()
		return nil, nil, nil, err
	}
	return b, cctx, func() {
		w.stop()
		b.Close()
		cancel()
	}, nil
}

// redactedURLs returns the servers' URLs without their passwords.
func (c *common) redactedURLs() []string {
	var urls []string
	for _, u := range c.amqpURLs() {
		urls = append(urls, redact(u))
	}
	return urls
}

// A downWatch ends a command's context once its Broker has failed to
// reach the server for the timeout since its last connection was lost (or
// since it first tried), and tells the command's env why.
type downWatch struct {
	e       *env
	timeout time.Duration
	where   string
	cancel  context.CancelFunc

	mu      sync.Mutex
	timer   *time.Timer // armed while no connection is up
	armed   int         // the times timer was armed: a timer of an earlier arming fires for nothing
	last    error       // the last failure
	stopped bool
}

func (w *downWatch) reconnect(ev broker.ReconnectEvent) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last = ev.Err
	if w.timer == nil && !w.stopped {
		w.armed++
		n := w.armed
		w.timer = time.AfterFunc(w.timeout, func() { w.fire(n) })
	}
}

func (w *downWatch) connect(broker.ConnectEvent) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.timer != nil {
		w.timer.Stop()
		w.timer = nil
	}
}

// fire ends the command, for the arming n of the timer, if no
// connection came since.
func (w *downWatch) fire(n int) {
	w.mu.Lock()
	if w.stopped || w.timer == nil || w.armed != n {
		w.mu.Unlock()
		return
	}
	err := fmt.Errorf("RabbitMQ at %s did not answer again within %s (--timeout): %w", w.where, w.timeout, w.last)
	w.mu.Unlock()
	w.e.setLost(err)
	w.cancel()
}

func (w *downWatch) stop() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stopped = true
	if w.timer != nil {
		w.timer.Stop()
	}
}

// unreachable is the error of a server that could not be reached.
func unreachable(server, where string, timeout time.Duration, err error) error {
	var ne net.Error
	var ae *amqp.Error // amqp091 reports a handshake's timeout as a frame error
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) ||
		(errors.As(err, &ae) && strings.HasSuffix(ae.Reason, "i/o timeout")) {
		return fmt.Errorf("%s at %s did not answer within %s (--timeout): %w", server, where, timeout, err)
	}
	return fmt.Errorf("cannot reach %s at %s: %w", server, where, err)
}

// redact returns url without its password.
func redact(s string) string {
	u, err := neturl.Parse(s)
	if err != nil {
		return "(an unparsable URL)"
	}
	return u.Redacted()
}

// A flagSet is the flags of one command. Its errors are the caller's to
// print, once; -h prints its help on standard output, which lists its
// flags only, each with its long and short names together.
type flagSet struct {
	*flag.FlagSet
	name    string            // "dlq ls"
	short   map[string]string // long name -> its short alias
	aliases map[string]bool   // the short names
	stdout  io.Writer
}

// newFlags returns the flag set of command name, with --timeout.
func (e *env) newFlags(name string) *flagSet {
	fs := &flagSet{FlagSet: flag.NewFlagSet("rabbitmw "+name, flag.ContinueOnError), name: name,
		short: map[string]string{}, aliases: map[string]bool{}, stdout: e.stdout}
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.DurationVar(&e.timeout, "timeout", defaultTimeout, "give up when a server does not answer within this long")
	return fs
}

// alias makes -short another name of the flag --long.
func (fs *flagSet) alias(short, long string) {
	fs.Var(fs.Lookup(long).Value, short, "")
	fs.short[long] = short
	fs.aliases[short] = true
}

// help prints the command's flags.
func (fs *flagSet) help() {
	w := fs.stdout
	fmt.Fprintf(w, "usage: rabbitmw %s [flags]\n\nflags:\n", fs.name)
	fs.VisitAll(func(f *flag.Flag) {
		if fs.aliases[f.Name] {
			return
		}
		kind, text := flag.UnquoteUsage(f)
		names := "    --" + f.Name
		if s, ok := fs.short[f.Name]; ok {
			names = "-" + s + ", --" + f.Name
		}
		if kind != "" {
			names += " " + kind
		}
		if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" && f.DefValue != "[]" {
			text += " (default " + f.DefValue + ")"
		}
		fmt.Fprintf(w, "  %s\n        %s\n", names, text)
	})
}

// parse parses args, flags and positional arguments in any order, and
// returns the positional ones.
func (fs *flagSet) parse(args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				fs.help()
				return nil, &exitError{exitOK, errors.New("help shown")}
			}
			return nil, usageError("%v; see 'rabbitmw %s -h'", err, fs.name)
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
	errorText    string
	group        string
	since, until when
}

func (f *filterFlags) register(fs *flagSet) {
	fs.Var(&f.ids, "id", "select this message id, or key for a message without one (repeatable, or comma-separated)")
	fs.StringVar(&f.errorType, "error-type", "", "select this error type, as in the ERROR TYPE column")
	fs.StringVar(&f.errorText, "error", "", "select messages whose error contains this text, whatever the case")
	fs.StringVar(&f.group, "group", "", "select the messages of this group, as dlq groups lists them")
	fs.Var(&f.since, "since", "select messages that failed at or after this time (RFC 3339, or a duration before now)")
	fs.Var(&f.until, "until", "select messages that failed before this time")
}

func (f *filterFlags) filter() deadletter.Filter {
	return deadletter.Filter{IDs: f.ids, ErrorType: f.errorType, Error: f.errorText, Group: f.group, Since: f.since.t, Until: f.until.t}
}

func (f *filterFlags) empty() bool {
	return len(f.ids) == 0 && f.errorType == "" && f.errorText == "" && f.group == "" && f.since.t.IsZero() && f.until.t.IsZero()
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

func (s *storeFlags) register(fs *flagSet) {
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
func (s *storeFlags) open(ctx context.Context, timeout time.Duration) (inspectingStore, func(), error) {
	switch {
	case s.redis != "" && s.postgres != "":
		return nil, nil, usageError("name one store: --redis or --postgres")
	case s.postgres != "":
		if s.prefix != "" || s.claimPrefix != "" || s.failurePrefix != "" {
			return nil, nil, usageError("--prefix, --claim-prefix and --failure-prefix are for --redis")
		}
		return s.openPostgres(ctx, timeout)
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
	opts.DialTimeout = timeout
	c := redis.NewClient(opts)
	pctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := c.Ping(pctx).Err(); err != nil {
		c.Close()
		return nil, nil, unreachable("Redis", opts.Addr, timeout, err)
	}
	st := redisstore.New(c, redisstore.Options{Prefix: s.prefix, ClaimPrefix: s.claimPrefix, FailurePrefix: s.failurePrefix})
	return st, func() { c.Close() }, nil
}

// openPostgres opens the pgstore of --postgres and --table, and checks that
// the database answers and holds the store's tables.
func (s *storeFlags) openPostgres(ctx context.Context, timeout time.Duration) (inspectingStore, func(), error) {
	pool, ping, err := openPool(ctx, s.postgres, timeout)
	if err != nil {
		return nil, nil, err
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
	if err := ping(ctx); err != nil {
		closeAll()
		return nil, nil, err
	}
	if err := st.Check(ctx); err != nil {
		closeAll()
		return nil, nil, err
	}
	return st, closeAll, nil
}

// openPool opens a pool of two connections on the PostgreSQL database of
// --postgres url (it connects when first used), and returns it with a
// function that checks, within timeout, that the database answers.
func openPool(ctx context.Context, url string, timeout time.Duration) (pool *pgxpool.Pool, ping func(context.Context) error, err error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, nil, usageError("--postgres: %v", err)
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = timeout
	}
	where := net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port)))
	cfg.MaxConns = 2
	if pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, nil, fmt.Errorf("--postgres: %w", err)
	}
	return pool, func(ctx context.Context) error {
		ctx, cancel := context.WithTimeout(ctx, timeout)
		defer cancel()
		if err := pool.Ping(ctx); err != nil {
			return unreachable("PostgreSQL", where, timeout, err)
		}
		return nil
	}, nil
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
