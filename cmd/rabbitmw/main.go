// Command rabbitmw is for the operators of a fleet of rabbitmw consumers:
// it lists, shows, replays, purges, exports and imports the messages of a
// work queue's dead-letter queue, tells what the store holds for a message
// key, and declares, shows and deletes a work queue's topology.
//
//	rabbitmw dlq ls -q orders
//	rabbitmw dlq show -q orders <message id>
//	rabbitmw dlq replay -q orders [--id ID]... [--error-type T] [--since S] [--until U]
//	                     [--to Q] [--dry-run] [--limit N] [--rate R]
//	                     [--reset-failures (--redis ADDR | --postgres URL)] [--history N]
//	rabbitmw dlq purge -q orders (--all | filters) [--dry-run] [--limit N]
//	rabbitmw dlq export -q orders [filters] > orders.jsonl
//	rabbitmw dlq import -q orders [--to Q] < orders.jsonl
//	rabbitmw key <message id> --redis 127.0.0.1:6379 [--prefix P] [--namespace NS]
//	rabbitmw key <message id> --postgres postgres://app@db/shop [--table T] [--namespace NS]
//	rabbitmw topology declare|delete|show -q orders [--quorum] [--delivery-limit N] [--delays 1s,5s]
//
// The server is --amqp, or else $RABBITMQ_URL, or else
// amqp://guest:guest@127.0.0.1:5672/. For a cluster, repeat --amqp or
// separate the nodes' URLs with commas (in $RABBITMQ_URL too): each
// connection goes to one node that answers. Output is a table, or JSON with
// --json. Long reads and replays draw a progress bar on standard error
// when it is a terminal.
//
// --since and --until take an RFC 3339 time or a duration before now
// ("2h"). Filters select the messages that pass them all.
//
// Exit codes:
//
//	0  done
//	1  failed: the server or the store could not be reached, or an
//	   operation failed part way (what was done is printed)
//	2  bad usage: unknown command or flag, bad value
//	3  refused, nothing changed: messages without an original queue and
//	   no --to, a queue that does not exist, a purge of everything
//	   without --all
//	4  not found: dlq show found no message with that id
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
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
  rabbitmw dlq ls|show|replay|purge|export|import -q QUEUE [flags]
  rabbitmw key ID (--redis ADDR | --postgres URL) [flags]
  rabbitmw topology declare|delete|show -q QUEUE [flags]
Run a command with -h for its flags.`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// env is what a command reads and writes.
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
}

func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	e := &env{stdin: stdin, stdout: stdout, stderr: stderr}
	var err error
	switch {
	case len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help":
		fmt.Fprintln(stdout, usage)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	case args[0] == "dlq":
		err = e.dlq(ctx, args[1:])
	case args[0] == "key":
		err = e.key(ctx, args[1:])
	case args[0] == "topology":
		err = e.topology(ctx, args[1:])
	default:
		err = usageError("unknown command %q\n%s", args[0], usage)
	}
	if err == nil {
		return exitOK
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
