package testenv

import (
	"fmt"
	"net"
	"strings"
	"testing"
)

// reporter stands in for a test, recording the first thing a helper says,
// which would have ended the test.
type reporter struct {
	testing.TB
	said string
}

func (r *reporter) Helper()                           {}
func (r *reporter) Skipf(format string, args ...any)  { r.say("skip: ", format, args) }
func (r *reporter) Fatalf(format string, args ...any) { r.say("fail: ", format, args) }

func (r *reporter) say(how, format string, args []any) {
	if r.said == "" {
		r.said = how + fmt.Sprintf(format, args...)
	}
}

// A server that does not answer skips the test, or fails it under CI,
// saying where it looked, how to start it and which variable names it.
func TestMissingServer(t *testing.T) {
	for _, tc := range []struct {
		env, where string
		find       func(testing.TB) string
		want       []string
	}{
		{"REDIS_ADDR", "127.0.0.1:1", RedisAddr, []string{"Redis at 127.0.0.1:1", "redis-server", "or set REDIS_ADDR ("}},
		{"RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:1/", RabbitMQURL, []string{"RabbitMQ at amqp://guest:guest@127.0.0.1:1/", "rabbitmq-server", "or set RABBITMQ_URL ("}},
		{"DATABASE_URL", "postgres://postgres@127.0.0.1:1/test?sslmode=disable", PostgresURL, []string{"PostgreSQL at postgres://postgres@127.0.0.1:1/test", "pg_ctlcluster", "or set DATABASE_URL ("}},
	} {
		for _, ci := range []string{"false", "true"} {
			t.Setenv("CI", ci)
			t.Setenv(tc.env, tc.where)
			r := &reporter{TB: t}
			if got := tc.find(r); got != tc.where {
				t.Errorf("%s=%s: found %q; want it", tc.env, tc.where, got)
			}
			want := "skip: "
			if ci == "true" {
				want = "fail: "
			}
			if !strings.HasPrefix(r.said, want) {
				t.Errorf("%s=%s, CI=%s: said %q; want it to start %q", tc.env, tc.where, ci, r.said, want)
			}
			for _, w := range tc.want {
				if !strings.Contains(r.said, w) {
					t.Errorf("%s=%s: said %q; want it to contain %q", tc.env, tc.where, r.said, w)
				}
			}
		}
	}
}

// FreePorts gives ports that no outgoing connection can take meanwhile:
// below the kernel's ephemeral range, from which a connect binds its
// local port. A free port from that range (what listening on port 0
// gives) may be taken by any process's connection before the server the
// test starts binds it, which then fails to start ("eaddrinuse": a
// RabbitMQ node of a cluster test, in CI).
func TestFreePortsAreOutsideTheEphemeralRange(t *testing.T) {
	low, _ := ephemeralRange()
	ports, err := FreePorts(20)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if p < 1024 || p >= low {
			t.Errorf("port %d: want one in [1024, %d), below the ephemeral range", p, low)
		}
		if seen[p] {
			t.Errorf("port %d given twice", p)
		}
		seen[p] = true
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			t.Errorf("port %d is not free: %v", p, err)
			continue
		}
		l.Close()
	}
}
