package deadletter

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/internal/expose"
	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
	"github.com/rabbitmw/rabbitmw/internal/clock"
	"github.com/rabbitmw/rabbitmw/internal/header"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// An Inspector works on the dead-letter queues of a [broker.Broker]'s
// server: it lists, replays, purges, exports and imports their messages,
// each operation on a connection of its own. It uses the Broker's
// settings (ReconnectMin and ReconnectMax to connect, Process to name its
// connections), and works while the Broker is open. It is safe for
// concurrent use.
type Inspector struct {
	b *broker.Broker
}

// New returns an Inspector of the dead-letter queues of b's server.
func New(b *broker.Broker) *Inspector {
	return &Inspector{b: b}
}

// Headers written by [Inspector.Replay] on the copy it sends back to the work
// queue.
const (
	// HeaderHistory keeps the fault headers of a message's earlier lives,
	// one table per replay, the most recent first: the replay takes the
	// fault headers (see [broker.HeaderError] and the others), the attempt
	// count, and the dead-letter records RabbitMQ writes (x-death,
	// x-first-death-*, x-delivery-count, [broker.HeaderDeaths],
	// [broker.HeaderMalformedXDeath]) off the message and puts them in a new
	// table here, under their own names, with "replayed-at" (a timestamp)
	// and "dead-letter-queue" (the queue it was replayed from). The
	// message goes back with none of them, so its next failure is counted
	// from the first attempt and written afresh, and no record of its
	// earlier dead-letterings is left in x-death for RabbitMQ's
	// dead-letter cycle check to find. At most
	// ReplayOptions.HistoryLimit tables are kept.
	HeaderHistory = "x-rabbitmw-history"
	// HeaderReplays counts the replays of a message (an int64), including
	// those whose tables HeaderHistory no longer holds.
	HeaderReplays = "x-rabbitmw-replays"
)

// Errors reported by the dead-letter operations.
var (
	// ErrNoDestination reports a message to replay that carries no
	// [broker.HeaderOriginalQueue] (the server or another tool
	// dead-lettered it): ReplayOptions.To must then name the queue to
	// send it to.
	ErrNoDestination = errors.New("deadletter: dead-lettered message has no original queue")
	// ErrOtherQueue reports a message to replay whose
	// [broker.HeaderOriginalQueue] names another queue than the one whose
	// dead-letter queue holds it (a header forged, or stale: a message
	// imported into another queue's dead-letter queue): ReplayOptions.To
	// must then name the queue to send it to.
	ErrOtherQueue = errors.New("deadletter: dead-lettered message names another queue")
)

// A Message describes a message in a dead-letter queue, as read from its
// headers. A header that is absent or of an unexpected type leaves its
// field at the zero value; Malformed names the headers of the second kind.
type Message struct {
	// ID is the message's MessageId property.
	ID string `json:"id"`
	// Key is the key by which the consumers' Dedup and Retry know the
	// message, without a Keying.Namespace: its id, or for a message
	// without one, the MD5 of its body in hex (see middleware.Key); empty
	// for a message with neither. A [Filter] selects a message by its key
	// as by its id.
	Key string `json:"key,omitempty"`
	// Queue is the work queue the broker dead-lettered the message from
	// ([broker.HeaderOriginalQueue]); empty for a message that the server or
	// another tool dead-lettered, also after the broker: one with an
	// x-death record (but of the queue's delay queues) more than a minute
	// younger than [broker.HeaderFailedAt], its broker's headers those of
	// an earlier life (it left a dead-letter queue other than by a replay,
	// and was forwarded whole).
	Queue string `json:"queue,omitempty"`
	// DeadLetteredFrom and Reason say where and why the server
	// dead-lettered the message ("rejected", "expired", "maxlen",
	// "delivery_limit"), when it did: RabbitMQ's x-first-death-queue and
	// x-first-death-reason, unless they name one of the work queue's delay
	// queues, whose copies expire by design; then the earliest x-death
	// record of another queue, if any.
	DeadLetteredFrom string `json:"dead_lettered_from,omitempty"`
	Reason           string `json:"reason,omitempty"`
	// Error and ErrorType are [broker.HeaderError] and
	// [broker.HeaderErrorType].
	Error     string `json:"error,omitempty"`
	ErrorType string `json:"error_type,omitempty"`
	// Attempts is the attempt count ([rabbitmw.HeaderAttempts]).
	Attempts int `json:"attempts"`
	// FirstError is the error of the first failure the broker recorded
	// ([broker.HeaderFirstError]), or Error without one.
	FirstError string `json:"first_error,omitempty"`
	// FirstFailure is the earliest time in the message's headers:
	// [broker.HeaderFirstFailedAt], its x-death records but those of the
	// work queue's delay queues (whose times are those of the copies'
	// expiries), its HeaderHistory, and LastFailure. LastFailure is
	// [broker.HeaderFailedAt], or, without it or when the server
	// dead-lettered the message after it (see Queue), the latest x-death
	// record.
	FirstFailure time.Time `json:"first_failure,omitzero"`
	LastFailure  time.Time `json:"last_failure,omitzero"`
	// Host and Process are [broker.HeaderHost] and [broker.HeaderProcess].
	Host    string `json:"host,omitempty"`
	Process string `json:"process,omitempty"`
	// Replays is [HeaderReplays].
	Replays int `json:"replays"`
	// BodySize is the length of the body, in bytes.
	BodySize int `json:"body_size"`
	// Malformed names the headers that are present with a type or form
	// other than the one the broker writes.
	Malformed []string `json:"malformed,omitempty"`
	// Delivery is the message itself.
	Delivery *amqp.Delivery `json:"-"`
}

// clockSkew is how far apart the clocks of a consumer, which writes
// broker.HeaderFailedAt, and of RabbitMQ, which writes x-death's times, may
// be, for readMessage.
const clockSkew = time.Minute

// readMessage describes d. It never fails: what it cannot read it
// leaves out, and names in Malformed.
func readMessage(d *amqp.Delivery) *Message {
	dl := &Message{ID: d.MessageId, BodySize: len(d.Body), Delivery: d}
	dl.Key, _ = middleware.Key(d)
	h := d.Headers
	str := func(k string) string {
		v, ok := h[k]
		if !ok {
			return ""
		}
		s, ok := v.(string)
		if !ok {
			dl.Malformed = append(dl.Malformed, k)
		}
		return s
	}
	dl.Queue = str(broker.HeaderOriginalQueue)
	dl.DeadLetteredFrom = str("x-first-death-queue")
	dl.Reason = str("x-first-death-reason")
	dl.Error = str(broker.HeaderError)
	dl.FirstError = str(broker.HeaderFirstError)
	if _, ok := h[broker.HeaderFirstError]; !ok {
		dl.FirstError = dl.Error
	}
	dl.ErrorType = str(broker.HeaderErrorType)
	dl.Host = str(broker.HeaderHost)
	dl.Process = str(broker.HeaderProcess)
	if v, ok := h[rabbitmw.HeaderAttempts]; ok {
		if _, ok := header.Int(v); !ok {
			dl.Malformed = append(dl.Malformed, rabbitmw.HeaderAttempts)
		}
		dl.Attempts = rabbitmw.PriorAttempts(d)
	}
	if v, ok := h[HeaderReplays]; ok {
		n, ok := header.Int(v)
		if !ok || n < 0 {
			dl.Malformed = append(dl.Malformed, HeaderReplays)
		} else {
			dl.Replays = int(min(n, 1<<30))
		}
	}
	var times []time.Time
	if v, ok := h[broker.HeaderFailedAt]; ok {
		if t, ok := v.(time.Time); ok {
			dl.LastFailure = t
			times = append(times, t)
		} else {
			dl.Malformed = append(dl.Malformed, broker.HeaderFailedAt)
		}
	}
	if v, ok := h[broker.HeaderFirstFailedAt]; ok {
		if t, ok := v.(time.Time); ok {
			times = append(times, t)
		} else {
			dl.Malformed = append(dl.Malformed, broker.HeaderFirstFailedAt)
		}
	}
	// A delay hop's record is no failure: the copy expired there by
	// design, after the failure that sent it.
	hop := func(queue string) bool {
		return dl.Queue != "" && strings.HasPrefix(queue, dl.Queue+".delay.")
	}
	if hop(dl.DeadLetteredFrom) {
		dl.DeadLetteredFrom, dl.Reason = "", ""
	}
	var deathTimes []time.Time
	var firstDeath time.Time
	fromRecords := dl.DeadLetteredFrom == ""
	if v, ok := h["x-death"]; ok {
		if !expose.WellFormedXDeath(v) {
			dl.Malformed = append(dl.Malformed, "x-death")
		} else {
			for _, r := range v.([]any) {
				rec := r.(amqp.Table)
				t, ok := rec["time"].(time.Time)
				queue, _ := rec["queue"].(string)
				if !ok || hop(queue) {
					continue
				}
				deathTimes = append(deathTimes, t)
				if fromRecords && (firstDeath.IsZero() || t.Before(firstDeath)) {
					firstDeath = t
					dl.DeadLetteredFrom = queue
					dl.Reason, _ = rec["reason"].(string)
				}
			}
		}
	}
	times = append(times, deathTimes...)
	if len(deathTimes) > 0 {
		latest := slices.MaxFunc(deathTimes, time.Time.Compare)
		if !dl.LastFailure.IsZero() && latest.Sub(dl.LastFailure) > clockSkew {
			// The server dead-lettered the message after the broker did:
			// it was taken out of a dead-letter queue other than by a
			// replay, forwarded whole, and failed again where the broker's
			// headers do not say.
			dl.Queue = ""
		}
		if dl.LastFailure.IsZero() || dl.Queue == "" {
			dl.LastFailure = latest
		}
	}
	if v, ok := h[HeaderHistory]; ok {
		entries, ok := v.([]any)
		if !ok {
			dl.Malformed = append(dl.Malformed, HeaderHistory)
		}
		for _, e := range entries {
			life, _ := e.(amqp.Table)
			if t, ok := life[broker.HeaderFailedAt].(time.Time); ok {
				times = append(times, t)
			}
		}
	}
	if len(times) > 0 {
		dl.FirstFailure = slices.MinFunc(times, time.Time.Compare)
	}
	return dl
}

// A Filter selects dead-lettered messages. The zero Filter selects every
// message; each field that is set narrows the selection, and a message
// must pass them all.
type Filter struct {
	// IDs selects the messages with one of these message ids, or keys
	// (Message.Key: the MD5 of the body of a message without an id).
	IDs []string
	// ErrorType selects the messages whose Message.ErrorType is this.
	ErrorType string
	// Error selects the messages whose Message.Error contains this text,
	// whatever the case.
	Error string
	// Group selects the messages of the group with this ID (see
	// [Groups]).
	Group string
	// Since and Until select the messages whose Message.LastFailure is
	// at or after Since, and before Until. A message with no failure time
	// is left out when either is set.
	Since, Until time.Time
	// Match, if not nil, selects the messages for which it returns true.
	Match func(*Message) bool
}

func (f *Filter) match(dl *Message) bool {
	switch {
	case len(f.IDs) > 0 && !slices.Contains(f.IDs, dl.ID) && (dl.Key == "" || !slices.Contains(f.IDs, dl.Key)),
		f.ErrorType != "" && dl.ErrorType != f.ErrorType,
		f.Error != "" && !strings.Contains(strings.ToLower(dl.Error), strings.ToLower(f.Error)),
		f.Group != "" && GroupID(dl) != f.Group,
		(!f.Since.IsZero() || !f.Until.IsZero()) && dl.LastFailure.IsZero(),
		!f.Since.IsZero() && dl.LastFailure.Before(f.Since),
		!f.Until.IsZero() && !dl.LastFailure.Before(f.Until),
		f.Match != nil && !f.Match(dl):
		return false
	}
	return true
}

// ListOptions selects what [Inspector.List] returns.
type ListOptions struct {
	Filter
	// Limit, if positive, is the largest number of messages returned.
	Limit int
	// Progress, if not nil, is called as messages are read, with the
	// number read so far and the number in the queue when reading began.
	Progress func(done, total int)
}

// List lists the messages in the dead-letter queue of work queue
// queue that opts selects, in queue order. The queue is left as it was,
// order included.
//
// RabbitMQ cannot show a message without taking it, so List takes
// every message that was in the queue when it began (basic.get with manual
// acknowledgement, one round trip each, on a connection of its own), and
// then returns them all at once by closing that connection: RabbitMQ puts
// the requeued messages of a classic queue back in their places.
// Meanwhile the messages are invisible to other readers of the dead-letter
// queue, they are held in this process's memory, and they come back marked
// redelivered. If the process dies, the server requeues them just the
// same.
//
// It returns an error wrapping [broker.ErrQueueNotFound] if the
// dead-letter queue does not exist.
func (in *Inspector) List(ctx context.Context, queue string, opts ListOptions) ([]*Message, error) {
	snap, err := in.snapshot(ctx, queue, opts.Progress)
	if err != nil {
		return nil, err
	}
	var out []*Message
	for _, dl := range snap.msgs {
		if opts.Limit > 0 && len(out) == opts.Limit {
			break
		}
		if opts.Filter.match(dl) {
			out = append(out, dl)
		}
	}
	return out, snap.close(in)
}

// A snapshot holds every message that a dead-letter queue held when it was
// taken, unacknowledged, on a session of its own.
type snapshot struct {
	s     transport.Session
	dlq   string
	msgs  []*Message
	done  []bool          // settled
	abort <-chan struct{} // ends close's wait (see WithAbort)
}

// snapshot takes the messages of queue's dead-letter queue.
func (in *Inspector) snapshot(ctx context.Context, queue string, progress func(done, total int)) (*snapshot, error) {
	dlq, err := deadLetterQueue(queue)
	if err != nil {
		return nil, err
	}
	s, err := expose.Dial(ctx, in.b)
	if err != nil {
		return nil, err
	}
	snap := &snapshot{s: s, dlq: dlq, abort: abortOf(ctx)}
	total, err := s.Length(ctx, dlq)
	if err != nil {
		s.Close()
		return nil, expose.Refusal(dlq, err)
	}
	for len(snap.msgs) < total {
		if err := ctx.Err(); err != nil {
			s.Close()
			return nil, err
		}
		d, ok, err := s.Get(ctx, dlq)
		if err != nil {
			s.Close()
			return nil, expose.Refusal(dlq, err)
		}
		if !ok {
			break
		}
		snap.msgs = append(snap.msgs, readMessage(d))
		if progress != nil {
			progress(len(snap.msgs), total)
		}
	}
	snap.done = make([]bool, len(snap.msgs))
	return snap, nil
}

func deadLetterQueue(queue string) (string, error) {
	q, err := broker.Topology{}.Queues(queue)
	return q.DeadLetter, err
}

// ack acknowledges message i: it leaves the dead-letter queue.
func (snap *snapshot) ack(i int) error {
	if err := snap.msgs[i].Delivery.Ack(false); err != nil {
		return expose.LostError(err)
	}
	snap.done[i] = true
	return nil
}

// close puts every message not acknowledged back in the queue, in its
// place, and closes the session. It closes the connection rather than
// nack them: RabbitMQ 3.10 requeues the unacknowledged messages of a
// closed connection in one go (5,000 in about 150 ms on loopback), where a
// basic.nack with multiple and requeue took 12 s for the same 5,000. The
// requeue completes a moment after the close; close waits, up to a few
// seconds, until the queue holds at least as many messages as it put back,
// so that a reader that comes next sees them all; not once the abort of
// the context the snapshot was taken under is closed (see WithAbort), as
// the server puts them back all the same.
func (snap *snapshot) close(in *Inspector) error {
	back := 0
	for _, done := range snap.done {
		if !done {
			back++
		}
	}
	err := snap.s.Close()
	if back == 0 {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if snap.abort != nil {
		go func() {
			select {
			case <-snap.abort:
				cancel()
			case <-ctx.Done():
			}
		}()
	}
	for {
		n, lerr := in.b.Len(ctx, snap.dlq)
		if lerr != nil || n >= back || clock.Sleep(ctx, 20*time.Millisecond) != nil {
			return err
		}
	}
}

// finishWithin is how long a replay or an import that stops, its context
// ended or a message failed, waits for the messages it has sent to be
// confirmed (and, in a replay, acknowledged), and a purge for the server's
// word on the acknowledgements it has sent, unless the wait is aborted
// (see [WithAbort]): a message given up on before its confirm may be in
// its destination all the same, uncounted, and, in a replay, stays in the
// dead-letter queue too.
const finishWithin = 5 * time.Second

// abortKey is the context key of WithAbort's channel.
type abortKey struct{}

// WithAbort returns a copy of ctx that carries abort, for an operator's
// second Ctrl-C. Once ctx has ended, an operation of an [Inspector] run
// under it sends nothing more, but waits up to 5 seconds for what it has
// in flight, so that each message ends in one queue (see [Inspector.Replay],
// [Inspector.Purge], [Inspector.Import]), and for the messages it put back
// to be back in their queue (see [Inspector.List]). Closing abort ends
// those waits at once: the messages in flight are given up on
// (ReplayResult.InDoubt lists a replay's), and the operation returns.
// Closing abort while ctx lasts changes nothing until ctx ends.
//
// The abort travels with ctx, rather than in each operation's options,
// because those waits run after ctx's end, under a context that keeps
// ctx's values only.
func WithAbort(ctx context.Context, abort <-chan struct{}) context.Context {
	return context.WithValue(ctx, abortKey{}, abort)
}

// abortOf returns the channel WithAbort gave ctx, or nil: a channel that
// is never ready.
func abortOf(ctx context.Context) <-chan struct{} {
	abort, _ := ctx.Value(abortKey{}).(<-chan struct{})
	return abort
}

// finishing returns the context to send a message under: it ends
// finishWithin after ctx, or at ctx's abort (see WithAbort) once ctx has
// ended, or when stop is called, which must be. Its goroutine ends with
// it.
func finishing(ctx context.Context) (send context.Context, stop context.CancelFunc) {
	send, stop = context.WithCancel(context.WithoutCancel(ctx))
	abort := abortOf(ctx)
	go func() {
		select {
		case <-ctx.Done():
		case <-send.Done():
			return
		}
		t := time.NewTimer(finishWithin)
		defer t.Stop()
		select {
		case <-t.C:
		case <-abort:
		case <-send.Done():
		}
		stop()
	}()
	return send, stop
}
