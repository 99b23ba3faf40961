package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker"
)

// ui runs the web console until ctx is done.
func (e *env) ui(ctx context.Context, args []string) error {
	fs := e.newFlags("ui")
	var c common
	c.register(fs, false)
	var queues list
	fs.Var(&queues, "queue", "a work queue to show (repeatable, or comma-separated; required)")
	fs.alias("q", "queue")
	listen := fs.String("listen", "127.0.0.1:8080", "the address to serve on; one that is not loopback needs --token or --basic-auth")
	// The secrets' defaults are read after parsing: a flag's default is
	// printed by -h.
	token := fs.String("token", "", "require this token of every request (default $RABBITMW_UI_TOKEN)")
	basic := fs.String("basic-auth", "", "require this USER:PASSWORD of every request (default $RABBITMW_UI_BASIC_AUTH)")
	readOnly := fs.Bool("read-only", false, "show, and refuse every replay and purge")
	var delays list
	fs.Var(&delays, "delays", "the delay ladder of the queues, comma-separated (default 1s,5s,30s,2m,10m,1h)")
	var sf storeFlags
	sf.register(fs)
	pos, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError("ui: unexpected arguments %q", pos)
	}
	if len(queues) == 0 {
		return usageError("-q/--queue QUEUE is required")
	}
	if *token == "" {
		*token = os.Getenv("RABBITMW_UI_TOKEN")
	}
	if *basic == "" {
		*basic = os.Getenv("RABBITMW_UI_BASIC_AUTH")
	}
	cfg := consoleConfig{amqpURLs: c.amqpURLs(), queues: queues, store: &sf, timeout: e.timeout, readOnly: *readOnly, token: *token,
		logger: slog.New(slog.NewTextHandler(e.stderr, nil))}
	if *basic != "" {
		u, p, ok := strings.Cut(*basic, ":")
		if !ok || u == "" || p == "" {
			return usageError("--basic-auth: want USER:PASSWORD")
		}
		cfg.user, cfg.password = u, p
	}
	for _, s := range delays {
		d, err := time.ParseDuration(s)
		if err != nil {
			return usageError("--delays: %v", err)
		}
		cfg.top.Delays = append(cfg.top.Delays, d)
	}
	for _, q := range queues {
		if _, err := cfg.top.Queues(q); err != nil {
			return usageError("%v", err)
		}
	}
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		return usageError("--listen: %v", err)
	}
	if ip := net.ParseIP(host); (ip == nil || !ip.IsLoopback()) && cfg.token == "" && cfg.user == "" {
		return usageError("--listen %s is not a loopback address: give --token or --basic-auth, which every request must then carry", *listen)
	}
	b, err := c.connect(e.timeout, broker.Observer{})
	if err != nil {
		return err
	}
	defer b.Close()
	con, err := newConsole(cfg, b)
	if err != nil {
		return err
	}
	defer con.close()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: con.handler(ln.Addr().String()), ReadHeaderTimeout: 10 * time.Second}
	addr := "http://" + ln.Addr().String() + "/"
	if cfg.token != "" {
		addr += "?token=" + cfg.token
	}
	fmt.Fprintf(e.stderr, "rabbitmw ui: serving %s on %s\n", strings.Join(queues, ", "), addr)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }() // ends when Shutdown below closes ln
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err = srv.Shutdown(sctx)
	if serr := <-served; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}

// A queueRow is one queue as the console shows it.
type queueRow struct {
	Queue     string
	Role      string
	Exists    bool
	Messages  int
	Consumers int
	Rate      string // the change of Messages per second since the last look
}

// queueStats reads queues' depth and consumers by passive declare, on a
// connection of its own (the Broker does not tell consumers), and keeps
// the last reading of each to tell a rate.
type queueStats struct {
	urls    []string
	timeout time.Duration
	mu      sync.Mutex
	conn    *amqp.Connection
	last    map[string]sample
}

type sample struct {
	at time.Time
	n  int
}

func newQueueStats(urls []string, timeout time.Duration) *queueStats {
	return &queueStats{urls: urls, timeout: timeout, last: map[string]sample{}}
}

func (s *queueStats) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn != nil {
		s.conn.Close()
		s.conn = nil
	}
}

// read returns the rows of the queues of names.
func (s *queueStats) read(ctx context.Context, names broker.Queues) ([]queueRow, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == nil || s.conn.IsClosed() {
		var errs []error
		for _, url := range s.urls {
			conn, err := amqp.DialConfig(url, amqp.Config{Dial: amqp.DefaultDial(s.timeout), Locale: "en_US"})
			if err == nil {
				s.conn = conn
				break
			}
			errs = append(errs, unreachable("RabbitMQ", redact(url), s.timeout, err))
		}
		if s.conn == nil {
			return nil, errors.Join(errs...)
		}
	}
	rows := []queueRow{{Queue: names.Work, Role: "work"}}
	for _, d := range names.Delays {
		rows = append(rows, queueRow{Queue: d, Role: "delay " + d[strings.LastIndex(d, ".")+1:]})
	}
	rows = append(rows, queueRow{Queue: names.DeadLetter, Role: "dead letters"})
	now := time.Now()
	for i := range rows {
		r := &rows[i]
		ch, err := s.conn.Channel() // a passive declare of a missing queue closes its channel
		if err != nil {
			return nil, err
		}
		q, err := ch.QueueDeclarePassive(r.Queue, false, false, false, false, nil)
		var ae *amqp.Error
		switch {
		case errors.As(err, &ae) && ae.Code == amqp.NotFound:
			r.Rate = "-"
			continue
		case err != nil:
			return nil, err
		}
		ch.Close()
		r.Exists, r.Messages, r.Consumers = true, q.Messages, q.Consumers
		r.Rate = "-"
		if prev, ok := s.last[r.Queue]; ok && now.Sub(prev.at) > 100*time.Millisecond {
			r.Rate = fmt.Sprintf("%+.1f/s", float64(r.Messages-prev.n)/now.Sub(prev.at).Seconds())
		}
		s.last[r.Queue] = sample{now, r.Messages}
	}
	return rows, ctx.Err()
}
