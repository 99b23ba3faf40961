// Package relay sends the messages of a PostgreSQL outbox
// ([pgstore.Outbox]) to RabbitMQ, with confirms: a message written in a
// transaction that commits is published, at least once and with the id it
// was given when it was written; a message of a transaction that rolls back
// never is.
//
// It is a package of its own because it joins the two clients: pgx (by
// pgstore) and the broker. A program that only consumes with the
// PostgreSQL inbox, or only writes into the outbox and leaves the relay to
// another process, does not link it.
//
//	ob := pgstore.NewOutbox(pool, pgstore.OutboxOptions{})
//	if err := ob.Migrate(ctx); err != nil {
//		return err
//	}
//	b := broker.New(url, broker.Options{Logger: logger})
//	defer b.Close()
//	go relay.New(ob, b, relay.Options{Logger: logger}).Run(ctx) // beside Consume, or on its own
//
// # How it sends
//
// The relay takes up to BatchSize pending rows in one transaction
// (SELECT … FOR UPDATE SKIP LOCKED, in id order), publishes them all at
// once with confirms and the mandatory flag, records each result in the
// same transaction and commits (see [pgstore.Outbox.Dispatch]). It keeps
// Senders such dispatches going at once, so that the database's work of
// one overlaps the confirms of another:
//
//   - confirmed: the row is marked sent (deleted once Retention has
//     passed), only after its confirm;
//   - returned (no queue is bound for it), refused by the server in a way
//     that closes the channel, or a message the broker cannot send: the
//     row is parked, with the reason, never dropped, since sending it
//     again cannot help until an operator acts; `rabbitmw outbox retry`
//     (or [pgstore.Outbox.Retry]) sends it back to pending. A refusal
//     that closes the channel (a missing write permission, a UserId
//     that is not the connection's user, a body over the server's
//     limit) does not say which publish it refused, and fails every
//     publish in flight on that channel: each row refused so is sent
//     again alone, one after the other, and only a row refused alone is
//     parked (the others are confirmed, and those that the server had
//     taken before the channel closed reach their queue twice, with the
//     same MessageId). A publish of another goroutine on the same
//     Broker that the server refuses at the moment a row is sent alone
//     can still park that row with it;
//   - nacked: RabbitMQ could not take the message now (a quorum queue
//     electing its leader, a queue at its length limit with overflow
//     reject-publish), and did not take responsibility for it. The row
//     stays pending, with the nack as its last error, and is sent again
//     (below), as one without a confirm is: a leader election costs a
//     few retries, not an operator's ticket, and a queue that stays full
//     keeps its rows pending (their count and the oldest's age grow:
//     alert on those) until it has room;
//   - no confirm (RabbitMQ down, the connection lost, PublishTimeout
//     passed): the row stays pending, and the relay backs off before it
//     tries again.
//
// A row that failed (nacked, or no confirm) waits for its own backoff
// before it is taken again: its retry_at is set to a time drawn as the
// relay's backoff is (Options.BackoffMin, BackoffMax), growing with the
// row's attempts, and dispatches skip it until then. Meanwhile they take
// the rows after it, so rows that keep failing (a queue that stays full),
// however many batches they fill, do not hold back the rows written
// after them. The relay wakes when the rows it failed are due again
// (rounded up to BackoffMin), besides its polls.
//
// The relay itself backs off only when it, not a row, failed: the
// database could not be reached, or a dispatch had no row confirmed and
// one failed for another cause than a nack (RabbitMQ is down or does not
// confirm, and the next batch would fare no better). A dispatch whose
// rows were all nacked does not make it wait: RabbitMQ is there, and the
// rows' queues could not take them. The next dispatch takes the rows past
// this batch's, while there are any, before it starts from the first
// pending row again. Rows left pending are logged at Warn, with their
// number and the first one's reason: at each backoff, and at most once
// per BackoffMax otherwise.
//
// It wakes when a transaction that wrote a row commits (LISTEN on the
// outbox's channel, which [pgstore.Outbox.Write] notifies), and polls every
// PollInterval besides, so that a lost notification, or a listening
// connection that broke, delays a message by one interval at most.
//
// # Several relays
//
// Any number of relays may run on one outbox, in one process or many:
// SKIP LOCKED makes each take rows the others do not hold, so in the steady
// state no row is sent twice, and the relays share the load; a relay that
// dies releases its rows with its connection, and the others send them,
// and one that stalls holding them (a frozen process, a network that
// stops answering) loses them to the others after PublishTimeout +
// StopTimeout + 15 s, when PostgreSQL ends its idle transaction
// ([pgstore.DispatchOptions].HoldFor). This
// is chosen over one leader elected by an advisory lock, which would keep a
// strict order but sends from one process alone, and leaves the outbox
// idle from a leader's death until another takes over.
//
// # Order
//
// None is kept. Rows are taken in the order of their ids, but a batch is
// published at once, several relays send batches side by side, and a row
// that failed is sent after younger ones. The consumers' retries reorder
// messages anyway (a retried message comes back through a delay queue):
// a consumer that needs an order must carry it in the messages (a version
// per key) and check it.
//
// # Where the guarantee ends
//
// A message is published at least once: the relay can die, or lose the
// commit's answer, after RabbitMQ confirmed a row and before the row is
// marked, and the next dispatch sends it again, with the same MessageId.
// The consumers' Dedup layer absorbs that copy: an inbox (pgstore.Handler)
// in the receiving service makes its effect once. A row is never marked
// sent without a confirm, and a rolled-back transaction never leaves a row.
package relay

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/backoff"
	"github.com/rabbitmw/rabbitmw/internal/clock"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// A Publisher publishes a message and returns once RabbitMQ confirmed it,
// as [broker.Broker.Publish] does, with its errors: ErrUnroutable for a
// message returned, ErrInvalidMessage for one that cannot be sent (both
// parked), ErrNacked for one that RabbitMQ could not take now,
// ErrConnectionLost or the context's error for one whose confirm did not
// come (these stay pending).
type Publisher interface {
	Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error
}

var _ Publisher = (*broker.Broker)(nil)

// Options configures a [Relay]. The zero value selects the defaults.
type Options struct {
	// Logger receives the relay's records, at Warn: each row parked;
	// rows left pending, nacked or not confirmed (at each backoff, and at
	// most once per BackoffMax otherwise); a database that cannot be
	// reached. Nil discards them.
	Logger *slog.Logger
	// BatchSize is the most rows taken, and published at once, by one
	// dispatch. Default 100.
	BatchSize int
	// Senders is how many dispatches one Run keeps going at once, each
	// taking rows the others do not hold (SKIP LOCKED): while one waits
	// for its confirms, another reads and records its rows. Default 2.
	// Each dispatch holds a connection of the outbox's pool from its take
	// to its record, for as long as its confirms take (PublishTimeout at
	// most, which a RabbitMQ that is down uses up): a relay that shares
	// the application's pool takes up to Senders of its connections
	// (count them in the pool's MaxConns, or give the outbox a pool of
	// its own), and one more to listen, which it takes out of the pool
	// (the pool may open another in its place; the server counts it).
	Senders int
	// PollInterval is how often each of the relay's Senders looks for
	// pending rows when no notification came. Default 1s.
	PollInterval time.Duration
	// NoListen turns the notifications off: the relay polls alone (for a
	// connection pooler in transaction mode, which cannot LISTEN).
	NoListen bool
	// Retention is how long sent rows are kept, for `rabbitmw outbox ls`
	// and audits, before the relay deletes them (once a minute, ten times
	// BatchSize rows at a time, again after each dispatch while more are
	// past it). Default 24h; negative deletes a row when its confirm
	// comes.
	Retention time.Duration
	// PublishTimeout bounds the wait for a batch's confirms; the rows not
	// confirmed by then stay pending. Default 30s.
	PublishTimeout time.Duration
	// StopTimeout is how long Run, once its context is done, still waits
	// for the confirms of the batch in flight, so that they are recorded
	// and not sent again by the next relay, and for its statements in
	// flight, so that their connections go back to the pool open.
	// Default 5s.
	StopTimeout time.Duration
	// BackoffMin and BackoffMax bound the relay's wait after a dispatch
	// that could not reach the database, or none of whose rows RabbitMQ
	// confirmed and one of which failed for another cause than a nack
	// (no confirm): the n-th wait in a row is drawn from
	// [0, min(BackoffMax, BackoffMin·2ⁿ)]. They bound, the same way, the
	// wait of a row whose send failed (nacked, or no confirm) before it is
	// sent again, n being its attempts. Defaults 100ms and 10s.
	BackoffMin, BackoffMax time.Duration
	// Observer receives the relay's events.
	Observer Observer
}

// Observer receives the events of a Relay. Nil fields are not called.
// otelmw's Telemetry provides them (ExtractMap, OutboxDispatched).
type Observer struct {
	// Extract returns the context to publish a message under, from the
	// relay's and the writer's trace context that was stored with the
	// row (see pgstore.OutboxOptions.Inject), so that the publish's span
	// joins the writer's trace.
	Extract func(ctx context.Context, trace map[string]string) context.Context
	// Dispatched is called after each dispatch that took rows, with the
	// numbers sent (confirmed), parked, and left pending after a failed
	// send (nacked, or no confirm).
	Dispatched func(ctx context.Context, sent, parked, failed int)
}

// A Relay sends the pending rows of one outbox. Create it with [New].
type Relay struct {
	ob  *pgstore.Outbox
	pub Publisher
	log *slog.Logger

	batch, senders            int
	poll                      time.Duration
	listen                    bool
	retention                 time.Duration
	publishTimeout, stopAfter time.Duration
	bmin, bmax                time.Duration
	obs                       Observer
}

// New returns a relay of ob's rows to pub (a *broker.Broker). It panics if
// ob or pub is nil, or an option is negative where it may not be.
func New(ob *pgstore.Outbox, pub Publisher, opts Options) *Relay {
	if ob == nil || pub == nil {
		panic("relay: New: nil outbox or publisher")
	}
	if opts.BatchSize < 0 || opts.Senders < 0 || opts.PollInterval < 0 || opts.PublishTimeout < 0 || opts.StopTimeout < 0 || opts.BackoffMin < 0 || opts.BackoffMax < 0 {
		panic("relay: New: negative option")
	}
	r := &Relay{
		ob: ob, pub: pub, log: opts.Logger,
		batch: opts.BatchSize, senders: opts.Senders, poll: opts.PollInterval, listen: !opts.NoListen,
		retention: opts.Retention, publishTimeout: opts.PublishTimeout, stopAfter: opts.StopTimeout,
		bmin: opts.BackoffMin, bmax: opts.BackoffMax, obs: opts.Observer,
	}
	if r.log == nil {
		r.log = slog.New(slog.DiscardHandler)
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	if r.batch == 0 {
		r.batch = 100
	}
	if r.senders == 0 {
		r.senders = 2
	}
	def(&r.poll, time.Second)
	def(&r.retention, 24*time.Hour)
	def(&r.publishTimeout, 30*time.Second)
	def(&r.stopAfter, 5*time.Second)
	def(&r.bmin, 100*time.Millisecond)
	def(&r.bmax, 10*time.Second)
	if r.bmin > r.bmax {
		panic("relay: New: BackoffMin above BackoffMax")
	}
	return r
}

// Run sends the outbox's rows until ctx is done, then waits for the
// confirms of the batches in flight (StopTimeout at most), records them and
// returns nil. It returns an error earlier only if the publisher is closed
// (broker.ErrClosed). A database or RabbitMQ that cannot be reached is
// not an error: Run logs it, backs off and tries again. Every goroutine
// Run starts has ended when it returns, and the connections it used are
// back in the outbox's pool, open (but the listening one, which it took
// out of the pool and closed, and one whose statement outlived
// StopTimeout, which pgx closes and the pool drops meanwhile). Run may be
// called by several goroutines, and processes, at once: see the
// package's documentation.
func (r *Relay) Run(ctx context.Context) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	wakes := make([]chan struct{}, r.senders)
	for i := range wakes {
		wakes[i] = make(chan struct{}, 1)
	}
	var wg sync.WaitGroup
	lctx, stopListening := context.WithCancel(ctx)
	if r.listen {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.listenLoop(lctx, wakes)
		}()
	}
	var senders sync.WaitGroup
	for i, wake := range wakes {
		senders.Add(1)
		go func() {
			defer senders.Done()
			if err := r.sendLoop(ctx, wake, i == 0); err != nil {
				cancel(err)
			}
		}()
	}
	senders.Wait()
	stopListening()
	wg.Wait()
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return nil
}

// sendLoop dispatches batches until ctx is done, waiting for wake or the
// poll between batches that found the outbox drained. The loop that
// prunes deletes the sent rows past the retention, once a minute, and at
// each turn while a deletion finds more than it may take.
func (r *Relay) sendLoop(ctx context.Context, wake <-chan struct{}, prunes bool) error {
	var failures int // consecutive dispatches that failed
	nextPrune := time.Now()
	var after int64 // the next dispatch takes the rows past this id
	// Rows left pending since the last record of them, and when it was.
	var unsent int
	var warned time.Time
	// When the rows that this loop's dispatches failed are due again:
	// the wait for the next poll ends at the first.
	due := retries{step: r.bmin}
	warn := func(why error, retryIn time.Duration) {
		attrs := []slog.Attr{slog.Int("rows", unsent), slog.Any("error", why)}
		if retryIn > 0 {
			attrs = append(attrs, slog.Duration("retry_in", retryIn))
		}
		r.log.LogAttrs(ctx, slog.LevelWarn, "relay: messages not confirmed; they stay pending, retrying", attrs...)
		unsent, warned = 0, time.Now()
	}
	for ctx.Err() == nil {
		from := after
		res, out, last, err := r.dispatch(ctx, from)
		if err == nil {
			// Past this batch while rows may remain beyond it; from the
			// first again once the pass reached the end.
			after = 0
			if res.Taken >= r.batch {
				after = last
			}
		}
		unsent += res.Failed
		for _, d := range out.waits {
			due.add(time.Now().Add(d))
		}
		switch {
		case errors.Is(err, broker.ErrClosed):
			return err
		case err != nil && ctx.Err() != nil:
			return nil // stopped: the rows not recorded stay pending
		case err != nil:
			failures++
			d := r.backoff(failures)
			r.log.LogAttrs(ctx, slog.LevelWarn, "relay: dispatch failed; retrying",
				slog.String("error", err.Error()), slog.Duration("retry_in", d))
			clock.Sleep(ctx, d)
			continue
		case res.Failed > 0 && ctx.Err() != nil:
			return nil // stopped: the rows stay pending
		case res.Failed > 0 && res.Sent == 0 && out.down:
			// RabbitMQ could not be reached, or did not confirm in time:
			// the rows stay pending, and so would the next batch's.
			failures++
			d := r.backoff(failures)
			warn(out.why, d)
			clock.Sleep(ctx, d)
			continue
		case res.Failed > 0 && time.Since(warned) >= r.bmax:
			// Nacked rows, or some rows confirmed: RabbitMQ is there,
			// and the failed rows wait for their retry_at alone.
			warn(out.why, 0)
		}
		failures = 0
		if prunes && r.retention > 0 && !time.Now().Before(nextPrune) {
			limit := 10 * r.batch
			dctx, cancel := r.lingering(ctx)
			n, err := r.ob.DeleteSent(dctx, r.retention, limit)
			if err != nil && ctx.Err() == nil {
				r.log.LogAttrs(ctx, slog.LevelWarn, "relay: delete sent rows", slog.String("error", err.Error()))
			}
			cancel()
			// A deletion that took its limit may have left more: the next
			// turn deletes again, so that the deletions keep up with the
			// sends (ten rows deleted for each row a batch can send).
			nextPrune = time.Now().Add(time.Minute)
			if err == nil && n >= int64(limit) {
				nextPrune = time.Now()
			}
		}
		if res.Taken >= r.batch || res.Taken == 0 && from > 0 {
			continue // more are waiting, or the pass starts again
		}
		wait := r.poll
		if next, ok := due.next(); ok {
			wait = max(0, min(wait, time.Until(next)))
		}
		t := time.NewTimer(wait)
		select {
		case <-wake:
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
		due.passed(time.Now())
	}
	return nil
}

// retries holds the times at which rows that failed are due again,
// rounded up to a multiple of step (BackoffMin), so that it holds at most
// BackoffMax/BackoffMin + 1 of them (each is BackoffMax at most ahead),
// however many rows wait.
type retries struct {
	step time.Duration
	at   []time.Time // ascending, distinct
}

func (q *retries) add(t time.Time) {
	if q.step > 0 {
		if u := t.Truncate(q.step); u.Before(t) {
			t = u.Add(q.step)
		}
	}
	i, found := slices.BinarySearchFunc(q.at, t, time.Time.Compare)
	if !found {
		q.at = slices.Insert(q.at, i, t)
	}
}

// next returns the first time, if any.
func (q *retries) next() (time.Time, bool) {
	if len(q.at) == 0 {
		return time.Time{}, false
	}
	return q.at[0], true
}

// passed drops the times up to now.
func (q *retries) passed(now time.Time) {
	i, _ := slices.BinarySearchFunc(q.at, now, time.Time.Compare)
	for i < len(q.at) && !q.at[i].After(now) {
		i++
	}
	q.at = slices.Delete(q.at, 0, i)
}

// outcome is what dispatch says of the rows that failed.
type outcome struct {
	why   error           // the first failed row's reason
	down  bool            // one failed for a cause other than a nack: RabbitMQ is unreachable, or slow
	waits []time.Duration // the RetryAfter given to each row that failed
}

// backoff draws the n-th wait, of the relay's failures in a row or of a
// row's attempts, from [0, min(BackoffMax, BackoffMin·2ⁿ⁻¹)]; from
// [0, BackoffMax) where that bound is the longest duration there is, one
// past which does not fit in a time.Duration.
func (r *Relay) backoff(n int) time.Duration {
	return rand.N(min(backoff.Doubled(r.bmin, n-1, r.bmax), math.MaxInt64-1) + 1)
}

// lingering returns a context that ends StopTimeout after ctx does, or
// when cancel is called. The relay's statements and publishes run under
// it, so that a stop lets them end rather than cut them. A statement cut
// in flight costs its connection: pgx closes it in the background (a
// cancel request, then a wait of up to 15 s for the server), and the
// pool holds it as acquired until then, so that Run would return, and
// the pool's Close wait, with the connection still out.
func (r *Relay) lingering(ctx context.Context) (context.Context, context.CancelFunc) {
	lctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(r.stopAfter, cancel)
		context.AfterFunc(lctx, func() { t.Stop() })
	})
	return lctx, func() {
		stop()
		cancel()
	}
}

// dispatch takes and sends one batch of the rows past after, and returns
// its counts, what it found of the rows that failed (when res.Failed > 0)
// and the highest id it sent. Its statements and publishes outlive ctx by
// StopTimeout at most (see lingering), so that a stop does not throw away
// confirms that are on their way, nor the connection of a statement in
// flight; a batch taken after the stop is not sent, and its rows stay
// pending.
func (r *Relay) dispatch(ctx context.Context, after int64) (res pgstore.DispatchResult, out outcome, last int64, err error) {
	var closed error
	// The rows are held past the longest send (PublishTimeout, then
	// StopTimeout) and the recording's own bound, and no longer: a relay
	// that stalls gives them up to the others.
	hold := r.publishTimeout + r.stopAfter + 15*time.Second
	dctx, cancelDispatch := r.lingering(ctx)
	defer cancelDispatch()
	res, err = r.ob.Dispatch(dctx, pgstore.DispatchOptions{Limit: r.batch, After: after, DeleteSent: r.retention < 0, HoldFor: hold}, func(dctx context.Context, msgs []pgstore.OutboxMessage, results []pgstore.OutboxResult) {
		last = msgs[len(msgs)-1].ID // taken in id order
		if ctx.Err() != nil {
			return // stopped: the rows stay pending
		}
		pctx, cancel := context.WithTimeoutCause(dctx, r.publishTimeout, errors.New("relay: PublishTimeout passed before the confirm came"))
		defer cancel()
		errs := make([]error, len(msgs))
		var wg sync.WaitGroup
		for i := range msgs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = r.publish(pctx, &msgs[i])
			}()
		}
		wg.Wait()
		// A refusal that closes the channel fails every publish in
		// flight on it, and does not say whose it was: each row refused
		// so is sent again alone, one after the other, and only one
		// refused alone is parked.
		for i, err := range errs {
			if refusedByClose(err) {
				errs[i] = r.publish(pctx, &msgs[i])
			}
		}
		for i, err := range errs {
			results[i] = r.result(pctx, &msgs[i], err)
			if errors.Is(err, broker.ErrClosed) {
				closed = err
			}
		}
		for _, x := range results {
			if x.Sent || x.Park != nil || x.Failed == nil {
				continue
			}
			if out.why == nil {
				out.why = x.Failed
			}
			out.waits = append(out.waits, x.RetryAfter)
			out.down = out.down || !errors.Is(x.Failed, broker.ErrNacked)
		}
	})
	if res.Taken > 0 && r.obs.Dispatched != nil {
		r.obs.Dispatched(ctx, res.Sent, res.Parked, res.Failed)
	}
	if err == nil {
		err = closed
	}
	return res, out, last, err
}

// traced returns ctx with the writer's trace context of m, if any.
func (r *Relay) traced(ctx context.Context, m *pgstore.OutboxMessage) context.Context {
	if r.obs.Extract != nil && m.Trace != nil {
		return r.obs.Extract(ctx, m.Trace)
	}
	return ctx
}

// publish publishes one message, under the writer's trace context.
func (r *Relay) publish(ctx context.Context, m *pgstore.OutboxMessage) error {
	return r.pub.Publish(r.traced(ctx, m), m.Exchange, m.Key, m.Publishing)
}

// result classifies err, what publish returned for m; a row parked is
// logged under the writer's trace context. A row that failed is left out
// of the dispatches for a backoff that grows with its attempts, as the
// relay's own does with its failures.
func (r *Relay) result(ctx context.Context, m *pgstore.OutboxMessage, err error) pgstore.OutboxResult {
	ctx = r.traced(ctx, m)
	if err == nil {
		return pgstore.OutboxResult{Sent: true}
	}
	if parks(err) {
		r.log.LogAttrs(ctx, slog.LevelWarn, "relay: message parked",
			slog.Int64("row", m.ID), slog.String("message_id", m.Publishing.MessageId),
			slog.String("exchange", m.Exchange), slog.String("routing_key", m.Key),
			slog.String("error", err.Error()))
		return pgstore.OutboxResult{Park: err}
	}
	if cause := context.Cause(ctx); cause != nil && errors.Is(err, ctx.Err()) {
		err = fmt.Errorf("%w (%w)", err, cause)
	}
	return pgstore.OutboxResult{Failed: err, RetryAfter: r.backoff(m.Attempts + 1)}
}

// parks reports whether err says that RabbitMQ will not take the message
// as it is, so that sending it again cannot help until an operator acts.
// A nack (broker.ErrNacked) does not: RabbitMQ could not take the message
// now (a quorum queue without a leader, a full queue), and may later.
func parks(err error) bool {
	return errors.Is(err, broker.ErrUnroutable) || errors.Is(err, broker.ErrInvalidMessage) || refusedByClose(err)
}

// refusedByClose reports whether err is a refusal by the server that
// closed the channel (a missing write permission, a UserId that is not
// the connection's user, a body over its limit): the publish's own, or
// another's in flight on the same channel. A channel that the server
// closed for another publish may also end this one's session
// (ErrConnectionLost, which wraps the server's error): the broker
// publishes it again, and if its context ends meanwhile, its error wraps
// that one as its last; it was not refused.
func refusedByClose(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Server && ae.Recover && !errors.Is(err, broker.ErrConnectionLost)
}

// listenLoop listens on the outbox's channel and signals every wake at each
// notification, until ctx is done. A connection that breaks is made
// again, with backoff; after it is made, wake is signalled once, for the
// rows written meanwhile.
func (r *Relay) listenLoop(ctx context.Context, wakes []chan struct{}) {
	signal := func() {
		for _, wake := range wakes {
			select {
			case wake <- struct{}{}:
			default:
			}
		}
	}
	failures := 0
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, r.ob.Pool(), signal)
		if ctx.Err() != nil {
			return
		}
		failures++
		d := r.backoff(failures)
		r.log.LogAttrs(ctx, slog.LevelWarn, "relay: listening for notifications failed; polling meanwhile",
			slog.String("error", err.Error()), slog.Duration("retry_in", d))
		if d < r.poll {
			d = r.poll
		}
		clock.Sleep(ctx, d)
	}
}

func (r *Relay) listenOnce(ctx context.Context, pool *pgxpool.Pool, signal func()) error {
	actx, cancel := r.lingering(ctx) // a ping cut by the stop would keep the connection out of the pool
	conn, err := pool.Acquire(actx)
	cancel()
	if err != nil {
		return err
	}
	if ctx.Err() != nil {
		conn.Release()
		return ctx.Err()
	}
	// The connection is LISTENing: it goes back to no pool, since its
	// session holds the listen.
	c := conn.Hijack()
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		c.Close(cctx)
		cancel()
	}()
	if _, err := c.Exec(ctx, "LISTEN "+pgx.Identifier{r.ob.Channel()}.Sanitize()); err != nil {
		return err
	}
	signal() // rows written before the LISTEN took effect
	for {
		if _, err := c.WaitForNotification(ctx); err != nil {
			return err
		}
		signal()
	}
}
