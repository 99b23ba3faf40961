package deadletter

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/internal/expose"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
	"github.com/rabbitmw/rabbitmw/internal/clock"
	"github.com/rabbitmw/rabbitmw/internal/header"
)

// ReplayOptions selects the messages that [Inspector.Replay] sends back, and
// how. The zero value replays every message to its original queue.
type ReplayOptions struct {
	Filter
	// To, if set, is the queue every selected message is sent to. Without
	// it, each goes back to the work queue whose dead-letter queue holds
	// it, and only if its [broker.HeaderOriginalQueue] names that queue: a
	// selected message without one (ErrNoDestination), or with one that
	// names another queue (ErrOtherQueue), stops the replay before
	// anything moves.
	To string
	// DryRun selects and checks, and moves nothing.
	DryRun bool
	// Limit, if positive, is the largest number of messages replayed.
	Limit int
	// Rate, if positive, is the most messages replayed per second.
	Rate float64
	// HoldLimit is the longest the replay holds a message of the
	// dead-letter queue unacknowledged (see [Inspector.Replay]): below
	// RabbitMQ's consumer_timeout, past which the server closes the
	// channel. Default 10 minutes, a third of RabbitMQ's default.
	HoldLimit time.Duration
	// HistoryLimit is the number of earlier lives that [HeaderHistory]
	// keeps, the most recent ones. Default 5; negative keeps none.
	HistoryLimit int
	// ResetFailures, if not nil, is called for each message before it is
	// sent back, to reset its failure count in the store (for example
	// store.ResetFailures of the key middleware.Key gives it), so that the
	// replayed message gets its full attempts again. An error stops the
	// replay; the message stays in the dead-letter queue. It is called
	// for several messages at once.
	ResetFailures func(ctx context.Context, d *amqp.Delivery) error
	// Progress, if not nil, is called after each message replayed, with
	// the number replayed so far and the number selected; never for two
	// messages at once.
	Progress func(done, total int)
	// ScanProgress, if not nil, is called as the dead-letter queue is read
	// (see ListOptions.Progress).
	ScanProgress func(done, total int)
}

const defaultHistoryLimit = 5

// A ReplayResult says what a replay found and did.
type ReplayResult struct {
	// Scanned is the number of messages read from the dead-letter queue.
	Scanned int
	// Selected are the messages that the filter and the limit selected,
	// in queue order.
	Selected []*Message
	// Replayed is the number of them sent back and removed from the
	// dead-letter queue.
	Replayed int
	// InDoubt are those of them that were sent and whose confirm or
	// acknowledgement the replay gave up on (the wait for the messages in
	// flight ran out or was aborted, see [WithAbort]; or the connection
	// failed): each may be in its destination and is still in the
	// dead-letter queue. A second replay sends it again, with the same
	// MessageId, which the consumers' Dedup absorbs. Replayed does not
	// count them.
	InDoubt []*Message
}

// Replay sends messages of the dead-letter queue of work queue queue back
// to queue (or to opts.To): those that opts selects, in
// queue order, a few at a time (so they may arrive slightly out of
// order). The dead-letter queue is read as [Inspector.List] does;
// what is not replayed stays in it, in its order.
//
// Before anything moves, Replay checks that every selected message has a
// destination: without opts.To, a [broker.HeaderOriginalQueue] that names
// queue (ErrNoDestination, ErrOtherQueue: a header, forged or stale, does
// not choose where a message goes); and that the destination queue
// exists ([broker.ErrQueueNotFound]). Then, for each message, it calls
// opts.ResetFailures, publishes the copy through the default exchange with
// the mandatory flag, waits for the server's confirm, and only then
// acknowledges the original. A crash or a lost connection therefore loses
// nothing: the messages not yet acknowledged return to the dead-letter
// queue, and at worst those in flight (a few) whose copies were confirmed
// are both in the work queue and still in the dead-letter queue; a second
// replay sends them again, with the same MessageId, which the consumers'
// Dedup layer absorbs. Replay does not reconnect, and stops at the first
// error: run it again. When ctx ends (an operator's Ctrl-C), or at the
// first error, it sends nothing more but waits, up to 5 seconds, for
// the messages in flight to be confirmed and acknowledged, so that each of
// them is in one queue only; an abort (see [WithAbort]) ends that wait at
// once. The messages it gave up on are in ReplayResult.InDoubt.
//
// RabbitMQ closes a channel that holds a message unacknowledged longer
// than its consumer_timeout (30 minutes by default), and a slow replay (a
// low Rate, a long queue) would hold some that long. So Replay works in
// rounds of at most opts.HoldLimit, from the reading of the queue to the
// last message sent: at the limit, it puts back the messages it has not
// replayed, in their places, waits for the next one's turn, and reads the
// queue again, to replay the rest of those it selected at first (by key),
// and no message that came into the queue meanwhile. Each round replays
// at least one message, so a queue too long to read within the limit
// still moves, one message a round.
//
// The copy keeps the body, the properties and the headers, but for the
// fault headers and dead-letter records, which move into [HeaderHistory];
// [HeaderReplays] counts one more. Like every copy the broker makes (see
// the package documentation of broker), it carries no Expiration: the replayed message
// does not expire in the work queue, however long it waits there (the
// original stays in [broker.HeaderOriginalExpiration]); its UserId stays
// in [broker.HeaderUserID]. The handler sees the message as first
// delivered: its exchange, routing key, UserId and Expiration as
// published (for a message that RabbitMQ itself dead-lettered, the route
// and expiration of its x-death record). The copy carries no
// x-death, so neither this publish nor a later dead-lettering can meet
// RabbitMQ's dead-letter cycle check with a record of the work queue.
//
// The result says what was found and done, also with an error.
func (in *Inspector) Replay(ctx context.Context, queue string, opts ReplayOptions) (ReplayResult, error) {
	var res ReplayResult
	if opts.Rate < 0 || opts.Limit < 0 || opts.HoldLimit < 0 {
		return res, errors.New("deadletter: Replay: negative Rate, Limit or HoldLimit")
	}
	hold := opts.HoldLimit
	if hold == 0 {
		hold = defaultHoldLimit
	}
	history := opts.HistoryLimit
	switch {
	case history == 0:
		history = defaultHistoryLimit
	case history < 0:
		history = 0
	}
	r := &replayRun{in: in, queue: queue, opts: opts, history: history, hold: hold, res: &res, start: time.Now()}
	err := r.run(ctx)
	return res, err
}

const defaultHoldLimit = 10 * time.Minute

// A replayRun is one call of Replay: its rounds, its rate's schedule and
// the messages it has still to replay.
type replayRun struct {
	in      *Inspector
	queue   string
	opts    ReplayOptions
	history int
	hold    time.Duration
	res     *ReplayResult
	start   time.Time      // the rate's schedule starts here
	sent    int            // messages started, for the schedule
	pending map[string]int // keys of the messages selected and not yet replayed, counted
}

// due returns when the next message may start.
func (r *replayRun) due() time.Time {
	if r.opts.Rate <= 0 {
		return time.Time{}
	}
	return r.start.Add(time.Duration(float64(r.sent) / r.opts.Rate * float64(time.Second)))
}

// run replays in rounds until every message selected in the first is
// replayed, or one fails.
func (r *replayRun) run(ctx context.Context) error {
	for round := 0; ; round++ {
		if round > 0 {
			// Hold nothing while waiting for the next message's turn.
			if err := clock.Sleep(ctx, time.Until(r.due())); err != nil {
				return err
			}
		}
		deadline := time.Now().Add(r.hold)
		var progress func(done, total int)
		if round == 0 {
			progress = r.opts.ScanProgress
		}
		snap, err := r.in.snapshot(ctx, r.queue, progress)
		if err != nil {
			return err
		}
		picked := r.pick(snap, round == 0)
		if err := snap.checkDestinations(ctx, picked, r.queue, r.opts.To); err != nil {
			return errors.Join(err, snap.close(r.in))
		}
		if r.opts.DryRun || len(picked) == 0 {
			return snap.close(r.in)
		}
		err = snap.replay(ctx, picked, r, deadline)
		for _, i := range picked {
			if snap.done[i] {
				r.pending[snap.msgs[i].Key]--
			}
		}
		if err := errors.Join(err, snap.close(r.in)); err != nil {
			return err
		}
		if r.res.Replayed == len(r.res.Selected) {
			return nil
		}
	}
}

// pick returns the indexes of the messages of snap to replay: in the first
// round, those the filter and the limit select (recorded in the result);
// later, those of them not yet replayed.
func (r *replayRun) pick(snap *snapshot, first bool) []int {
	var picked []int
	if first {
		r.res.Scanned = len(snap.msgs)
		r.pending = map[string]int{}
		for i, dl := range snap.msgs {
			if r.opts.Limit > 0 && len(picked) == r.opts.Limit {
				break
			}
			if r.opts.Filter.match(dl) {
				picked = append(picked, i)
				r.res.Selected = append(r.res.Selected, dl)
				r.pending[dl.Key]++
			}
		}
		return picked
	}
	left := maps.Clone(r.pending)
	for i, dl := range snap.msgs {
		if left[dl.Key] > 0 && r.opts.Filter.match(dl) {
			left[dl.Key]--
			picked = append(picked, i)
		}
	}
	return picked
}

// replayWindow is the number of messages a replay has in flight: sent and
// not yet confirmed and acknowledged. RabbitMQ confirms a persistent
// message once it is on disk, and writes the messages in flight together:
// one at a time, a replay ran at about 300 messages a second on loopback.
const replayWindow = 16

// replay replays the messages picked, up to replayWindow at a time, at
// the run's rate, until one fails, or until the next would start after
// deadline (the first always starts).
func (snap *snapshot) replay(ctx context.Context, picked []int, r *replayRun, deadline time.Time) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	// A message sent goes on under send once ctx ends (see finishing).
	send, stopSend := finishing(ctx)
	defer stopSend()
	var (
		mu    sync.Mutex
		first error
		doubt []int // the messages sent and given up on
		wg    sync.WaitGroup
		slots = make(chan struct{}, replayWindow)
	)
	failed := func() bool {
		mu.Lock()
		defer mu.Unlock()
		return first != nil
	}
	total := len(r.res.Selected)
	for n, i := range picked {
		due := r.due()
		if n > 0 && (due.After(deadline) || time.Now().After(deadline)) {
			break // the next round takes the rest
		}
		if clock.Sleep(ctx, time.Until(due)) != nil {
			break
		}
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil || failed() {
			break
		}
		r.sent++
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			sent, err := snap.replayOne(send, i, r.queue, r.opts, r.history)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				if sent {
					doubt = append(doubt, i)
				}
				if first == nil {
					first = err
					cancel()
				}
				return
			}
			r.res.Replayed++
			if r.opts.Progress != nil {
				r.opts.Progress(r.res.Replayed, total)
			}
		}()
	}
	wg.Wait()
	slices.Sort(doubt) // in queue order
	for _, i := range doubt {
		r.res.InDoubt = append(r.res.InDoubt, snap.msgs[i])
	}
	if first == nil && ctx.Err() != nil {
		return context.Cause(ctx)
	}
	return first
}

// checkDestinations refuses the replay of messages picked, from the
// dead-letter queue of work queue queue, unless each has a destination
// that exists: to, or else queue, for a message whose
// broker.HeaderOriginalQueue names queue.
func (snap *snapshot) checkDestinations(ctx context.Context, picked []int, queue, to string) error {
	var missing, foreign []string
	for _, i := range picked {
		dl := snap.msgs[i]
		switch {
		case to != "":
		case dl.Queue == "":
			missing = append(missing, fmt.Sprintf("%q", dl.ID))
		case dl.Queue != queue:
			foreign = append(foreign, fmt.Sprintf("%q names %q", dl.ID, dl.Queue))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%w (%s header): message %s: name the queue to send them to (ReplayOptions.To, --to); nothing was replayed",
			ErrNoDestination, broker.HeaderOriginalQueue, some(missing))
	}
	if len(foreign) > 0 {
		return fmt.Errorf("%w (%s header): in %q, message %s: a dead letter of %q goes back to %q only; name the queue to send them to (ReplayOptions.To, --to); nothing was replayed",
			ErrOtherQueue, broker.HeaderOriginalQueue, snap.dlq, some(foreign), snap.dlq, queue)
	}
	dest := queue
	if to != "" {
		dest = to
	}
	if err := snap.s.Declare(ctx, []transport.QueueSpec{{Name: dest, Passive: true}}); err != nil {
		if err := expose.Refusal(dest, unwrapQueueError(err)); errors.Is(err, broker.ErrQueueNotFound) {
			return fmt.Errorf("%w; nothing was replayed", err)
		}
		return err
	}
	return nil
}

// some joins the first few of items, and says how many more there are.
func some(items []string) string {
	const show = 5
	if len(items) <= show {
		return strings.Join(items, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(items[:show], ", "), len(items)-show)
}

func unwrapQueueError(err error) error {
	var qe *transport.QueueError
	if errors.As(err, &qe) {
		return qe.Err
	}
	return err
}

// replayOne sends message i back to work queue queue, or to opts.To, and
// acknowledges it. With an error, sent says whether the copy may be in
// its destination all the same: its publish was given up on, ctx ended,
// before the server's word, or its acknowledgement failed.
func (snap *snapshot) replayOne(ctx context.Context, i int, queue string, opts ReplayOptions, history int) (sent bool, err error) {
	dl := snap.msgs[i]
	d := dl.Delivery
	dest := opts.To
	if dest == "" {
		dest = queue
	}
	if opts.ResetFailures != nil {
		if err := opts.ResetFailures(ctx, d); err != nil {
			return false, fmt.Errorf("deadletter: replay %q: reset failures: %w", dl.ID, err)
		}
	}
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("deadletter: replay %q to %q: %w", dl.ID, dest, err) // nothing sent
	}
	msg := expose.Republishing(d, replayHeaders(d.Headers, snap.dlq, time.Now(), history))
	if err := snap.s.Publish(ctx, "", dest, msg); err != nil {
		if ctx.Err() != nil {
			return true, fmt.Errorf("deadletter: replay %q to %q: given up on before its confirm (it may be there, and stays in the dead-letter queue too): %w", dl.ID, dest, err)
		}
		return false, fmt.Errorf("deadletter: replay %q to %q: %w", dl.ID, dest, err)
	}
	if err := snap.ack(i); err != nil {
		return true, fmt.Errorf("deadletter: replay %q: ack (the message was sent, and stays in the dead-letter queue too): %w", dl.ID, err)
	}
	return false, nil
}

// firstRoute gives h, the headers of a message that RabbitMQ itself
// dead-lettered (no broker copy recorded its route), the route and
// expiration it was first published with, from its x-death record of the
// first dead-lettering (x-first-death-queue and -reason): the exchange
// and first routing key in [broker.HeaderOriginalExchange] and
// [broker.HeaderOriginalRoutingKey], original-expiration in
// [broker.HeaderOriginalExpiration]. So the replayed message reaches its
// handler as it was published, as one the broker dead-lettered does. A
// header already there, or a record not in RabbitMQ's form, is left alone.
// It modifies h.
func firstRoute(h amqp.Table) {
	deaths, _ := h["x-death"].([]any)
	queue, _ := h["x-first-death-queue"].(string)
	reason, _ := h["x-first-death-reason"].(string)
	for _, d := range deaths {
		r, _ := d.(amqp.Table)
		if r == nil || r["queue"] != queue || r["reason"] != reason {
			continue
		}
		exchange, ok := r["exchange"].(string)
		keys, _ := r["routing-keys"].([]any)
		var key string
		if ok && len(keys) > 0 {
			// An empty key is a key: a fanout exchange's, for one.
			key, ok = keys[0].(string)
		} else {
			ok = false
		}
		if _, done := h[broker.HeaderOriginalExchange]; ok && !done {
			if _, done := h[broker.HeaderOriginalRoutingKey]; !done {
				h[broker.HeaderOriginalExchange] = exchange
				h[broker.HeaderOriginalRoutingKey] = key
			}
		}
		if exp, ok := r["original-expiration"].(string); ok {
			if _, done := h[broker.HeaderOriginalExpiration]; !done {
				h[broker.HeaderOriginalExpiration] = exp
			}
		}
		return
	}
}

// historyHeaders are the headers a replay moves into HeaderHistory.
var historyHeaders = []string{
	broker.HeaderError, broker.HeaderErrorType, broker.HeaderOriginalQueue, broker.HeaderFailedAt,
	broker.HeaderHost, broker.HeaderProcess, rabbitmw.HeaderAttempts, broker.HeaderNotBefore,
	broker.HeaderDeaths, broker.HeaderMalformedXDeath, broker.HeaderFirstError, broker.HeaderFirstFailedAt,
	"x-death", "x-first-death-queue", "x-first-death-reason", "x-first-death-exchange",
	"x-last-death-queue", "x-last-death-reason", "x-last-death-exchange", "x-delivery-count",
}

// replayHeaders returns the headers of the replayed copy of a message
// with headers h, from dead-letter queue dlq at time at: see
// HeaderHistory, and firstRoute. It does not modify h.
func replayHeaders(h amqp.Table, dlq string, at time.Time, history int) amqp.Table {
	out := maps.Clone(h)
	if out == nil {
		out = amqp.Table{}
	}
	firstRoute(out)
	life := amqp.Table{"replayed-at": at.UTC().Truncate(time.Second), "dead-letter-queue": dlq}
	for _, k := range historyHeaders {
		if v, ok := out[k]; ok {
			life[k] = v
			delete(out, k)
		}
	}
	var earlier []any
	if v, ok := out[HeaderHistory]; ok {
		if a, ok := v.([]any); ok {
			earlier = a
		} else {
			life[HeaderHistory] = v // malformed: kept in the new life
		}
	}
	lives := append([]any{life}, earlier...)
	out[HeaderHistory] = lives[:min(len(lives), history)]
	if history == 0 {
		delete(out, HeaderHistory)
	}
	replays, ok := header.Int(out[HeaderReplays])
	if !ok || replays < 0 {
		replays = 0
	}
	out[HeaderReplays] = replays + 1
	return out
}
