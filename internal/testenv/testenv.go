// Package testenv finds the servers that tests need. Each function returns
// the address of a server that answers, or skips the test with a message
// that says what is missing and how to start it. Under CI=true a missing
// server fails the test instead: a CI run that passes by skipping would
// prove nothing.
package testenv

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
)

// Defaults used when the environment names no server.
const (
	DefaultRedisAddr   = "127.0.0.1:6379"
	DefaultRabbitMQURL = "amqp://guest:guest@127.0.0.1:5672/"
	DefaultPostgresURL = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
)

// InCI reports whether the tests run under CI (the CI variable is true), in
// which case missing servers are failures.
func InCI() bool {
	ci, _ := strconv.ParseBool(os.Getenv("CI"))
	return ci
}

// Missing skips t, or fails it under CI, because what is not available.
// hint says how to make it available.
func Missing(t testing.TB, what, hint string) {
	t.Helper()
	if InCI() {
		t.Fatalf("%s is not available, and CI=true requires it: %s", what, hint)
	}
	t.Skipf("skipped: %s is not available (%s); CI=true turns this skip into a failure", what, hint)
}

var probes sync.Map // address -> error from the first probe

func probe(key string, f func() error) error {
	if v, ok := probes.Load(key); ok {
		if v == nil {
			return nil
		}
		return v.(error)
	}
	err := f()
	if err == nil {
		probes.Store(key, nil)
	} else {
		probes.Store(key, err)
	}
	return err
}

// RedisAddr returns the address of the Redis server for tests: REDIS_ADDR,
// or 127.0.0.1:6379. It skips t (fails it under CI) when no Redis answers
// PING there.
func RedisAddr(t testing.TB) string {
	t.Helper()
	return find(t, "Redis", "REDIS_ADDR", DefaultRedisAddr,
		`start it with: redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no`,
		func(addr string) error {
			c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: time.Second, MaxRetries: -1})
			defer c.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			return c.Ping(ctx).Err()
		})
}

// RabbitMQURL returns the AMQP URL of the RabbitMQ server for tests:
// RABBITMQ_URL, or amqp://guest:guest@127.0.0.1:5672/. It skips t (fails it
// under CI) when no RabbitMQ accepts a connection there.
func RabbitMQURL(t testing.TB) string {
	t.Helper()
	return find(t, "RabbitMQ", "RABBITMQ_URL", DefaultRabbitMQURL,
		"start it with: rabbitmq-server -detached",
		func(url string) error {
			conn, err := amqp.DialConfig(url, amqp.Config{
				Dial: func(network, addr string) (net.Conn, error) {
					return net.DialTimeout(network, addr, 2*time.Second)
				},
			})
			if err != nil {
				return err
			}
			return conn.Close()
		})
}

// find returns where the server what is: the value of the environment
// variable env, or def. It pings the server there once per process, and
// skips t (fails it under CI) when the ping failed, with hint, which says
// how to start it.
func find(t testing.TB, what, env, def, hint string, ping func(where string) error) string {
	t.Helper()
	where := os.Getenv(env)
	if where == "" {
		where = def
	}
	if err := probe(what+" "+where, func() error { return ping(where) }); err != nil {
		Missing(t, what+" at "+where, hint+"; or set "+env+" ("+err.Error()+")")
	}
	return where
}

// PostgresURL returns the connection URL of the PostgreSQL server for
// tests: DATABASE_URL, or postgres://postgres@127.0.0.1:5432/test. It skips
// t (fails it under CI) when no PostgreSQL accepts a connection there and
// answers a query.
func PostgresURL(t testing.TB) string {
	t.Helper()
	return find(t, "PostgreSQL", "DATABASE_URL", DefaultPostgresURL,
		"start it with: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
		func(url string) error {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			conn, err := pgx.Connect(ctx, url)
			if err != nil {
				return err
			}
			defer conn.Close(context.Background())
			return conn.Ping(ctx)
		})
}

// CloseConnections closes, with rabbitmqctl, every connection to the local
// RabbitMQ whose client-provided name contains marker, as the server does
// when an operator forces connections closed, and returns how many it
// closed. Unlike close_all_connections it leaves other connections alone,
// so that tests of several packages, run at once against one server, do
// not break each other's. It skips t (fails it under CI) without
// rabbitmqctl.
func CloseConnections(t testing.TB, marker, reason string) int {
	t.Helper()
	ctl, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		Missing(t, "rabbitmqctl", "install RabbitMQ's command line tools")
	}
	out, err := exec.Command(ctl, "list_connections", "pid", "client_properties", "-q", "--no-table-headers").CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl list_connections: %v\n%s", err, out)
	}
	n := 0
	for _, line := range strings.Split(string(out), "\n") {
		pid, props, ok := strings.Cut(line, "\t")
		if !ok || !strings.Contains(props, `{"connection_name","`) || !strings.Contains(props, marker) {
			continue
		}
		if out, err := exec.Command(ctl, "close_connection", pid, reason).CombinedOutput(); err != nil {
			t.Fatalf("rabbitmqctl close_connection %s: %v\n%s", pid, err, out)
		}
		n++
	}
	return n
}

// FreePorts returns n distinct loopback ports, free a moment ago, for
// servers that a test starts (each holds the next port open until all are
// chosen). The ports lie below the kernel's ephemeral range, so that no
// outgoing connection, of any process, takes one before the server binds
// it; a server of another test may still, rarely, and the caller that
// can tell should try again.
func FreePorts(n int) ([]int, error) {
	low, _ := ephemeralRange()
	if low <= 10000 {
		low = 32768 // a range set unusually low: Linux's default bound
	}
	var ports []int
	for tries := 0; len(ports) < n; tries++ {
		if tries == 1000 {
			return nil, fmt.Errorf("testenv: no free port in [10000, %d) after %d tries", low, tries)
		}
		p := 10000 + mrand.IntN(low-10000)
		if slices.Contains(ports, p) {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue // taken
		}
		defer l.Close()
		ports = append(ports, p)
	}
	return ports, nil
}

// ephemeralRange returns the kernel's range of ports for outgoing
// connections, [low, high], or Linux's default where it cannot be read.
func ephemeralRange() (low, high int) {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if f := strings.Fields(string(b)); err == nil && len(f) == 2 {
		l, lerr := strconv.Atoi(f[0])
		h, herr := strconv.Atoi(f[1])
		if lerr == nil && herr == nil {
			return l, h
		}
	}
	return 32768, 60999
}
