package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/rabbitmw/rabbitmw/broker"
)

func (e *env) topology(ctx context.Context, args []string) error {
	if len(args) == 0 {
		return usageError("topology: name a subcommand: declare, delete, show")
	}
	sub := args[0]
	if sub != "declare" && sub != "delete" && sub != "show" {
		return usageError("topology: unknown subcommand %q: declare, delete, show", sub)
	}
	q := e.queueCommand("topology "+sub, withJSON)
	quorum := q.Bool("quorum", false, "the work queue is a quorum queue")
	limit := q.Int("delivery-limit", 0, "x-delivery-limit of a quorum work queue")
	var delays list
	q.Var(&delays, "delays", "the delay ladder, comma-separated (default 1s,5s,30s,2m,10m,1h)")
	support := q.Bool("support", false, "declare only the dead-letter and delay queues (DeclareSupport)")
	var force *bool
	if sub == "delete" {
		force = q.Bool("force", false, "delete the queues with the messages they hold")
	}
	if err := q.parseQueue(args[1:]); err != nil {
		return err
	}
	top := broker.Topology{Quorum: *quorum, DeliveryLimit: *limit}
	if *support {
		top.Declare = broker.DeclareSupport
	}
	for _, s := range delays {
		d, err := time.ParseDuration(s)
		if err != nil {
			return usageError("--delays: %v", err)
		}
		top.Delays = append(top.Delays, d)
	}
	names, err := top.Queues(q.queue)
	if err != nil {
		return usageError("%v", err)
	}
	b, ctx, closeBroker, err := q.connect(ctx, e)
	if err != nil {
		return err
	}
	defer closeBroker()
	switch sub {
	case "declare":
		if err := b.Declare(ctx, q.queue, top); err != nil {
			if errors.Is(err, broker.ErrQueueArguments) {
				return &exitError{exitRefused, err}
			}
			return classify(err)
		}
	case "delete":
		if !*force {
			if err := refuseFull(ctx, b, names); err != nil {
				return err
			}
		}
		if err := b.Delete(ctx, q.queue, top); err != nil {
			return err
		}
		fmt.Fprintf(e.stdout, "deleted %s and its dead-letter and delay queues\n", q.queue)
		return nil
	}
	return e.showTopology(ctx, b, q.common, top, names)
}

// refuseFull returns an error if a queue of names holds ready messages,
// which a delete would throw away. Messages that consumers hold, and
// those that come after the check, are not counted.
func refuseFull(ctx context.Context, b *broker.Broker, names broker.Queues) error {
	var full []string
	for _, q := range append([]string{names.Work, names.DeadLetter}, names.Delays...) {
		n, err := b.Len(ctx, q)
		if err != nil && !errors.Is(err, broker.ErrQueueNotFound) {
			return err
		}
		if n > 0 {
			full = append(full, fmt.Sprintf("%s (%d)", q, n))
		}
	}
	if len(full) == 0 {
		return nil
	}
	return &exitError{exitRefused, fmt.Errorf("topology delete: messages in %s: nothing deleted; pass --force to delete the queues with their messages", strings.Join(full, ", "))}
}

// showTopology prints each queue of the topology: whether it exists, its
// ready messages, and the arguments the topology declares it with
// (RabbitMQ's AMQP interface does not tell a queue's arguments).
func (e *env) showTopology(ctx context.Context, b *broker.Broker, c common, top broker.Topology, names broker.Queues) error {
	type row struct {
		Queue     string `json:"queue"`
		Role      string `json:"role"`
		Exists    bool   `json:"exists"`
		Messages  int    `json:"messages"`
		Arguments string `json:"arguments"`
	}
	var rows []row
	add := func(q, role, args string) error {
		n, err := b.Len(ctx, q)
		r := row{Queue: q, Role: role, Exists: err == nil, Messages: n, Arguments: args}
		if err != nil && !errors.Is(err, broker.ErrQueueNotFound) {
			return err
		}
		rows = append(rows, r)
		return nil
	}
	work := "x-dead-letter-exchange=\"\" x-dead-letter-routing-key=" + names.DeadLetter
	if top.Quorum {
		work += " x-queue-type=quorum"
		if top.DeliveryLimit > 0 {
			work += fmt.Sprintf(" x-delivery-limit=%d", top.DeliveryLimit)
		}
	}
	if top.Declare == broker.DeclareSupport {
		work = "(declared elsewhere)"
	}
	if err := add(names.Work, "work", work); err != nil {
		return err
	}
	if err := add(names.DeadLetter, "dead-letter", "(none)"); err != nil {
		return err
	}
	for _, q := range names.Delays {
		tier := q[strings.LastIndex(q, ".")+1:]
		d, _ := time.ParseDuration(tier)
		if err := add(q, "delay "+tier, fmt.Sprintf("x-message-ttl=%d x-dead-letter-exchange=\"\" x-dead-letter-routing-key=%s", d.Milliseconds(), names.Work)); err != nil {
			return err
		}
	}
	if c.json {
		return writeJSON(e.stdout, rows)
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "QUEUE\tROLE\tEXISTS\tMESSAGES\tARGUMENTS")
	for _, r := range rows {
		n := fmt.Sprint(r.Messages)
		if !r.Exists {
			n = "-"
		}
		fmt.Fprintf(w, "%s\t%s\t%v\t%s\t%s\n", r.Queue, r.Role, r.Exists, n, r.Arguments)
	}
	return w.Flush()
}
