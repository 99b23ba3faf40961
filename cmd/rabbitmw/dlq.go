package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	headers "github.com/rabbitmw/rabbitmw/internal/header"
	"github.com/rabbitmw/rabbitmw/middleware"
)

func (e *env) dlq(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return usageError("dlq: name a subcommand: ls, groups, show, replay, purge, export, import")
	}
	switch args[0] {
	case "ls", "list":
		return e.dlqList(ctx, args[1:])
	case "groups":
		return e.dlqGroups(ctx, args[1:])
	case "show":
		return e.dlqShow(ctx, args[1:])
	case "replay":
		return e.dlqReplay(ctx, args[1:])
	case "purge":
		return e.dlqPurge(ctx, args[1:])
	case "export":
		return e.dlqExport(ctx, args[1:])
	case "import":
		return e.dlqImport(ctx, args[1:])
	}
	return usageError("dlq: unknown subcommand %q: ls, groups, show, replay, purge, export, import", args[0])
}

// classify gives err its exit code.
func classify(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, deadletter.ErrNoDestination), errors.Is(err, deadletter.ErrOtherQueue):
		return &exitError{exitRefused, err}
	case errors.Is(err, broker.ErrQueueNotFound):
		return &exitError{exitNotFound, err}
	}
	return err
}

func needQueue(c *common, pos []string, want int) error {
	if c.queue == "" {
		return usageError("-q/--queue QUEUE is required")
	}
	if len(pos) != want {
		return usageError("unexpected arguments %q", pos[want:])
	}
	return nil
}

// A queueCommand is a subcommand that works on one work queue: its flag
// set, with the common flags (-q required) and, if it selects dead-lettered
// messages, the filter flags.
type queueCommand struct {
	*flagSet
	common
	filterFlags
}

// Which flags a queueCommand has beside the common ones.
const (
	withFilters = 1 << iota // the filter flags
	withJSON                // --json
)

// queueCommand returns the flags of subcommand name, with the flags that
// with names.
func (e *env) queueCommand(name string, with int) *queueCommand {
	q := &queueCommand{flagSet: e.newFlags(name)}
	q.common.register(q.flagSet, true)
	if with&withJSON != 0 {
		q.common.registerJSON(q.flagSet)
	}
	if with&withFilters != 0 {
		q.filterFlags.register(q.flagSet)
	}
	return q
}

// parseQueue parses args, and requires -q and no positional argument.
func (q *queueCommand) parseQueue(args []string) error {
	pos, err := q.parse(args)
	if err != nil {
		return err
	}
	return needQueue(&q.common, pos, 0)
}

// connect returns a Broker on the server, once it has answered, and the
// context to run the command under (see connectFor); closeBroker closes
// the Broker.
func (q *queueCommand) connect(ctx context.Context, e *env) (b *broker.Broker, cctx context.Context, closeBroker func(), err error) {
	return q.common.connectFor(ctx, e)
}

// list connects and lists the messages of the queue that q's filters
// select, at most limit if it is positive, with a progress bar.
func (q *queueCommand) list(ctx context.Context, e *env, limit int) ([]*deadletter.Message, error) {
	b, ctx, closeBroker, err := q.connect(ctx, e)
	if err != nil {
		return nil, err
	}
	defer closeBroker()
	bar := newProgress(e.stderr, "reading "+q.queue+".dlq")
	dls, err := deadletter.New(b).List(ctx, q.queue, deadletter.ListOptions{Filter: q.filter(), Limit: limit, Progress: bar.update})
	bar.done()
	if err != nil {
		return nil, classify(err)
	}
	warnIfCounted(e, q.queue, dls)
	return dls, nil
}

// warnIfCounted warns when the messages listed carry x-delivery-count:
// the dead-letter queue of queue is a quorum queue, which counts every
// message a listing puts back as a delivery of it (RabbitMQ before 4.3),
// and drops the message past its delivery limit.
func warnIfCounted(e *env, queue string, dls []*deadletter.Message) {
	most, counted := int64(0), false
	for _, m := range dls {
		if n, ok := headers.Integer(m.Delivery.Headers["x-delivery-count"]); ok {
			most, counted = max(most, n), true
		}
	}
	if counted {
		fmt.Fprintf(e.stderr, "rabbitmw: warning: %s.dlq is a quorum queue: each listing counts as a delivery of every message it reads (RabbitMQ before 4.3), and the most listed of these had been delivered %d time(s) before this one; past the queue's delivery limit (20 by default from RabbitMQ 4.0) RabbitMQ drops the message: raise the limit with a policy (README, Operating)\n", queue, most)
	}
}

func (e *env) dlqList(ctx context.Context, args []string) error {
	q := e.queueCommand("dlq ls", withFilters|withJSON)
	limit := q.Int("limit", 0, "list at most this many messages")
	if err := q.parseQueue(args); err != nil {
		return err
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	dls, err := q.list(ctx, e, *limit)
	if err != nil {
		return err
	}
	if q.json {
		return writeJSON(e.stdout, nonNil(dls))
	}
	e.table(dls)
	return nil
}

func (e *env) dlqGroups(ctx context.Context, args []string) error {
	q := e.queueCommand("dlq groups", withFilters|withJSON)
	if err := q.parseQueue(args); err != nil {
		return err
	}
	dls, err := q.list(ctx, e, 0)
	if err != nil {
		return err
	}
	groups := deadletter.Groups(dls)
	if q.json {
		if groups == nil {
			groups = []*deadletter.Group{}
		}
		return writeJSON(e.stdout, groups)
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "GROUP\tCOUNT\tERROR TYPE\tFIRST SEEN\tLAST SEEN\tSAMPLE\tERROR")
	for _, g := range groups {
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%s\t%s\n", g.ID, g.Count, orDash(printable(g.ErrorType)),
			stamp(g.FirstSeen), stamp(g.LastSeen), orDash(printable(g.Sample.Key)), clip(oneLine(g.Pattern), 80))
	}
	w.Flush()
	fmt.Fprintf(e.stdout, "%d group(s) of %d message(s); select one with --group GROUP\n", len(groups), len(dls))
	return nil
}

func nonNil(dls []*deadletter.Message) []*deadletter.Message {
	if dls == nil {
		return []*deadletter.Message{}
	}
	return dls
}

// table prints dead-lettered messages, one a line, their text as
// printable shows it: a dead letter comes from any publisher.
func (e *env) table(dls []*deadletter.Message) {
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tQUEUE\tATTEMPTS\tERROR TYPE\tFIRST FAILURE\tLAST FAILURE\tREPLAYS\tSIZE\tERROR")
	for _, dl := range dls {
		queue := printable(dl.Queue)
		if queue == "" {
			queue = "-"
			if dl.DeadLetteredFrom != "" {
				queue = "(" + printable(dl.DeadLetteredFrom) + ", " + printable(dl.Reason) + ")"
			}
		}
		// The malformed headers' names are the broker's own, and stay
		// outside the error's quotes.
		text := clip(oneLine(causeFirst(dl.Error)), 60)
		if len(dl.Malformed) > 0 {
			text = strings.TrimSuffix("[malformed: "+strings.Join(dl.Malformed, ", ")+"] "+text, " ")
		}
		fmt.Fprintf(w, "%s\t%s\t%d\t%s\t%s\t%s\t%d\t%d\t%s\n", orDash(printable(dl.Key)), queue, dl.Attempts, orDash(printable(dl.ErrorType)),
			stamp(dl.FirstFailure), stamp(dl.LastFailure), dl.Replays, dl.BodySize, text)
	}
	w.Flush()
	fmt.Fprintf(e.stdout, "%d message(s)\n", len(dls))
}

// legacyExhausted is Retry's reason at its limit as it read before it
// put the cause first.
var legacyExhausted = regexp.MustCompile(`^(middleware: retries exhausted after \d+ attempts): (.+)$`)

// causeFirst returns an error text with the cause first: Retry's reason
// at its limit, as written on the messages dead-lettered before it read
// cause first, turned round.
func causeFirst(text string) string {
	if m := legacyExhausted.FindStringSubmatch(text); m != nil {
		return m[2] + " (" + m[1] + ")"
	}
	return text
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// cut shortens s to n runes.
func cut(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}

// clip returns s as printable shows it, in at most n runes: if that is
// longer, the printable form of the longest start of s that leaves room
// for a "…" after it. s is escaped first and then cut, between two of its
// characters: never inside an escape, and a quoted start keeps its
// closing quote, so that what a cell shows unquotes to the start of s.
func clip(s string, n int) string {
	p := printable(s)
	if utf8.RuneCountInString(p) <= n {
		return p
	}
	shown := ""
	for i := 0; i < len(s); {
		_, size := utf8.DecodeRuneInString(s[i:])
		longer := printable(s[:i+size])
		if utf8.RuneCountInString(longer) > n-1 {
			break
		}
		shown, i = longer, i+size
	}
	return shown + "…"
}

func (e *env) dlqShow(ctx context.Context, args []string) error {
	q := e.queueCommand("dlq show", withJSON)
	pos, err := q.parse(args)
	if err != nil {
		return err
	}
	if len(pos) == 0 {
		return usageError("dlq show: name a message id (or, for a message without one, its key: the MD5 of its body, as dlq ls lists it)")
	}
	if err := needQueue(&q.common, pos, len(pos)); err != nil {
		return err
	}
	b, ctx, closeBroker, err := q.connect(ctx, e)
	if err != nil {
		return err
	}
	defer closeBroker()
	dls, err := deadletter.New(b).List(ctx, q.queue, deadletter.ListOptions{Filter: deadletter.Filter{IDs: pos}})
	if err != nil {
		return classify(err)
	}
	if len(dls) == 0 {
		return &exitError{exitNotFound, fmt.Errorf("no message with id or key %q in the dead-letter queue of %q", strings.Join(pos, ", "), q.queue)}
	}
	if q.json {
		var out []any
		for _, dl := range dls {
			m, err := deadletter.ExportMessage(q.queue+".dlq", dl.Delivery)
			if err != nil {
				return err
			}
			out = append(out, struct {
				*deadletter.Message
				Exported *deadletter.ExportedMessage `json:"message"`
			}{dl, m})
		}
		return writeJSON(e.stdout, out)
	}
	for i, dl := range dls {
		if i > 0 {
			fmt.Fprintln(e.stdout)
		}
		e.show(dl)
	}
	return nil
}

// show prints one message in full.
func (e *env) show(dl *deadletter.Message) {
	d := dl.Delivery
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	// line prints a row whose value is printable already; row prints a
	// field of the message, as printable shows it.
	line := func(k, v string) {
		if v != "" {
			fmt.Fprintf(w, "%s\t%s\n", k, v)
		}
	}
	row := func(k, v string) { line(k, printable(v)) }
	line("id", orDash(printable(dl.ID)))
	if dl.ID == "" && dl.Key != "" {
		line("key", printable(dl.Key)+" (the MD5 of the body, as the consumers' Dedup and Retry know it)")
	}
	row("queue", dl.Queue)
	row("dead-lettered from", dl.DeadLetteredFrom)
	row("reason", dl.Reason)
	row("error type", dl.ErrorType)
	row("error", dl.Error)
	row("attempts", strconv.Itoa(dl.Attempts))
	row("first failure", stamp(dl.FirstFailure))
	if dl.FirstError != dl.Error {
		row("first error", dl.FirstError)
	}
	row("last failure", stamp(dl.LastFailure))
	row("host", dl.Host)
	row("process", dl.Process)
	row("replays", strconv.Itoa(dl.Replays))
	if ms := originalExpiration(d.Headers); ms != "" {
		line("original expiration", printable(ms)+" ms (not applied in the dead-letter queue, nor on a replay)")
	}
	row("malformed headers", strings.Join(dl.Malformed, ", "))
	row("content type", d.ContentType)
	row("content encoding", d.ContentEncoding)
	row("correlation id", d.CorrelationId)
	row("type", d.Type)
	row("app id", d.AppId)
	if !d.Timestamp.IsZero() {
		row("timestamp", stamp(d.Timestamp))
	}
	row("body size", strconv.Itoa(dl.BodySize))
	w.Flush()
	fmt.Fprintln(e.stdout, "headers:")
	printTable(e.stdout, d.Headers, "  ")
	fmt.Fprintln(e.stdout, "body:")
	printBody(e.stdout, d.Body, 2048)
}

// printBody prints at most the first limit bytes of body, indented, as
// printable shows it: text a line at a time, so that it keeps its lines
// and a control character is escaped in the line that holds it; what is
// not UTF-8 on one line. The cut falls at the start of a character, if
// one begins in its last 3 bytes.
func printBody(w io.Writer, body []byte, limit int) {
	more := ""
	if len(body) > limit {
		n := limit
		for n > 0 && n > limit-utf8.UTFMax+1 && !utf8.RuneStart(body[n]) {
			n--
		}
		body, more = body[:n], fmt.Sprintf("… (%d bytes more)", len(body)-n)
	}
	lines := []string{string(body)}
	if utf8.Valid(body) {
		lines = strings.Split(strings.TrimSuffix(lines[0], "\n"), "\n")
	}
	for i, l := range lines {
		if i == len(lines)-1 {
			fmt.Fprintf(w, "  %s%s\n", printable(l), more)
		} else {
			fmt.Fprintf(w, "  %s\n", printable(l))
		}
	}
}

// originalExpiration returns the Expiration property a dead letter was
// published with, which no copy carries: from broker.HeaderOriginalExpiration,
// or else from the first x-death record with one (RabbitMQ's own
// dead-lettering keeps it there); "" if none.
func originalExpiration(h amqp.Table) string {
	if v, ok := h[broker.HeaderOriginalExpiration].(string); ok {
		return v
	}
	deaths, _ := h["x-death"].([]any)
	for _, d := range deaths {
		if r, ok := d.(amqp.Table); ok {
			if v, ok := r["original-expiration"].(string); ok {
				return v
			}
		}
	}
	return ""
}

// printTable prints headers with their types, sorted, nested tables
// indented.
func printTable(w interface{ Write([]byte) (int, error) }, t amqp.Table, indent string) {
	for _, k := range slices.Sorted(maps.Keys(t)) {
		printValue(w, printable(k), t[k], indent)
	}
}

// printValue prints v, named k (printable already), a string as
// printable shows it.
func printValue(w interface{ Write([]byte) (int, error) }, k string, v any, indent string) {
	switch x := v.(type) {
	case amqp.Table:
		fmt.Fprintf(w, "%s%s (table):\n", indent, k)
		printTable(w, x, indent+"  ")
	case []any:
		fmt.Fprintf(w, "%s%s (array of %d):\n", indent, k, len(x))
		for i, e := range x {
			printValue(w, "["+strconv.Itoa(i)+"]", e, indent+"  ")
		}
	case time.Time:
		fmt.Fprintf(w, "%s%s (timestamp): %s\n", indent, k, stamp(x))
	case []byte:
		fmt.Fprintf(w, "%s%s (bytes): %q\n", indent, k, x)
	case string:
		fmt.Fprintf(w, "%s%s: %s\n", indent, k, printable(x))
	default:
		fmt.Fprintf(w, "%s%s (%T): %v\n", indent, k, v, v)
	}
}

func (e *env) dlqReplay(ctx context.Context, args []string) error {
	q := e.queueCommand("dlq replay", withFilters|withJSON)
	all := q.Bool("all", false, "replay every message (required without a filter)")
	var sf storeFlags
	sf.register(q.flagSet)
	to := q.String("to", "", "send the messages to this queue (required for messages that have no original queue, or name another queue than -q)")
	dry := q.Bool("dry-run", false, "list what would be replayed, and move nothing")
	limit := q.Int("limit", 0, "replay at most this many messages")
	rate := q.Float64("rate", 0, "replay at most this many messages a second")
	hold := q.Duration("hold-limit", 0, "hold no message of the DLQ unacknowledged longer than this, below the server's consumer_timeout (default 10m)")
	reset := q.Bool("reset-failures", false, "reset each message's failure count in the store (needs --redis or --postgres)")
	history := q.Int("history", 0, "earlier lives kept in the history header (default 5)")
	if err := q.parseQueue(args); err != nil {
		return err
	}
	if *limit < 0 || *rate < 0 || *hold < 0 {
		return usageError("--limit, --rate and --hold-limit must not be negative")
	}
	if err := q.everything(*all, "replay"); err != nil {
		return err
	}
	opts := deadletter.ReplayOptions{Filter: q.filter(), To: *to, DryRun: *dry, Limit: *limit, Rate: *rate, HoldLimit: *hold, HistoryLimit: *history}
	if *reset {
		st, closeStore, err := sf.open(ctx, e.timeout)
		if err != nil {
			return err
		}
		defer closeStore()
		opts.ResetFailures = func(ctx context.Context, d *amqp.Delivery) error {
			k, err := middleware.Key(d)
			if err != nil {
				return nil // nothing was ever counted under no key
			}
			return st.ResetFailures(ctx, sf.key(k))
		}
	}
	b, ctx, closeBroker, err := q.connect(ctx, e)
	if err != nil {
		return err
	}
	defer closeBroker()
	scan := newProgress(e.stderr, "reading "+q.queue+".dlq")
	bar := newProgress(e.stderr, "replaying")
	opts.ScanProgress = scan.update
	opts.Progress = func(done, total int) {
		scan.done()
		bar.update(done, total)
	}
	res, err := deadletter.New(b).Replay(ctx, q.queue, opts)
	scan.done()
	bar.done()
	if q.json {
		if jerr := writeJSON(e.stdout, struct {
			Scanned  int                   `json:"scanned"`
			Selected []*deadletter.Message `json:"selected"`
			Replayed int                   `json:"replayed"`
			InDoubt  []*deadletter.Message `json:"in_doubt,omitempty"`
			DryRun   bool                  `json:"dry_run"`
			Error    string                `json:"error,omitempty"`
		}{res.Scanned, nonNil(res.Selected), res.Replayed, res.InDoubt, *dry, errText(err)}); jerr != nil {
			return jerr
		}
	} else if err == nil || res.Replayed > 0 {
		if *dry {
			e.table(res.Selected)
			fmt.Fprintf(e.stdout, "dry run: would replay %d of %d message(s) in %s.dlq\n", len(res.Selected), res.Scanned, q.queue)
		} else {
			fmt.Fprintf(e.stdout, "replayed %d of %d selected message(s) (%d in %s.dlq)\n", res.Replayed, len(res.Selected), res.Scanned, q.queue)
		}
	}
	if len(res.InDoubt) > 0 {
		dest := q.queue
		if *to != "" {
			dest = *to
		}
		var ids []string
		for _, dl := range res.InDoubt {
			ids = append(ids, strconv.Quote(dl.ID))
		}
		fmt.Fprintf(e.stderr, "rabbitmw: %d message(s) sent to %s and not confirmed may be both there and still in %s.dlq: %s; a replay sends them again, with the same message id, which the consumers' Dedup absorbs\n",
			len(ids), dest, q.queue, strings.Join(ids, ", "))
	}
	return classify(err)
}

// checkLimit refuses a negative --limit, which the library takes for no
// limit: for a purge, a slip that removes everything.
func checkLimit(limit int) error {
	if limit < 0 {
		return usageError("--limit must not be negative")
	}
	return nil
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func (e *env) dlqPurge(ctx context.Context, args []string) error {
	q := e.queueCommand("dlq purge", withFilters|withJSON)
	all := q.Bool("all", false, "remove every message (required without a filter)")
	dry := q.Bool("dry-run", false, "list what would be removed, and remove nothing")
	limit := q.Int("limit", 0, "remove at most this many messages")
	if err := q.parseQueue(args); err != nil {
		return err
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	if err := q.everything(*all, "purge"); err != nil {
		return err
	}
	b, ctx, closeBroker, err := q.connect(ctx, e)
	if err != nil {
		return err
	}
	defer closeBroker()
	bar := newProgress(e.stderr, "reading "+q.queue+".dlq")
	removed, err := deadletter.New(b).Purge(ctx, q.queue, deadletter.PurgeOptions{Filter: q.filter(), DryRun: *dry, Limit: *limit, ScanProgress: bar.update})
	bar.done()
	if q.json {
		if jerr := writeJSON(e.stdout, struct {
			Removed []*deadletter.Message `json:"removed"`
			DryRun  bool                  `json:"dry_run"`
			Error   string                `json:"error,omitempty"`
		}{nonNil(removed), *dry, errText(err)}); jerr != nil {
			return jerr
		}
	} else {
		e.table(removed)
		if *dry {
			fmt.Fprintf(e.stdout, "dry run: would remove %d message(s)\n", len(removed))
		} else {
			fmt.Fprintf(e.stdout, "removed %d message(s)\n", len(removed))
		}
	}
	return classify(err)
}

func (e *env) dlqExport(ctx context.Context, args []string) error {
	q := e.queueCommand("dlq export", withFilters)
	limit := q.Int("limit", 0, "export at most this many messages")
	if err := q.parseQueue(args); err != nil {
		return err
	}
	if err := checkLimit(*limit); err != nil {
		return err
	}
	b, ctx, closeBroker, err := q.connect(ctx, e)
	if err != nil {
		return err
	}
	defer closeBroker()
	bar := newProgress(e.stderr, "exporting "+q.queue+".dlq")
	// What is counted is what reached the output, a line a message: not
	// what a write that failed left in the buffer.
	out := &lineCounter{w: e.stdout}
	w := bufio.NewWriter(out)
	_, err = deadletter.New(b).Export(ctx, q.queue, w, deadletter.ExportOptions{Filter: q.filter(), Limit: *limit, Progress: bar.update})
	bar.done()
	if ferr := w.Flush(); err == nil {
		err = ferr
	}
	fmt.Fprintf(e.stderr, "exported %d message(s)\n", out.lines)
	return classify(err)
}

// A lineCounter counts the whole lines written through it to w.
type lineCounter struct {
	w     io.Writer
	lines int
}

func (c *lineCounter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.lines += bytes.Count(p[:n], []byte("\n"))
	return n, err
}

func (e *env) dlqImport(ctx context.Context, args []string) error {
	q := e.queueCommand("dlq import", 0)
	to := q.String("to", "", "publish to this queue instead of the dead-letter queue")
	dup := q.Bool("allow-duplicates", false, "import messages whose id is still in the target dead-letter queue")
	if err := q.parseQueue(args); err != nil {
		return err
	}
	b, ctx, closeBroker, err := q.connect(ctx, e)
	if err != nil {
		return err
	}
	defer closeBroker()
	stdin := readUntil(ctx, e.stdin)
	defer stdin.Close()
	var in io.Reader = bufio.NewReaderSize(stdin, 1<<20)
	// The target is checked when it is a dead-letter queue, which nothing
	// consumes: --to a work queue is not, whose consumers take what is
	// there as it arrives.
	target, isDLQ := q.queue, true
	if *to != "" {
		target, isDLQ = strings.CutSuffix(*to, ".dlq")
	}
	if isDLQ && !*dup {
		// The whole file is read first, to refuse it before anything is
		// published.
		data, err := io.ReadAll(in)
		if err != nil {
			return fmt.Errorf("dlq import: reading the input: %w; nothing imported", err)
		}
		ids, err := messageIDs(data)
		if err != nil {
			return err
		}
		if err := e.refuseDuplicates(ctx, b, target, ids); err != nil {
			return err
		}
		in = bytes.NewReader(data)
	}
	bar := newProgress(e.stderr, "importing")
	n, err := deadletter.New(b).Import(ctx, q.queue, in, deadletter.ImportOptions{To: *to, Progress: func(n int) { bar.update(n, 0) }})
	bar.done()
	fmt.Fprintf(e.stderr, "imported %d message(s)\n", n)
	return classify(err)
}

// readUntil returns r, to be read until ctx ends: then a read, one that
// waits included (a terminal nobody types into, a pipe whose writer is
// slow), fails with ctx's cause, so that Ctrl-C stops the command. Close
// must be called. r is read, from the first read on, by a goroutine that
// ends at r's end, or at the first read of r that returns after Close or
// ctx's end.
func readUntil(ctx context.Context, r io.Reader) io.ReadCloser {
	pr, pw := io.Pipe()
	u := &untilReader{pr: pr}
	u.start = sync.OnceFunc(func() {
		go func() {
			_, err := io.Copy(pw, r)
			pw.CloseWithError(err)
		}()
	})
	u.stop = context.AfterFunc(ctx, func() { pw.CloseWithError(context.Cause(ctx)) })
	return u
}

type untilReader struct {
	pr    *io.PipeReader
	start func()
	stop  func() bool
}

func (u *untilReader) Read(p []byte) (int, error) {
	u.start()
	return u.pr.Read(p)
}

func (u *untilReader) Close() error {
	u.stop()
	return u.pr.Close()
}

// messageIDs returns the message ids of the export data, or an error
// that names the first line that is not an exported message (the import
// would stop there, the lines before it published).
func messageIDs(data []byte) ([]string, error) {
	var ids []string
	n := 0
	for line := range bytes.Lines(data) {
		n++
		if len(bytes.TrimRight(line, "\r\n")) == 0 { // as Import skips it
			continue
		}
		var m deadletter.ExportedMessage
		err := json.Unmarshal(line, &m)
		if err == nil {
			_, err = m.Publishing()
		}
		if err != nil {
			return nil, fmt.Errorf("dlq import: line %d: %w: nothing imported", n, err)
		}
		if m.Properties.MessageID != "" {
			ids = append(ids, m.Properties.MessageID)
		}
	}
	return ids, nil
}

// refuseDuplicates returns an error if a message of the export data, of
// message ids ids, has the id of a message in the dead-letter queue of
// queue: an import would double it.
func (e *env) refuseDuplicates(ctx context.Context, b *broker.Broker, queue string, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	bar := newProgress(e.stderr, "reading "+queue+".dlq")
	there, err := deadletter.New(b).List(ctx, queue, deadletter.ListOptions{Filter: deadletter.Filter{IDs: ids}, Progress: bar.update})
	bar.done()
	if err != nil {
		return classify(err)
	}
	if len(there) == 0 {
		return nil
	}
	var some []string
	for _, dl := range there[:min(len(there), 5)] {
		some = append(some, strconv.Quote(dl.ID))
	}
	return &exitError{exitRefused, fmt.Errorf("dlq import: %d message(s) of the file are still in %s.dlq (%s): nothing imported; pass --allow-duplicates to import them again", len(there), queue, strings.Join(some, ", "))}
}

// everything returns an error if the command has no filter and all is
// false: a replay or purge of everything must say so.
func (q *queueCommand) everything(all bool, verb string) error {
	switch {
	case all && !q.empty():
		return usageError("dlq %s: --all selects every message: drop it, or the filters", verb)
	case !all && q.empty():
		return &exitError{exitRefused, fmt.Errorf("dlq %s: no filter given: pass --all to %s every message", verb, verb)}
	}
	return nil
}
