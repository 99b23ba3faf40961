package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// cpuTimes is the CPU time used so far by the consumer (the child: see
// child.go), by the Redis
// server (INFO cpu, user + system), by the RabbitMQ server and by the
// PostgreSQL processes that serve the run (from /proc, when they run on
// this machine). A negative value is unknown.
type cpuTimes struct {
	self, redis, rabbit, postgres time.Duration
	at                            time.Time // when they were read
	rabbitIdle                    float64   // env.rabbitIdle
}

// cpuUsage is CPU time per delivered message over a run, in microseconds
// (the same number as milliseconds per 1,000 messages); negative when
// unknown. The servers' figures are server wide: other clients of the same
// servers add to them, except RabbitMQ's idle CPU, which is subtracted.
type cpuUsage struct {
	Self   float64 `json:"consumer_us_per_msg"`
	Redis  float64 `json:"redis_us_per_msg"`
	Rabbit float64 `json:"rabbitmq_us_per_msg"`
	// Postgres: the PostgreSQL processes that serve the run (see
	// pgRun.serverPIDs), for the contenders that use it.
	Postgres float64 `json:"postgres_us_per_msg"`
}

// total returns the sum of the known figures, Postgres's only when known,
// or -1 if any of the others is unknown.
func (u cpuUsage) total() float64 {
	if u.Self < 0 || u.Redis < 0 || u.Rabbit < 0 {
		return -1
	}
	t := u.Self + u.Redis + u.Rabbit
	if u.Postgres > 0 {
		t += u.Postgres
	}
	return t
}

// cpuTimes reads the CPU times, PostgreSQL's of the processes pgPIDs
// (unknown when there are none).
func (e *env) cpuTimes(ctx context.Context, pgPIDs []int) cpuTimes {
	t := cpuTimes{self: -1, redis: -1, rabbit: -1, postgres: processesCPU(pgPIDs), at: time.Now(), rabbitIdle: e.rabbitIdle}
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		t.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	if s, err := e.rdb.Info(ctx, "cpu").Result(); err == nil {
		var sum float64
		var n int
		for line := range strings.SplitSeq(s, "\n") {
			k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
			if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
				if f, err := strconv.ParseFloat(v, 64); err == nil {
					sum += f
					n++
				}
			}
		}
		if n == 2 {
			t.redis = time.Duration(sum * float64(time.Second))
		}
	}
	if e.rabbitPID > 0 {
		t.rabbit = procCPU(e.rabbitPID)
	}
	return t
}

// usage returns the CPU time per message between t and later.
func (t cpuTimes) usage(later cpuTimes, messages int64) cpuUsage {
	per := func(a, b time.Duration) float64 {
		if a < 0 || b < 0 || messages == 0 {
			return -1
		}
		return float64(b-a) / float64(time.Microsecond) / float64(messages)
	}
	rabbit := later.rabbit
	if rabbit >= 0 {
		idle := time.Duration(t.rabbitIdle * float64(later.at.Sub(t.at)))
		rabbit = max(t.rabbit, rabbit-idle)
	}
	return cpuUsage{Self: per(t.self, later.self), Redis: per(t.redis, later.redis), Rabbit: per(t.rabbit, rabbit), Postgres: per(t.postgres, later.postgres)}
}

// idleSample is how long idleCPU watches RabbitMQ at start-up, and
// runIdleSample before each run. /proc counts CPU time in ticks of 10 ms,
// so 2 s resolve 0.5 % of a core, 1 s 1 %.
const (
	idleSample    = 2 * time.Second
	runIdleSample = time.Second
)

// idleCPU returns the CPU time that process pid uses per second of wall
// time over the next d, or 0 if it cannot tell.
func idleCPU(ctx context.Context, pid int, d time.Duration) float64 {
	if pid <= 0 {
		return 0
	}
	before, t0 := procCPU(pid), time.Now()
	select {
	case <-time.After(d):
	case <-ctx.Done():
		return 0
	}
	after := procCPU(pid)
	if before < 0 || after < 0 {
		return 0
	}
	return float64(after-before) / float64(time.Since(t0))
}

// listenerPID returns the process of this machine that listens on TCP
// port, or 0: the socket's inode from /proc/net/tcp and tcp6, then the
// process that holds it among its file descriptors. It is a best effort,
// for the CPU figures only. (Searching for a RabbitMQ by its command line,
// as bench did before, found the wrong one when another engineer's test
// node was running too.)
func listenerPID(port int) int {
	want := fmt.Sprintf(":%04X", port)
	inodes := make(map[string]bool)
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(table)
		if err != nil {
			continue
		}
		for line := range strings.SplitSeq(string(b), "\n") {
			f := strings.Fields(line)
			// sl local_address rem_address st ... inode (field 9)
			if len(f) > 9 && strings.HasSuffix(f[1], want) && f[3] == "0A" {
				inodes["socket:["+f[9]+"]"] = true
			}
		}
	}
	if len(inodes) == 0 {
		return 0
	}
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		fds, _ := filepath.Glob(d + "/fd/*")
		for _, fd := range fds {
			if link, err := os.Readlink(fd); err == nil && inodes[link] {
				if pid, err := strconv.Atoi(filepath.Base(d)); err == nil {
					return pid
				}
			}
		}
	}
	return 0
}

// procCPU returns the user + system CPU time of process pid, or -1.
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return -1
	}
	// The command name, in parentheses, may hold spaces: count the fields
	// after its closing parenthesis. utime and stime are fields 14 and 15.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return -1
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return -1
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return -1
	}
	const clockTick = 100 // USER_HZ: 100 on every Linux architecture Go runs on
	return time.Duration(ut+st) * time.Second / clockTick
}
