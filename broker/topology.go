package broker

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// A DeclareMode says which queues Consume and Declare declare.
type DeclareMode int

const (
	// DeclareAll declares the work queue, the dead-letter queue and the
	// delay queues. It is the zero value, and the default.
	DeclareAll DeclareMode = iota
	// DeclareSupport declares the dead-letter queue and the delay queues,
	// and only checks that the work queue exists (a passive declare), for a
	// work queue declared elsewhere: with arguments of its own, or with
	// none, as hand-written consumers declare it. The work queue is never
	// declared, so its arguments never change; Quorum and DeliveryLimit,
	// which say how to declare it, are refused with this mode. Consume does
	// not need the work queue's dead-letter route: it publishes its
	// dead-letter copies itself.
	DeclareSupport
	// DeclareNone declares nothing: every queue must exist already.
	DeclareNone
)

// String returns "DeclareAll", "DeclareSupport" or "DeclareNone".
func (m DeclareMode) String() string {
	switch m {
	case DeclareAll:
		return "DeclareAll"
	case DeclareSupport:
		return "DeclareSupport"
	case DeclareNone:
		return "DeclareNone"
	}
	return "DeclareMode(" + strconv.Itoa(int(m)) + ")"
}

// DefaultDelays returns the delay ladder used when Topology.Delays is
// empty: 1s, 5s, 30s, 2m, 10m, 1h. The slice is the caller's, a new one at
// each call.
func DefaultDelays() []time.Duration {
	return []time.Duration{
		time.Second, 5 * time.Second, 30 * time.Second,
		2 * time.Minute, 10 * time.Minute, time.Hour,
	}
}

// A Topology describes the queues that serve a work queue. The zero value
// selects the defaults. The names and arguments are listed in the package
// documentation.
type Topology struct {
	// Declare says what to declare; see DeclareMode.
	Declare DeclareMode
	// Quorum makes the work queue a quorum queue (x-queue-type=quorum).
	// By default it is a classic durable queue. The dead-letter and delay
	// queues are classic unless QuorumSupport is set. It requires
	// DeclareAll: a work queue declared elsewhere has the type it was
	// declared with.
	Quorum bool
	// QuorumSupport makes the dead-letter queue and the delay queues
	// quorum queues too, replicated on a majority of a cluster's nodes,
	// as the work queue is with Quorum. Set it on a cluster: a classic
	// queue lives on one node, and while that node is down every
	// consumer's reconnect is refused its declare, so consumption stops
	// on the whole cluster, and no dead-letter or delay copy can be
	// stored (the settlement keeps the original and tries again), though
	// the work queue has its majority.
	//
	// A delay queue is then declared with x-dead-letter-strategy
	// at-least-once (and the x-overflow reject-publish it requires): an
	// expired copy leaves it only once the work queue has confirmed it,
	// even across a change of either queue's leader; a leader's node that
	// is killed can hold such copies back until it returns, and then up
	// to the server's dead_letter_worker_publisher_confirm_timeout (180 s
	// by default in 3.10) (README, In production). It needs RabbitMQ
	// 3.10 or later (message TTL on quorum queues).
	//
	// It is a setting of its own, off by default, because a queue's type
	// cannot change: queues that exist as classic ones are refused
	// (ErrQueueArguments, with the fix in the text) until they are
	// emptied and deleted. It works with DeclareAll and DeclareSupport,
	// which declare these queues; DeclareNone refuses it.
	QuorumSupport bool
	// Delays is the ladder of delay queues, one queue per delay. A delayed
	// retry goes to the shortest delay not below the one asked for (see the
	// package documentation). Each delay must be a positive whole number of
	// milliseconds, below 2^32 ms; order and duplicates do not matter.
	// Default: [DefaultDelays].
	Delays []time.Duration
	// DeliveryLimit sets x-delivery-limit on a quorum work queue: after
	// that many returns to the queue (requeues, lost connections), the
	// server dead-letters the message to the dead-letter queue, without
	// fault headers. It counts the returns of one copy only: every delayed
	// retry and every "busy" delay is a fresh copy whose count starts
	// again, so it does not stop a message that kills its consumer (the
	// Retry layer does: a death is a failed attempt). 0 means none; it
	// requires Quorum (and so DeclareAll).
	DeliveryLimit int
	// SingleActiveConsumer sets x-single-active-consumer on the work
	// queue: of all the consumers of the queue, in any process, one
	// receives its messages, and the next takes over when it is gone.
	// With ConsumeOptions.Workers 1 and no failures, messages are then
	// handled in the order they were published (the README's "Ordering"
	// says what breaks it). It requires DeclareAll, as Quorum does.
	SingleActiveConsumer bool
	// Exchanges are declared before the queues, in order. With
	// DeclareSupport they are only checked (a passive declare: each must
	// exist, whatever its settings); DeclareNone refuses them.
	Exchanges []Exchange
	// Bindings bind the work queue to exchanges, once it is declared: to
	// those of Exchanges or to any that exists (amq.topic, one declared
	// elsewhere). Bindings are only ever added: one dropped from the list
	// stays on the server until it is removed there. They require
	// DeclareAll: a work queue declared elsewhere is bound there.
	//
	// Delayed retries and dead-letters do not go back through these
	// exchanges: a delay queue returns its copies to the work queue
	// through the default exchange, and the dead-letter copy goes to the
	// dead-letter queue the same way, so a message that came through any
	// exchange is retried and dead-lettered alike.
	Bindings []Binding
}

// Exchange kinds that RabbitMQ has without plugins. A plugin's kind, such
// as "x-consistent-hash", is given by its name.
const (
	ExchangeDirect  = "direct"
	ExchangeTopic   = "topic"
	ExchangeFanout  = "fanout"
	ExchangeHeaders = "headers"
)

// An Exchange is an exchange that a Topology declares. Its zero settings
// are the ones an exchange that holds messages worth keeping needs: it is
// durable unless Transient.
type Exchange struct {
	// Name is the exchange's name; it must not be empty.
	Name string
	// Kind is ExchangeDirect, ExchangeTopic, ExchangeFanout,
	// ExchangeHeaders, or a plugin's kind (a name starting with "x-").
	Kind string
	// Transient makes the exchange non-durable: it is gone when its node
	// restarts, and so are its bindings.
	Transient bool
	// AutoDelete deletes the exchange when its last binding is removed.
	AutoDelete bool
	// Internal makes the exchange take messages from other exchanges only:
	// a publish to it is refused.
	Internal bool
	// Args are the exchange's arguments (alternate-exchange, a plugin's
	// settings).
	Args amqp.Table
}

// A Binding binds the work queue to an exchange.
type Binding struct {
	// Exchange is the exchange's name; the default exchange ("") cannot
	// be bound.
	Exchange string
	// Key is the routing key, or, for a topic exchange, the pattern ("*"
	// for one word, "#" for zero or more), such as "order.*". A fanout or
	// headers exchange ignores it.
	Key string
	// Args are the binding's arguments: for a headers exchange, the
	// headers to match and "x-match" ("all", the default, or "any").
	Args amqp.Table
}

// Queues names the queues of a work queue's topology.
type Queues struct {
	Work       string   // the work queue
	DeadLetter string   // its dead-letter queue, Work + ".dlq"
	Delays     []string // its delay queues, Work + ".delay.<tier>", shortest tier first
}

// Queues returns the names of the queues that serve queue under t (see the
// package documentation), for monitoring and for tools that read the
// dead-letter queue. It returns an error if t is not valid.
func (t Topology) Queues(queue string) (Queues, error) {
	top, err := t.resolve(queue)
	if err != nil {
		return Queues{}, err
	}
	q := Queues{Work: top.queue, DeadLetter: top.dlq, Delays: make([]string, len(top.tiers))}
	for i, tr := range top.tiers {
		q.Delays[i] = tr.queue
	}
	return q, nil
}

// tier is one rung of the delay ladder.
type tier struct {
	d     time.Duration
	queue string
}

// topology is a Topology resolved for one work queue.
type topology struct {
	mode      DeclareMode
	quorum    bool
	qsupport  bool // QuorumSupport
	limit     int
	single    bool
	queue     string
	dlq       string
	tiers     []tier // ascending, distinct
	exchanges []exchangeSpec
	bindings  []bindingSpec
}

func (t Topology) resolve(queue string) (topology, error) {
	if queue == "" {
		return topology{}, errors.New("broker: empty queue name")
	}
	if t.Declare < DeclareAll || t.Declare > DeclareNone {
		return topology{}, fmt.Errorf("broker: Topology.Declare: invalid mode %d", int(t.Declare))
	}
	if t.DeliveryLimit < 0 || (t.DeliveryLimit > 0 && !t.Quorum) {
		return topology{}, fmt.Errorf("broker: Topology.DeliveryLimit %d: needs Quorum and a value >= 0", t.DeliveryLimit)
	}
	if t.SingleActiveConsumer && t.Declare != DeclareAll {
		return topology{}, fmt.Errorf("broker: Topology.SingleActiveConsumer with Declare %v: it is a queue argument, which %v leaves to whoever declared the work queue (declare it with x-single-active-consumer there)", t.Declare, t.Declare)
	}
	if t.QuorumSupport && t.Declare == DeclareNone {
		return topology{}, errors.New("broker: Topology.QuorumSupport with DeclareNone, which declares nothing: declare the dead-letter and delay queues as quorum queues yourself, or use DeclareSupport")
	}
	if t.Quorum && t.Declare != DeclareAll {
		return topology{}, fmt.Errorf("broker: Topology.Quorum with Declare %v: Quorum and DeliveryLimit say how to declare the work queue, which %v leaves to whoever declared it (declare it a quorum queue there)", t.Declare, t.Declare)
	}
	exchanges, bindings, err := t.resolveExchanges()
	if err != nil {
		return topology{}, err
	}
	delays := t.Delays
	if len(delays) == 0 {
		delays = DefaultDelays()
	}
	ds := slices.Clone(delays)
	for _, d := range ds {
		if d <= 0 || d%time.Millisecond != 0 || d/time.Millisecond > math.MaxUint32 {
			return topology{}, fmt.Errorf("broker: Topology.Delays: %v is not a positive whole number of milliseconds below 2^32", d)
		}
	}
	slices.Sort(ds)
	ds = slices.Compact(ds)
	top := topology{
		mode:     t.Declare,
		quorum:   t.Quorum,
		qsupport: t.QuorumSupport,
		limit:    t.DeliveryLimit,
		single:   t.SingleActiveConsumer,
		queue:    queue,
		dlq:      queue + ".dlq",
		tiers:    make([]tier, len(ds)),

		exchanges: exchanges,
		bindings:  bindings,
	}
	for i, d := range ds {
		top.tiers[i] = tier{d: d, queue: queue + ".delay." + tierName(d)}
	}
	return top, nil
}

// resolveExchanges checks t's exchanges and bindings, and returns what
// to declare and bind.
func (t Topology) resolveExchanges() ([]exchangeSpec, []bindingSpec, error) {
	switch {
	case len(t.Exchanges) > 0 && t.Declare == DeclareNone:
		return nil, nil, errors.New("broker: Topology.Exchanges with DeclareNone, which declares and checks nothing: use DeclareSupport to check that they exist")
	case len(t.Bindings) > 0 && t.Declare != DeclareAll:
		return nil, nil, fmt.Errorf("broker: Topology.Bindings with Declare %v: the work queue is declared elsewhere, so bind it there (Bindings need DeclareAll)", t.Declare)
	}
	var exchanges []exchangeSpec
	seen := make(map[string]bool, len(t.Exchanges))
	for i, e := range t.Exchanges {
		switch {
		case e.Name == "":
			return nil, nil, fmt.Errorf("broker: Topology.Exchanges[%d]: empty name (the default exchange needs no declaring)", i)
		case len(e.Name) > 255:
			return nil, nil, fmt.Errorf("broker: Topology.Exchanges[%d]: name longer than 255 bytes", i)
		case seen[e.Name]:
			return nil, nil, fmt.Errorf("broker: Topology.Exchanges: %q twice", e.Name)
		}
		switch e.Kind {
		case ExchangeDirect, ExchangeTopic, ExchangeFanout, ExchangeHeaders:
		default:
			if !strings.HasPrefix(e.Kind, "x-") {
				return nil, nil, fmt.Errorf("broker: Topology.Exchanges[%d] %q: kind %q is not direct, topic, fanout, headers or a plugin's x- kind", i, e.Name, e.Kind)
			}
		}
		seen[e.Name] = true
		exchanges = append(exchanges, exchangeSpec{
			Name:       e.Name,
			Kind:       e.Kind,
			Durable:    !e.Transient,
			AutoDelete: e.AutoDelete,
			Internal:   e.Internal,
			Passive:    t.Declare == DeclareSupport,
			Args:       maps.Clone(e.Args),
		})
	}
	var bindings []bindingSpec
	for i, b := range t.Bindings {
		switch {
		case b.Exchange == "":
			return nil, nil, fmt.Errorf("broker: Topology.Bindings[%d]: empty exchange (the default exchange routes to every queue by its name and cannot be bound)", i)
		case len(b.Exchange) > 255, len(b.Key) > 255:
			return nil, nil, fmt.Errorf("broker: Topology.Bindings[%d]: exchange or key longer than 255 bytes", i)
		}
		bindings = append(bindings, bindingSpec{Exchange: b.Exchange, Key: b.Key, Args: maps.Clone(b.Args)})
	}
	return exchanges, bindings, nil
}

// tierName writes d in its largest exact unit: "1h", "2m", "30s", "1500ms".
func tierName(d time.Duration) string {
	switch {
	case d%time.Hour == 0:
		return strconv.FormatInt(int64(d/time.Hour), 10) + "h"
	case d%time.Minute == 0:
		return strconv.FormatInt(int64(d/time.Minute), 10) + "m"
	case d%time.Second == 0:
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	}
	return strconv.FormatInt(int64(d/time.Millisecond), 10) + "ms"
}

// tierFor returns the delay queue for a delay of d: the shortest tier not
// below d, or the longest tier when d exceeds them all (over is then true,
// and the caller must record when the message becomes due).
func (t *topology) tierFor(d time.Duration) (tr tier, over bool) {
	for _, tr := range t.tiers {
		if tr.d >= d {
			return tr, false
		}
	}
	return t.tiers[len(t.tiers)-1], true
}

// specs lists what to declare, work queue first.
func (t *topology) specs() []queueSpec {
	if t.mode == DeclareNone {
		return nil
	}
	var specs []queueSpec
	if t.mode == DeclareSupport {
		specs = append(specs, queueSpec{Name: t.queue, Passive: true})
	} else {
		args := amqp.Table{
			"x-dead-letter-exchange":    "",
			"x-dead-letter-routing-key": t.dlq,
		}
		if t.single {
			args["x-single-active-consumer"] = true
		}
		if t.quorum {
			args["x-queue-type"] = "quorum"
			if t.limit > 0 {
				args["x-delivery-limit"] = int64(t.limit)
			}
		}
		specs = append(specs, queueSpec{Name: t.queue, Args: args, Bindings: t.bindings})
	}
	var dlq amqp.Table
	if t.qsupport {
		dlq = amqp.Table{"x-queue-type": "quorum"}
	}
	specs = append(specs, queueSpec{Name: t.dlq, Args: dlq})
	for _, tr := range t.tiers {
		args := amqp.Table{
			"x-message-ttl":             int64(tr.d / time.Millisecond),
			"x-dead-letter-exchange":    "",
			"x-dead-letter-routing-key": t.queue,
		}
		if t.qsupport {
			// At least once: the copy stays in the delay queue until the
			// work queue confirms it. RabbitMQ falls back to at most once
			// without reject-publish.
			args["x-queue-type"] = "quorum"
			args["x-dead-letter-strategy"] = "at-least-once"
			args["x-overflow"] = "reject-publish"
		}
		specs = append(specs, queueSpec{Name: tr.queue, Args: args})
	}
	return specs
}

// declare declares the topology on s, exchanges first, and translates
// the server's refusals (see refusal).
func (t *topology) declare(ctx context.Context, s session) error {
	if err := s.DeclareExchanges(ctx, t.exchanges); err != nil {
		return t.refusal(err)
	}
	return t.refusal(s.Declare(ctx, t.specs()))
}

// names lists every queue of the topology, for Delete.
func (t *topology) names() []string {
	names := []string{t.queue, t.dlq}
	for _, tr := range t.tiers {
		names = append(names, tr.queue)
	}
	return names
}

// refusal turns a server refusal about this topology's queues into the
// package's errors, with the fix in the text. Other errors pass unchanged.
func (t *topology) refusal(err error) error {
	var ae *amqp.Error
	if err == nil || retryable(err) || !errors.As(err, &ae) || !ae.Server {
		return err
	}
	var ee *exchangeError
	if errors.As(err, &ee) {
		if ee.Binding != nil && ae.Code == amqp.PreconditionFailed {
			// The exchange exists (a missing one is NOT_FOUND): the
			// server refused the binding's arguments.
			return fmt.Errorf("broker: binding of queue %q to exchange %q with key %q refused (%s): fix its arguments in Topology.Bindings: %w",
				ee.Queue, ee.Exchange, ee.Binding.Key, ae.Reason, ae)
		}
		return t.exchangeRefusal(ee.Exchange, ae)
	}
	queue := t.queue
	var qe *queueError
	if errors.As(err, &qe) {
		queue = qe.Queue
	}
	if nodeDown(ae) {
		if queue != t.queue && !t.qsupport {
			return fmt.Errorf("%w: queue %q is on a node that is down (%s); Topology.QuorumSupport makes it a quorum queue, which outlives a node", ErrUnreachable, queue, ae.Reason)
		}
		return fmt.Errorf("%w: queue %q is on a node that is down (%s)", ErrUnreachable, queue, ae.Reason)
	}
	switch ae.Code {
	case amqp.PreconditionFailed:
		if queue == t.queue {
			return fmt.Errorf("%w: %q (%s): declare it yourself and use Topology{Declare: DeclareSupport}, or delete it so that it is declared again",
				ErrQueueArguments, queue, ae.Reason)
		}
		if strings.Contains(ae.Reason, "'x-queue-type'") {
			return fmt.Errorf("%w: %q (%s): Topology.QuorumSupport is %t, and the queue has the other type, which cannot change: set QuorumSupport as the queue was declared, or move its messages out (the dead-letter queue with replay or export), delete it, and let it be declared again",
				ErrQueueArguments, queue, ae.Reason, t.qsupport)
		}
		return fmt.Errorf("%w: %q (%s): delete it so that it is declared again, or declare the queues yourself and use Topology{Declare: DeclareNone}",
			ErrQueueArguments, queue, ae.Reason)
	case amqp.NotFound:
		if t.mode != DeclareAll {
			return fmt.Errorf("%w: %q (%s): declare it, or use Topology{Declare: DeclareAll} (mode is %v)", ErrQueueNotFound, queue, ae.Reason, t.mode)
		}
		return fmt.Errorf("%w: %q (%s)", ErrQueueNotFound, queue, ae.Reason)
	}
	return fmt.Errorf("broker: queue %q: %w", queue, err)
}

// exchangeRefusal is refusal for a server's refusal about exchange.
func (t *topology) exchangeRefusal(exchange string, ae *amqp.Error) error {
	switch ae.Code {
	case amqp.PreconditionFailed:
		return fmt.Errorf("%w: %q (%s): give Topology.Exchanges the settings it has, or delete it so that it is declared again",
			ErrExchangeArguments, exchange, ae.Reason)
	case amqp.NotFound:
		if t.mode == DeclareSupport {
			return fmt.Errorf("%w: %q (%s): declare it, or use Topology{Declare: DeclareAll} (mode is %v)", ErrExchangeNotFound, exchange, ae.Reason, t.mode)
		}
		return fmt.Errorf("%w: %q (%s): a binding names it: declare it, or list it in Topology.Exchanges", ErrExchangeNotFound, exchange, ae.Reason)
	case amqp.CommandInvalid:
		return fmt.Errorf("broker: exchange %q: the server refused its kind (%s): enable the plugin that provides it, or give Topology.Exchanges another kind: %w", exchange, ae.Reason, ae)
	}
	return fmt.Errorf("broker: exchange %q: %w", exchange, ae)
}

// refusal turns a server's 404 about queue into ErrQueueNotFound, or,
// for a queue whose node is down, ErrUnreachable; other errors pass
// unchanged.
func refusal(queue string, err error) error {
	var ae *amqp.Error
	if err != nil && !retryable(err) && errors.As(err, &ae) && ae.Server && ae.Code == amqp.NotFound {
		if nodeDown(ae) {
			return fmt.Errorf("%w: queue %q is on a node that is down (%s)", ErrUnreachable, queue, ae.Reason)
		}
		return fmt.Errorf("%w: %q (%s)", ErrQueueNotFound, queue, ae.Reason)
	}
	return err
}

// nodeDown reports a refusal about a queue that exists on a node that is
// down, or whose process stopped: RabbitMQ answers 404 NOT_FOUND, as for
// a missing queue, with one of these reasons. It passes once the node is
// back.
func nodeDown(ae *amqp.Error) bool {
	if ae.Code != amqp.NotFound {
		return false
	}
	for _, s := range []string{"is down or inaccessible", "process is stopped by supervisor", "has crashed and failed to restart"} {
		if strings.Contains(ae.Reason, s) {
			return true
		}
	}
	return false
}
