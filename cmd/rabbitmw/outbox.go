package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// outbox runs rabbitmw outbox ls|stats|retry: the rows of a pgstore
// outbox, their counts by state, and parked rows sent back to pending
// (and pending rows that wait after a failed send sent at once).
func (e *env) outbox(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return usageError("outbox: name a command: ls, stats or retry")
	}
	name := "outbox " + args[0]
	fs := e.newFlags(name)
	pg := fs.String("postgres", "", "PostgreSQL URL (postgres://...) of the outbox's database")
	table := fs.String("table", "", "pgstore OutboxOptions.Table (default "+strconv.Quote(pgstore.DefaultOutboxTable)+")")
	asJSON := fs.Bool("json", false, "print JSON instead of a table")
	var state string
	var after int64
	var limit int
	var all bool
	var ids list
	switch args[0] {
	case "ls":
		fs.StringVar(&state, "state", "", "only rows in this state: pending, sent or parked")
		fs.Int64Var(&after, "after", 0, "only rows whose id is greater (for the next page)")
		fs.IntVar(&limit, "limit", 100, "list at most this many rows")
	case "stats":
	case "retry":
		fs.BoolVar(&all, "all", false, "send every parked row back to pending, and every pending row that waits after a failed send at once")
		fs.Var(&ids, "id", "send the parked row with this id back to pending, or the pending row that waits after a failed send at once (repeatable, comma-separated)")
	default:
		return usageError("outbox: unknown command %q: want ls, stats or retry", args[0])
	}
	pos, err := fs.parse(args[1:])
	if err != nil {
		return err
	}
	if len(pos) > 0 {
		return usageError("%s: unexpected argument %q", name, pos[0])
	}
	if *pg == "" {
		return usageError("%s: --postgres is required", name)
	}
	var rowIDs []int64
	if args[0] == "retry" {
		for _, s := range ids {
			id, err := strconv.ParseInt(s, 10, 64)
			if err != nil {
				return usageError("outbox retry: --id %q: want a row id (a number; see rabbitmw outbox ls --state parked)", s)
			}
			rowIDs = append(rowIDs, id)
		}
		switch {
		case all && len(rowIDs) > 0:
			return usageError("outbox retry: --all or --id, not both")
		case !all && len(rowIDs) == 0:
			return &exitError{exitRefused, errors.New("outbox retry: name the rows (--id) or say --all; nothing changed")}
		}
	}
	ob, closePool, err := openOutbox(ctx, *pg, *table, e.timeout)
	if err != nil {
		return err
	}
	defer closePool()

	switch args[0] {
	case "ls":
		rows, err := ob.List(ctx, pgstore.OutboxFilter{State: state, AfterID: after, Limit: limit})
		if err != nil {
			return err
		}
		if *asJSON {
			type row struct {
				ID        int64      `json:"id"`
				MessageID string     `json:"message_id"`
				Exchange  string     `json:"exchange"`
				Key       string     `json:"routing_key"`
				State     string     `json:"state"`
				Created   time.Time  `json:"created_at"`
				Attempts  int        `json:"attempts"`
				SentAt    *time.Time `json:"sent_at,omitempty"`
				Error     string     `json:"error,omitempty"`
				RetryAt   *time.Time `json:"retry_at,omitempty"`
				BodySize  int        `json:"body_size"`
			}
			out := make([]row, 0, len(rows))
			for _, r := range rows {
				x := row{r.ID, r.MessageID, r.Exchange, r.Key, r.State, r.Created, r.Attempts, nil, r.Error, nil, r.BodySize}
				if !r.SentAt.IsZero() {
					x.SentAt = &r.SentAt
				}
				if !r.RetryAt.IsZero() {
					x.RetryAt = &r.RetryAt
				}
				out = append(out, x)
			}
			return writeJSON(e.stdout, out)
		}
		w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "ID\tSTATE\tMESSAGE ID\tEXCHANGE\tROUTING KEY\tCREATED\tATTEMPTS\tNEXT ATTEMPT\tBYTES\tERROR")
		for _, r := range rows {
			ex := printable(r.Exchange)
			if ex == "" {
				ex = `""`
			}
			next := "-"
			if !r.RetryAt.IsZero() {
				next = r.RetryAt.UTC().Format(time.RFC3339)
			}
			fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\t%d\t%s\t%d\t%s\n", r.ID, printable(r.State), printable(r.MessageID), ex, printable(r.Key),
				r.Created.UTC().Format(time.RFC3339), r.Attempts, next, r.BodySize, printable(r.Error))
		}
		if err := w.Flush(); err != nil {
			return err
		}
		if len(rows) == limit {
			fmt.Fprintf(e.stderr, "more rows may follow: --after %d\n", rows[len(rows)-1].ID)
		}
		return nil
	case "stats":
		s, err := ob.Stats(ctx)
		if err != nil {
			return err
		}
		if *asJSON {
			return writeJSON(e.stdout, struct {
				Pending       int64   `json:"pending"`
				Parked        int64   `json:"parked"`
				Sent          int64   `json:"sent"`
				OldestPending float64 `json:"oldest_pending_seconds"`
			}{s.Pending, s.Parked, s.Sent, s.OldestPending.Seconds()})
		}
		w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintf(w, "pending\t%d\n", s.Pending)
		if s.Pending > 0 {
			fmt.Fprintf(w, "oldest pending\t%s\n", s.OldestPending.Round(time.Millisecond))
		}
		fmt.Fprintf(w, "parked\t%d\n", s.Parked)
		fmt.Fprintf(w, "sent (kept for the relays' retention)\t%d\n", s.Sent)
		return w.Flush()
	}
	// retry
	n, err := ob.Retry(ctx, rowIDs)
	if err != nil {
		return err
	}
	if *asJSON {
		if err := writeJSON(e.stdout, struct {
			Retried int64 `json:"retried"`
		}{n}); err != nil {
			return err
		}
	} else {
		fmt.Fprintf(e.stdout, "%d row(s) to send now (parked back to pending, or pending and waiting)\n", n)
	}
	if n == 0 && len(rowIDs) > 0 {
		return &exitError{exitNotFound, errors.New("outbox retry: no parked row, nor pending row waiting, with the ids given")}
	}
	return nil
}

// openOutbox opens the outbox of url and table, and checks that the
// database answers and holds the table.
func openOutbox(ctx context.Context, url, table string, timeout time.Duration) (ob *pgstore.Outbox, closePool func(), err error) {
	pool, ping, err := openPool(ctx, url, timeout)
	if err != nil {
		return nil, nil, err
	}
	func() {
		defer func() { // NewOutbox panics on a bad name: here, the operator's typing
			if r := recover(); r != nil {
				err = usageError("--table: %v", r)
			}
		}()
		ob = pgstore.NewOutbox(pool, pgstore.OutboxOptions{Table: table})
	}()
	if err == nil {
		err = ping(ctx)
	}
	if err == nil {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		err = ob.Check(cctx)
		cancel()
	}
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return ob, pool.Close, nil
}
