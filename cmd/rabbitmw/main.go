// Command rabbitmw is for the operators of a fleet of rabbitmw consumers:
// it lists, shows, replays, purges, exports and imports the messages of a
// work queue's dead-letter queue, tells what the store holds for a message
// key, and declares, shows and deletes a work queue's topology.
//
//	rabbitmw dlq ls -q orders                 (-q is short for --queue)
//	rabbitmw dlq groups -q orders [filters]    (failures by type and masked text)
//	rabbitmw dlq show -q orders <message id, or key of a message without one>
//	rabbitmw dlq replay -q orders (--all | [--id ID]... [--error-type T] [--error TEXT] [--group G] [--since S] [--until U])
//	                     [--to Q] [--dry-run] [--limit N] [--rate R]
//	                     [--reset-failures (--redis ADDR | --postgres URL)] [--history N]
//	rabbitmw dlq purge -q orders (--all | filters) [--dry-run] [--limit N]
//	rabbitmw dlq export -q orders [filters] > orders.jsonl
//	rabbitmw dlq import -q orders [--to Q] [--allow-duplicates] < orders.jsonl
//	rabbitmw key <message id> --redis 127.0.0.1:6379 [--prefix P] [--namespace NS]
//	rabbitmw key <message id> --postgres postgres://app@db/shop [--table T] [--namespace NS]
//	rabbitmw topology declare|delete|show -q orders [--quorum] [--delivery-limit N] [--delays 1s,5s]
//	                  (delete refuses queues that hold messages without --force)
//	rabbitmw outbox ls --postgres postgres://app@db/shop [--table T] [--state pending|sent|parked] [--after ID] [--limit N]
//	rabbitmw outbox stats --postgres URL [--table T]
//	rabbitmw outbox retry --postgres URL [--table T] (--all | --id ID...)
//	rabbitmw ui -q orders [-q payments]... [--listen ADDR] [--token T | --basic-auth U:P] [--read-only]
//	             [--redis ADDR | --postgres URL] [--delays 1s,5s]
//
// ui serves a web console on --listen (default 127.0.0.1:8080): the
// queues with their depth and consumers, each dead-letter queue's
// failures grouped by error type and masked text, each message in full,
// replay, purge and export of a selection or a group, and key lookups in
// the store. On an address that is not loopback it requires --token or
// --basic-auth; every action carries a form token and is refused from
// another origin; --read-only refuses them all.
//
// The server is --amqp, or else $RABBITMQ_URL, or else
// amqp://guest:guest@127.0.0.1:5672/. For a cluster, repeat --amqp or
// separate the nodes' URLs with commas (in $RABBITMQ_URL too): each
// connection goes to a node that answers. A server that does not answer
// within --timeout (default 10s) fails the command, at its start or
// midway (once it has been unreachable that long). Output is a table, or
// JSON with --json. Long reads and replays draw a progress bar on standard
// error, from their start, when it is a terminal. Each command's -h lists
// its flags; rabbitmw --version prints the version.
//
// --since and --until take an RFC 3339 time or a duration before now
// ("2h"). Filters select the messages that pass them all.
//
// Replayed and imported messages carry no Expiration: nothing in a
// dead-letter queue expires, and a replayed message does not expire on its
// way back to its handler. The per-message TTL a message was published
// with stays in its x-rabbitmw-original-expiration header, which dlq show
// prints.
//
// A command interrupted (Ctrl-C, SIGTERM) sends nothing more, and waits up
// to 5 s for what it has in flight (a replay's or an import's messages
// sent and not yet confirmed, a purge's acknowledgements), so that each
// message ends in one queue; a second interrupt stops it at once, and it
// names the messages it gave up on: a replay's may be both in their
// destination and still in the dead-letter queue.
//
// Exit codes:
//
//	0  done
//	1  failed: the server or the store could not be reached, or an
//	   operation failed or was interrupted (Ctrl-C, SIGTERM) part way
//	   (what was done is printed)
//	130, 143  stopped at once by a second Ctrl-C (SIGINT), or SIGTERM:
//	   128 + the signal's number
//	2  bad usage: unknown command or flag, bad value
//	3  refused, nothing changed: messages without an original queue, or
//	   whose original queue is not the one whose dead-letter queue holds
//	   them, and no --to, a replay or purge of everything without --all, an import
//	   of messages still in the queue without --allow-duplicates, a
//	   topology delete of queues that hold messages without --force
//	4  not found: a queue that does not exist, or no message with that id
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// Exit codes.
const (
	exitOK       = 0
	exitFailed   = 1
	exitUsage    = 2
	exitRefused  = 3
	exitNotFound = 4
)

// An exitError carries an exit code.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func usageError(format string, args ...any) error {
	return &exitError{exitUsage, fmt.Errorf(format, args...)}
}

const usage = `usage:
  rabbitmw dlq ls|groups|show|replay|purge|export|import -q QUEUE [flags]
  rabbitmw key ID (--redis ADDR | --postgres URL) [flags]
  rabbitmw topology declare|delete|show -q QUEUE [flags]
  rabbitmw ui -q QUEUE [-q QUEUE]... [--listen 127.0.0.1:8080] [flags]
  rabbitmw outbox ls|stats|retry --postgres URL [flags]
  rabbitmw --version
Run a command with -h for its flags.`

// version is the command's version; the build sets it
// (-ldflags "-X main.version=v1.2.3"), or else the module's.
var version string

func main() {
	// The command reports what failed itself, once: go-redis's own lines
	// (a pool that cannot dial) would repeat it.
	redis.SetLogger(redisstore.Logging(nil))
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	ctx, interrupted := watchInterrupts(context.Background(), sigs, os.Stderr)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	signal.Stop(sigs)
	if second, ok := interrupted.stop().(syscall.Signal); ok && code != exitOK {
		fmt.Fprintf(os.Stderr, "rabbitmw: stopped at once by a second %v: what was in flight was not waited for\n", second)
		code = 128 + int(second)
	}
	os.Exit(code)
}

// env is what a command reads and writes.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	timeout        time.Duration // --timeout

	mu   sync.Mutex
	lost error // why the command's context ended: a server gone (see connectFor)
}

// setLost records err as the reason the command's context ended.
func (e *env) setLost(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.lost == nil {
		e.lost = err
	}
}

// lostErr returns the reason setLost recorded, or nil.
func (e *env) lostErr() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lost
}

func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	e := &env{stdin: stdin, stdout: stdout, stderr: stderr}
	var err error
	switch {
	case len(args) == 0:
		fmt.Fprintln(stderr, usage) // bad usage, as the flag package reports it
		return exitUsage
	case args[0] == "-h" || args[0] == "--help" || args[0] == "help":
		fmt.Fprintln(stdout, usage)
		return exitOK
	case args[0] == "--version" || args[0] == "-version" || args[0] == "version":
		fmt.Fprintln(stdout, "rabbitmw", versionText())
		return exitOK
	case args[0] == "dlq":
		err = e.dlq(ctx, args[1:])
	case args[0] == "key":
		err = e.key(ctx, args[1:])
	case args[0] == "topology":
		err = e.topology(ctx, args[1:])
	case args[0] == "ui":
		err = e.ui(ctx, args[1:])
	case args[0] == "outbox":
		err = e.outbox(ctx, args[1:])
	default:
		err = usageError("unknown command %q; see 'rabbitmw -h'", args[0])
	}
	if err == nil {
		return exitOK
	}
	if lost := e.lostErr(); lost != nil {
		// The command failed because its server went away: that is what
		// to say, rather than the context's end it caused.
		err = lost
	} else if ctx.Err() != nil {
		// Interrupted (Ctrl-C, SIGTERM): that is what to say, rather than
		// the "context canceled" of whatever step it was at.
		cause := context.Cause(ctx)
		if err.Error() == cause.Error() {
			err = fmt.Errorf("interrupted (%w)", cause)
		} else {
			err = fmt.Errorf("interrupted (%v): %w", cause, err)
		}
	}
	var ee *exitError
	if errors.As(err, &ee) && ee.code == exitOK {
		return exitOK // -h: the flag package printed the usage
	}
	fmt.Fprintln(stderr, "rabbitmw: "+err.Error())
	if ee != nil {
		return ee.code
	}
	return exitFailed
}

// versionText returns the version, the commit and the Go release the
// command was built from.
func versionText() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return orDash(version)
	}
	v := version
	if v == "" {
		v = bi.Main.Version
	}
	var rev, modified string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				modified = ", modified"
			}
		}
	}
	if len(rev) > 12 {
		rev = rev[:12]
	}
	if rev != "" {
		v += " (commit " + rev + modified + ")"
	}
	return v + " " + bi.GoVersion
}
