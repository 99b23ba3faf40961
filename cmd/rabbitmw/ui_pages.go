package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"html/template"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/middleware"
)

var templateFuncs = template.FuncMap{
	"stamp": func(t time.Time) string {
		if t.IsZero() {
			return "-"
		}
		return t.UTC().Format("2006-01-02 15:04:05Z")
	},
	"ago": func(t time.Time) string {
		if t.IsZero() {
			return ""
		}
		return time.Since(t).Round(time.Second).String() + " ago"
	},
	"cut":    cut,
	"join":   strings.Join,
	"orDash": orDash,
}

func (c *console) queuesPage(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := c.ctx(r)
	defer cancel()
	type section struct {
		Queue string
		Rows  []queueRow
	}
	var sections []section
	for _, q := range c.queues {
		names, err := c.top.Queues(q)
		if err != nil {
			c.fail(w, r, err)
			return
		}
		rows, err := c.stats.read(ctx, names)
		if err != nil {
			c.fail(w, r, err)
			return
		}
		sections = append(sections, section{q, rows})
	}
	c.render(w, r, "queues", map[string]any{"Title": "queues", "Sections": sections})
}

// maxRows is the most messages a dead-letter queue's page lists.
const maxRows = 1000

func (c *console) dlqPage(ctx context.Context, w http.ResponseWriter, r *http.Request, q string) {
	msgs, err := c.dl.List(ctx, q, deadletter.ListOptions{})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// The groups count every message; the table shows the first ones.
	shown := msgs[:min(len(msgs), maxRows)]
	c.render(w, r, "dlq", map[string]any{"Title": q + ".dlq", "Queue": q, "Groups": deadletter.Groups(msgs),
		"Count": len(msgs), "Messages": shown, "Hidden": len(msgs) - len(shown)})
}

// A header is one header of a message, with its AMQP type.
type header struct {
	Name, Type, Value string
}

// A life is one life of a message: its fault headers as it was
// dead-lettered.
type life struct {
	Title   string
	Headers []header
}

func (c *console) messagePage(ctx context.Context, w http.ResponseWriter, r *http.Request, q string) {
	id := r.FormValue("id")
	msgs, err := c.dl.List(ctx, q, deadletter.ListOptions{Filter: deadletter.Filter{IDs: []string{id}}})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if len(msgs) == 0 {
		c.fail(w, r, &exitError{exitNotFound, fmt.Errorf("no message with id %q in the dead-letter queue of %q", id, q)})
		return
	}
	m := msgs[0]
	exported, err := deadletter.ExportMessage(q+".dlq", m.Delivery)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var headers []header
	for _, k := range slices.Sorted(maps.Keys(exported.Headers)) {
		if k == deadletter.HeaderHistory {
			continue
		}
		tv := exported.Headers[k]
		headers = append(headers, header{k, tv.Type, typedText(tv.Value)})
	}
	var props []header
	add := func(k, v string) {
		if v != "" {
			props = append(props, header{Name: k, Value: v})
		}
	}
	p := exported.Properties
	add("message id", p.MessageID)
	add("content type", p.ContentType)
	add("content encoding", p.ContentEncoding)
	add("delivery mode", strconv.Itoa(int(p.DeliveryMode)))
	add("priority", strconv.Itoa(int(p.Priority)))
	add("correlation id", p.CorrelationID)
	add("reply to", p.ReplyTo)
	add("expiration", p.Expiration)
	if !p.Timestamp.IsZero() {
		add("timestamp", p.Timestamp.UTC().Format(time.RFC3339))
	}
	add("type", p.Type)
	add("user id", p.UserID)
	add("app id", p.AppID)
	add("body size", strconv.Itoa(m.BodySize))

	var lives []life
	if entries, ok := m.Delivery.Headers[deadletter.HeaderHistory].([]any); ok {
		for i, e := range entries {
			t, _ := e.(amqp.Table)
			l := life{Title: fmt.Sprintf("life %d (replayed %d lives ago)", len(entries)-i, i+1)}
			for _, k := range slices.Sorted(maps.Keys(t)) {
				l.Headers = append(l.Headers, header{Name: k, Type: fmt.Sprintf("%T", t[k]), Value: valueText(t[k])})
			}
			lives = append(lives, l)
		}
	}
	body := m.Delivery.Body
	var text, pretty string
	if utf8.Valid(body) {
		text = string(body)
	}
	var buf bytes.Buffer
	if json.Valid(body) && json.Indent(&buf, body, "", "  ") == nil {
		pretty = buf.String()
	}
	dump := body
	more := 0
	if len(dump) > 64<<10 {
		dump, more = dump[:64<<10], len(dump)-64<<10
	}
	c.render(w, r, "message", map[string]any{
		"Title": "message " + id, "Queue": q, "M": m, "Props": props, "Headers": headers, "Lives": lives,
		"Text": text, "JSON": pretty, "Hex": hex.Dump(dump), "HexMore": more,
	})
}

// typedText returns a typed value's JSON as text: a string without its
// quotes, anything else as JSON.
func typedText(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
}

func valueText(v any) string {
	switch x := v.(type) {
	case time.Time:
		return x.UTC().Format(time.RFC3339)
	case []byte:
		return strconv.Quote(string(x))
	case amqp.Table, []any:
		var buf bytes.Buffer
		printValue(&buf, "", x, "")
		return strings.TrimSpace(buf.String())
	}
	return fmt.Sprint(v)
}

// A choice is the messages an action's form selects: by id (or key), by
// group, or both (the messages of the group that a confirmation counted,
// by key).
type choice struct {
	ids   map[string]bool
	group string
}

// selection reads the choice of an action's form: each id input as it is
// (an id may hold spaces or line breaks, and names no other message for
// it), and the keys of a confirmation, a JSON array in one input (a form
// of more than 10,000 inputs is refused by net/http).
func selection(r *http.Request) (choice, error) {
	ch := choice{ids: map[string]bool{}, group: r.PostForm.Get("group")}
	for _, id := range r.PostForm["id"] {
		if id != "" {
			ch.ids[id] = true
		}
	}
	if v := r.PostForm.Get("keys"); v != "" {
		var keys []string
		if err := json.Unmarshal([]byte(v), &keys); err != nil {
			return ch, &exitError{exitUsage, fmt.Errorf("the keys of the confirmation cannot be read: %w", err)}
		}
		for _, k := range keys {
			if k != "" {
				ch.ids[k] = true
			}
		}
	}
	return ch, nil
}

func (ch choice) empty() bool { return len(ch.ids) == 0 && ch.group == "" }

// filter returns the filter of ch: a message of its group, if it names
// one, whose id or key is one of its ids, if it has some: a set, where
// Filter.IDs is a list searched for each message, and a group's
// confirmation has as many ids as messages.
func (ch choice) filter() deadletter.Filter {
	f := deadletter.Filter{Group: ch.group}
	if len(ch.ids) > 0 {
		f.Match = func(m *deadletter.Message) bool { return ch.ids[m.ID] || (m.Key != "" && ch.ids[m.Key]) }
	}
	return f
}

// confirmPage shows what an action would do, with the count of messages
// it would move, found by a dry run of the same operation.
func (c *console) confirmPage(ctx context.Context, w http.ResponseWriter, r *http.Request, q string) {
	action := r.PostForm.Get("action")
	chosen, err := selection(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if (action != "replay" && action != "purge") || chosen.empty() {
		c.fail(w, r, &exitError{exitUsage, fmt.Errorf("choose replay or purge, and at least one message")})
		return
	}
	found, err := c.dl.List(ctx, q, deadletter.ListOptions{Filter: chosen.filter()})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	// The action moves what this page counts, and no more: the messages
	// of the keys found (a message's id, or the MD5 of the body of one
	// without), within the group if one was chosen, and at most as many
	// as found, in queue order, so that a dead letter that comes later
	// with a key found stays. A message without a key (no id, no body) can
	// only be selected as part of its group.
	keys := []string{}
	seen := map[string]bool{}
	for _, m := range found {
		if m.Key == "" {
			keys = nil
			break
		}
		if !seen[m.Key] {
			seen[m.Key] = true
			keys = append(keys, m.Key)
		}
	}
	var keysJSON string
	if len(keys) > 0 {
		b, err := json.Marshal(keys)
		if err != nil {
			c.fail(w, r, err)
			return
		}
		keysJSON = string(b)
	}
	c.render(w, r, "confirm", map[string]any{"Title": "confirm", "Queue": q, "Action": action,
		"Keys": keysJSON, "Group": chosen.group, "Count": len(found), "Messages": found})
}

// confirmedCount returns the count of messages the confirmation showed,
// the most an action moves; 0 for a form without it.
func confirmedCount(r *http.Request) (int, error) {
	v := r.PostForm.Get("n")
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0, &exitError{exitUsage, fmt.Errorf("the confirmed count %q is not a positive number", v)}
	}
	return n, nil
}

// do replays or purges the selected messages.
func (c *console) do(ctx context.Context, w http.ResponseWriter, r *http.Request, q string) {
	chosen, err := selection(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	filter := chosen.filter()
	if chosen.empty() {
		c.fail(w, r, &exitError{exitUsage, fmt.Errorf("no message selected")})
		return
	}
	limit, err := confirmedCount(r)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	var done string
	switch r.PostForm.Get("action") {
	case "replay":
		opts := deadletter.ReplayOptions{Filter: filter, Limit: limit}
		if r.PostForm.Get("reset") == "on" && c.hasStore() {
			st, closeStore, err := c.store.open(ctx, c.timeout)
			if err != nil {
				c.fail(w, r, err)
				return
			}
			defer closeStore()
			opts.ResetFailures = func(ctx context.Context, d *amqp.Delivery) error {
				k, err := middleware.Key(d)
				if err != nil {
					return nil // nothing was ever counted under no key
				}
				return st.ResetFailures(ctx, c.store.key(k))
			}
		}
		res, err := c.dl.Replay(ctx, q, opts)
		if err != nil {
			c.fail(w, r, fmt.Errorf("replayed %d of %d: %w", res.Replayed, len(res.Selected), err))
			return
		}
		done = fmt.Sprintf("replayed %d message(s) to their queues", res.Replayed)
	case "purge":
		removed, err := c.dl.Purge(ctx, q, deadletter.PurgeOptions{Filter: filter, Limit: limit})
		if err != nil {
			c.fail(w, r, fmt.Errorf("removed %d: %w", len(removed), err))
			return
		}
		done = fmt.Sprintf("removed %d message(s)", len(removed))
	default:
		c.fail(w, r, &exitError{exitUsage, fmt.Errorf("unknown action %q", r.PostForm.Get("action"))})
		return
	}
	c.logger.LogAttrs(ctx, slog.LevelInfo, "ui: "+done, slog.String("queue", q), slog.String("remote", r.RemoteAddr))
	c.render(w, r, "done", map[string]any{"Title": "done", "Queue": q, "Done": done})
}

// hasStore reports whether the console was given a store.
func (c *console) hasStore() bool {
	return c.store != nil && (c.store.redis != "" || c.store.postgres != "")
}

func (c *console) export(ctx context.Context, w http.ResponseWriter, r *http.Request, q string) {
	// The export is written to memory first, so that a failure shows as
	// an error page rather than as a truncated download.
	var buf bytes.Buffer
	bw := bufio.NewWriter(&buf)
	if _, err := c.dl.Export(ctx, q, bw, deadletter.ExportOptions{}); err != nil {
		c.fail(w, r, err)
		return
	}
	bw.Flush()
	w.Header().Set("Content-Type", "application/jsonl")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="%s.dlq-%s.jsonl"`, q, time.Now().UTC().Format("20060102T150405Z")))
	w.Write(buf.Bytes())
}

func (c *console) keyPage(w http.ResponseWriter, r *http.Request) {
	k := strings.TrimSpace(r.FormValue("k"))
	data := map[string]any{"Title": "key", "K": k}
	if k == "" || !c.hasStore() {
		c.render(w, r, "key", data)
		return
	}
	ctx, cancel := c.ctx(r)
	defer cancel()
	st, closeStore, err := c.store.open(ctx, c.timeout)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	defer closeStore()
	key := c.store.key(k)
	s, err := st.Inspect(ctx, key)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	host, pid, _ := middleware.TokenOwner(s.Token)
	rows := []header{{Name: "key", Value: key}, {Name: "state", Value: s.State()}}
	if s.Token != "" {
		owner := "unknown (token not Dedup's)"
		if pid != 0 {
			owner = "host " + host + ", pid " + strconv.Itoa(pid)
		}
		rows = append(rows, header{Name: "owner", Value: owner}, header{Name: "token", Value: s.Token})
	}
	if s.State() != "absent" {
		rows = append(rows, header{Name: "expires in", Value: ttl(s.TTL)})
	}
	rows = append(rows, header{Name: "failures", Value: strconv.FormatInt(s.Failures, 10)})
	if s.Failures > 0 {
		rows = append(rows, header{Name: "failures expire in", Value: ttl(s.FailuresTTL)})
	}
	data["Rows"] = rows
	c.render(w, r, "key", data)
}
