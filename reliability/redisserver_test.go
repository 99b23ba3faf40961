//go:build reliability

package reliability_test

// A Redis server of the test's own, on a spare loopback port, that the
// test may stop and start again on the same port and data directory.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// A redisServer is one redis-server with persistence on: every write is in
// its append-only file before it is acknowledged. It is killed and waited
// for when its test ends.
type redisServer struct {
	t      *testing.T
	server string // the redis-server program
	dir    string // data directory: the append-only file, the log
	port   string
	addr   string
	starts int

	*child // the running server, replaced at each start
}

// startRedisServer starts a redis-server for t on a free loopback port,
// with its data in a temporary directory.
func startRedisServer(t *testing.T) *redisServer {
	t.Helper()
	s := &redisServer{t: t, server: lookPath(t, "redis-server"), dir: t.TempDir()}
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(1)
		require.NoError(t, err)
		s.port = strconv.Itoa(ports[0])
		s.addr = net.JoinHostPort("127.0.0.1", s.port)
		err = s.start()
		if err == nil {
			return s
		}
		if !errors.Is(err, errPortTaken) || attempt == portAttempts {
			t.Fatalf("starting redis-server (attempt %d of %d): %v", attempt, portAttempts, err)
		}
	}
}

// start starts the server on s.port and s.dir and waits until it answers.
func (s *redisServer) start() error {
	s.starts++
	logPath := filepath.Join(s.dir, fmt.Sprintf("redis-%d.log", s.starts))
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd := exec.Command(s.server,
		"--port", s.port,
		"--bind", "127.0.0.1",
		"--dir", s.dir,
		"--appendonly", "yes",
		"--appendfsync", "always",
		"--save", "",
		"--daemonize", "no",
	)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if s.child, err = startChild(s.t, cmd, nil); err != nil {
		return err
	}
	deadline := time.Now().Add(nodeStartTimeout)
	for {
		select {
		case <-s.exited:
			log := readLog(logPath)
			if strings.Contains(log, "Address already in use") {
				return fmt.Errorf("%w: redis-server on %s", errPortTaken, s.addr)
			}
			return fmt.Errorf("redis-server on %s exited at start (%v):\n%s", s.addr, s.waitErr, log)
		default:
		}
		if servedBy(s.addr, cmd.Process.Pid) && s.loaded() {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("redis-server on %s did not answer within %v:\n%s", s.addr, nodeStartTimeout, readLog(logPath))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// loaded reports whether the server has finished loading its data.
func (s *redisServer) loaded() bool {
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	info, err := c.Info(ctx, "persistence").Result()
	return err == nil && lacking(info, []string{"loading:0"}) == ""
}

// shutdown stops the server as an operator would, with SHUTDOWN (which
// flushes the append-only file), and waits until it has exited.
func (s *redisServer) shutdown(ctx context.Context) error {
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer c.Close()
	// SHUTDOWN answers nothing when it succeeds: the connection closes.
	if err := c.Shutdown(ctx).Err(); err != nil && !isClosedConn(err) {
		return fmt.Errorf("SHUTDOWN %s: %w", s.addr, err)
	}
	select {
	case <-s.exited:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("redis-server on %s still running after SHUTDOWN: %w", s.addr, ctx.Err())
	}
}

func isClosedConn(err error) bool {
	s := err.Error()
	return strings.Contains(s, "EOF") || strings.Contains(s, "connection reset") || strings.Contains(s, "closed")
}

// restart starts the server again on the same port and directory.
func (s *redisServer) restart() error {
	return s.start()
}

// client returns a client of the server, closed when the test ends.
func (s *redisServer) client() *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.addr})
	s.t.Cleanup(func() { c.Close() })
	return c
}
