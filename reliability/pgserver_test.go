//go:build reliability

package reliability_test

// A PostgreSQL cluster of the test's own: initdb into a temporary
// directory, the postgres server on a spare loopback port, run as a child
// process that the test may stop and start again on the same port and
// data directory. PostgreSQL refuses to run as root: under root, initdb
// and postgres run as the postgres user.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

type pgServer struct {
	t      *testing.T
	bin    string // the directory of initdb and postgres
	dir    string // the data directory
	port   string
	url    string
	cred   *syscall.Credential // nil unless run as root
	starts int

	*child // the running server, replaced at each start
}

// pgBin returns the directory of PostgreSQL's server programs: the one of
// pg_config --bindir, else the newest /usr/lib/postgresql/*/bin.
func pgBin(t *testing.T) string {
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if dir := strings.TrimSpace(string(out)); fileExists(filepath.Join(dir, "initdb")) {
			return dir
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	for i := len(dirs) - 1; i >= 0; i-- {
		if fileExists(filepath.Join(dirs[i], "initdb")) {
			return dirs[i]
		}
	}
	testenv.Missing(t, "PostgreSQL's initdb and postgres", "install the PostgreSQL server, e.g. apt-get install postgresql")
	return ""
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// startPostgresServer initdbs a cluster in a temporary directory and
// starts it on a free loopback port, trust authentication, fsync off (the
// test stops the server, it does not crash the machine).
func startPostgresServer(t *testing.T) *pgServer {
	t.Helper()
	s := &pgServer{t: t, bin: pgBin(t), dir: filepath.Join(t.TempDir(), "data")}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			testenv.Missing(t, "a postgres user to run PostgreSQL as (it refuses root)", err.Error())
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		// The postgres user must reach the directory: the temporary
		// directories above it are the test's own.
		require.NoError(t, os.Chmod(filepath.Dir(s.dir), 0o777))
		require.NoError(t, os.Chmod(filepath.Dir(filepath.Dir(s.dir)), 0o711))
	}
	out, err := s.command(filepath.Join(s.bin, "initdb"), "-D", s.dir, "-U", "postgres", "-A", "trust", "--no-sync", "-E", "UTF8").CombinedOutput()
	if err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	for attempt := 1; ; attempt++ {
		ports, err := freePorts(1)
		require.NoError(t, err)
		s.port = strconv.Itoa(ports[0])
		s.url = "postgres://postgres@127.0.0.1:" + s.port + "/postgres?sslmode=disable"
		if err = s.start(); err == nil {
			return s
		}
		if attempt == portAttempts {
			t.Fatalf("starting postgres (attempt %d of %d): %v", attempt, portAttempts, err)
		}
	}
}

func (s *pgServer) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	attr := childAttr()
	attr.Credential = s.cred
	cmd.SysProcAttr = attr
	return cmd
}

// start starts the server and waits until it answers a query.
func (s *pgServer) start() error {
	s.starts++
	logPath := filepath.Join(filepath.Dir(s.dir), fmt.Sprintf("postgres-%d.log", s.starts))
	logFile, err := os.Create(logPath)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd := s.command(filepath.Join(s.bin, "postgres"), "-D", s.dir, "-p", s.port, "-h", "127.0.0.1", "-k", filepath.Dir(s.dir), "-F", "-c", "max_connections=50")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if s.child, err = startChild(s.t, cmd, func(c *child) {
		c.cmd.Process.Signal(syscall.SIGQUIT)
		if !c.wait(10 * time.Second) {
			c.kill()
		}
	}); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		select {
		case <-s.exited:
			return fmt.Errorf("postgres on port %s exited at start:\n%s", s.port, readLog(logPath))
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, s.url)
		if err == nil {
			err = conn.Ping(ctx)
			conn.Close(ctx)
		}
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("postgres on port %s did not answer within 30s: %v\n%s", s.port, err, readLog(logPath))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop stops the server at once, as a crash would (SIGQUIT: immediate
// shutdown, crash recovery at the next start), and waits until it exited.
func (s *pgServer) stop() error {
	s.cmd.Process.Signal(syscall.SIGQUIT)
	if !s.wait(30 * time.Second) {
		return fmt.Errorf("postgres on port %s still running 30s after SIGQUIT", s.port)
	}
	return nil
}
