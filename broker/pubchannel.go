package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/broker/internal/transport"
)

// replaceInterval bounds how often a session replaces its publish
// channel. A channel on which a publish was nacked is replaced before the
// next publish is sent on it, provided that it has been in use for
// replaceInterval at least and that the channel it replaced has been
// closed (all its publishes resolved). A queue that nacks for a reason of
// its own (at its length limit with overflow reject-publish) thus costs
// a new channel per replaceInterval at most, however fast the publishes
// come; a channel that the server nacks for good (RabbitMQ 3.10 after a
// quorum queue's leader died) is out of use within replaceInterval of its
// first nack.
const replaceInterval = time.Second

// A pubChannel is one confirm-mode publish channel of an amqpSession,
// and the publishes sent on it that wait for their confirm. Its state is
// guarded by the session's pendMu.
type pubChannel struct {
	s      *amqpSession
	ch     *amqp.Channel
	opened time.Time // the publisher goroutine's own

	closed   chan *amqp.Error
	returns  chan amqp.Return
	confirms chan amqp.Confirmation
	retire   chan struct{} // closed when the channel is replaced
	ended    chan struct{} // closed when run returns

	pending  map[uint64]*pendingPublish
	returned map[string]int // message id -> basic.returns not yet matched
	// unconfirmed is set when run has ended: no confirm will come for a
	// publish sent after that.
	unconfirmed bool
	// nacks counts the publishes the server nacked.
	nacks int
	// retired is set when the channel is replaced: nothing more is sent
	// on it, and run closes it once pending is empty.
	retired bool
}

// openPub opens a publish channel, in confirm mode. Its goroutine is not
// started yet (start).
func (s *amqpSession) openPub() (*pubChannel, error) {
	ch, err := s.conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		ch.Close()
		return nil, err
	}
	pc := &pubChannel{
		s:        s,
		ch:       ch,
		opened:   time.Now(),
		retire:   make(chan struct{}),
		ended:    make(chan struct{}),
		pending:  make(map[uint64]*pendingPublish),
		returned: make(map[string]int),
	}
	// amqp091 sends to the NotifyClose channel without blocking (it holds
	// one value), before it closes the notify channels.
	pc.closed = ch.NotifyClose(make(chan *amqp.Error, 1))
	// Unbuffered on purpose: amqp091's reader blocks handing over a return
	// until run takes it, and the server sends a message's basic.return
	// before its basic.ack; so the return is recorded before the ack can
	// be received.
	pc.returns = ch.NotifyReturn(make(chan amqp.Return))
	pc.confirms = ch.NotifyPublish(make(chan amqp.Confirmation))
	return pc, nil
}

// start starts the channel's goroutine, run.
func (pc *pubChannel) start() {
	pc.s.wg.Add(1)
	go pc.run()
}

// run resolves the channel's publishes from its returns and confirms,
// until the channel closes: by run itself, once the channel is retired
// and no publish waits on it; or unasked (the connection closed, or the
// server closed the channel for a publish it refused), which ends the
// session. It then fails the publishes still waiting, and ends.
func (pc *pubChannel) run() {
	s := pc.s
	defer s.wg.Done()
	defer close(pc.ended)
	retire, returns := pc.retire, pc.returns
	closing := false
	// closeIfDone closes the channel if it is retired and no publish waits
	// on it: no return nor confirm can come then, so amqp091's reader
	// cannot be blocked handing one to run while run waits for the
	// channel's close-ok.
	closeIfDone := func() {
		s.pendMu.Lock()
		done := pc.retired && len(pc.pending) == 0
		s.pendMu.Unlock()
		if done && !closing {
			closing = true
			pc.ch.Close() // an error: the connection is closing too
		}
	}
	for {
		select {
		case <-retire:
			retire = nil
			closeIfDone()
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			s.pendMu.Lock()
			pc.returned[r.MessageId]++
			s.pendMu.Unlock()
		case c, ok := <-pc.confirms:
			if !ok {
				if !closing {
					s.end("publish channel", <-pc.closed)
				}
				s.pendMu.Lock()
				for seq, p := range pc.pending {
					s.resolve(p, errChannelClosed)
					delete(pc.pending, seq)
				}
				pc.unconfirmed = true
				s.pendMu.Unlock()
				return
			}
			s.pendMu.Lock()
			p := pc.pending[c.DeliveryTag]
			delete(pc.pending, c.DeliveryTag)
			switch {
			case p == nil:
				if !c.Ack {
					pc.nacks++
				}
			case !p.written:
				// The confirm came before send got p's deferred
				// confirmation back: send resolves p.
				p.confirmed, p.ack = true, c.Ack
			default:
				s.resolve(p, pc.result(p, c.Ack))
			}
			s.pendMu.Unlock()
			if retire == nil {
				closeIfDone()
			}
		}
	}
}

// result is the result of p, whose confirm came with ack: ErrUnroutable
// if the server returned it, ErrNacked if it nacked it, nil if it acked
// it. RabbitMQ may nack a publish (a full queue's reject-publish) before
// it acks the earlier ones with one multiple ack whose range spans the
// nacked tag, and amqp091's NotifyPublish then reports the nacked tag as
// acked (confirms.Multiple, v1.16.0); its DeferredConfirmation keeps the
// nack. So a publish is acked only if both say so. s.pendMu must be held.
func (pc *pubChannel) result(p *pendingPublish, ack bool) error {
	if p.dc != nil {
		select {
		case <-p.dc.Done(): // settled before the confirm was handed over
			ack = ack && p.dc.Acked()
		default:
		}
	}
	if !ack {
		pc.nacks++
	}
	if n := pc.returned[p.msg.MessageId]; n > 0 {
		if n == 1 {
			delete(pc.returned, p.msg.MessageId)
		} else {
			pc.returned[p.msg.MessageId] = n - 1
		}
		return ErrUnroutable
	}
	if !ack {
		return ErrNacked
	}
	return nil
}

// A pendingPublish is one call of publish: the message, and its result.
// It is resolved exactly once, by whichever comes first of its confirm (or
// return), the close of its channel, a failure to send it, or its caller
// giving up before it was sent; done then receives the result (nil,
// ErrUnroutable, ErrNacked, errChannelClosed, a *sendError, or the
// caller's context error) and resolved is closed.
type pendingPublish struct {
	exchange, key string
	msg           amqp.Publishing
	// abandoned is the caller's ctx.Done(): once it is closed, a publish
	// not yet sent is not sent.
	abandoned <-chan struct{}

	done     chan error // buffered: resolve never blocks
	resolved chan struct{}
	settled  bool

	// written is set by send once the publish is written, with dc,
	// amqp091's record of its confirm (see result). confirmed and ack
	// hold a confirm that came before, for send to resolve p with.
	written   bool
	dc        *amqp.DeferredConfirmation
	confirmed bool
	ack       bool
}

// resolve settles p with res, unless it is settled already (the first
// result stands), and lets the next publish of p's id go. s.pendMu must be
// held.
func (s *amqpSession) resolve(p *pendingPublish, res error) {
	if p.settled {
		return
	}
	p.settled = true
	p.done <- res
	close(p.resolved)
	if s.byID[p.msg.MessageId] == p {
		delete(s.byID, p.msg.MessageId)
	}
}

// errChannelClosed tells a waiting publish that its channel closed before the
// confirm; the session's reason says why.
var errChannelClosed = errors.New("publish channel closed")

// A sendError is amqp091's failure to send a publish.
type sendError struct{ err error }

func (e *sendError) Error() string { return e.err.Error() }

// publisher sends the publishes handed to it, one at a time, until done is
// closed; it ends then. Being the only caller of Publish on a publish
// channel, it knows the sequence number of each publish without holding a
// lock across the call; and it replaces the channel between two publishes
// (replaceNacked).
func (s *amqpSession) publisher() {
	defer s.wg.Done()
	for {
		select {
		case p := <-s.requests:
			s.replaceNacked()
			s.send(p)
		case <-s.done:
			return
		}
	}
}

// replaceNacked replaces the publish channel with a new one if the server
// nacked a publish on it, as far as replaceInterval allows. The publishes
// that wait on the old channel get their results from it, as they come;
// it is closed once they all have. If a new channel cannot be opened, the
// old one stays in use.
func (s *amqpSession) replaceNacked() {
	old := s.pub
	s.pendMu.Lock()
	nacks := old.nacks
	s.pendMu.Unlock()
	if nacks == 0 || time.Since(old.opened) < replaceInterval {
		return
	}
	if s.retired != nil {
		select {
		case <-s.retired.ended:
		default:
			return // the last one replaced still waits for confirms
		}
	}
	pc, err := s.openPub()
	if err != nil {
		if s.conn.IsClosed() {
			return // the session ends
		}
		old.opened = time.Now() // try again after replaceInterval
		s.log.LogAttrs(context.Background(), slog.LevelWarn, "broker: publish channel nacked, and a new one cannot be opened",
			slog.String("node", s.node), slog.String("connection", s.name),
			slog.Int("nacks", nacks), slog.String("error", err.Error()))
		s.obs.publishChannel(PublishChannelEvent{Node: s.node, Connection: s.name, Nacks: nacks, Err: err})
		return
	}
	pc.start()
	s.pendMu.Lock()
	old.retired = true
	waiting := len(old.pending)
	s.pendMu.Unlock()
	close(old.retire)
	s.pub, s.retired = pc, old
	s.log.LogAttrs(context.Background(), slog.LevelInfo, "broker: publish channel replaced after the server nacked publishes on it",
		slog.String("node", s.node), slog.String("connection", s.name),
		slog.Int("nacks", nacks), slog.Duration("in_use", time.Since(old.opened)),
		slog.Int("waiting_for_confirms", waiting))
	s.obs.publishChannel(PublishChannelEvent{Node: s.node, Connection: s.name, Nacks: nacks})
}

// send publishes p on the publish channel and records it as pending its
// confirm.
func (s *amqpSession) send(p *pendingPublish) {
	select {
	case <-p.abandoned:
		// Its caller gave up before it was sent: it is not sent.
		s.pendMu.Lock()
		s.resolve(p, errAbandoned)
		s.pendMu.Unlock()
		return
	default:
	}
	pc := s.pub
	// Outside pendMu: amqp091 takes its confirms' lock here, which its
	// reader holds while it hands a confirm to the channel's goroutine.
	seq := pc.ch.GetNextPublishSeqNo()
	s.pendMu.Lock()
	if pc.unconfirmed {
		// The channel closed, and its confirms with it.
		s.resolve(p, errChannelClosed)
		s.pendMu.Unlock()
		return
	}
	pc.pending[seq] = p
	s.pendMu.Unlock()
	dc, err := pc.ch.PublishWithDeferredConfirm(p.exchange, p.key, true, false, p.msg)
	s.pendMu.Lock()
	defer s.pendMu.Unlock()
	if err != nil {
		// The channel's goroutine may have failed p already, if the
		// channel closed meanwhile: the first result stands.
		if pc.pending[seq] == p {
			delete(pc.pending, seq)
		}
		s.resolve(p, &sendError{err: err})
		return
	}
	p.written, p.dc = true, dc
	if p.confirmed {
		s.resolve(p, pc.result(p, p.ack))
	}
}

// errAbandoned resolves a publish whose caller gave up before it was sent;
// Publish returns its context's error in its place.
var errAbandoned = errors.New("publish abandoned")

func (s *amqpSession) Publish(ctx context.Context, exchange, key string, msg amqp.Publishing) error {
	// amqp091 would refuse an invalid message as it writes it, closing the
	// connection; RabbitMQ, or a consumer's amqp091, would close theirs.
	size, err := transport.CheckPublishing(exchange, key, msg)
	if err == nil {
		err = transport.FitFrame(size, s.maxProps, 0)
	}
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err // nothing sent
	}
	p := &pendingPublish{
		exchange:  exchange,
		key:       key,
		msg:       msg,
		abandoned: ctx.Done(),
		done:      make(chan error, 1),
		resolved:  make(chan struct{}),
	}
	if err := s.awaitTurn(ctx, p); err != nil {
		return err
	}
	if err := s.handOver(ctx, p); err != nil {
		return err
	}
	select {
	case res := <-p.done:
		if res == errAbandoned {
			// Not sent, ctx being done: both were ready at once.
			return ctx.Err()
		}
		return s.publishResult(res, exchange, key)
	case <-ctx.Done():
		// The publish stays pending: its channel's goroutine removes it,
		// and matches its return, if any.
		return ctx.Err()
	}
}

// awaitTurn waits until no other publish of p's message id is in flight
// (see byID), and records p as the one in flight. It returns ctx's error
// or the session's reason, without recording p, if either comes first.
func (s *amqpSession) awaitTurn(ctx context.Context, p *pendingPublish) error {
	for {
		s.pendMu.Lock()
		prev := s.byID[p.msg.MessageId]
		if prev == nil {
			s.byID[p.msg.MessageId] = p
			s.pendMu.Unlock()
			return nil
		}
		s.pendMu.Unlock()
		select {
		case <-prev.resolved:
		case <-ctx.Done():
			return ctx.Err()
		case <-s.done:
			return s.err
		}
	}
}

// handOver hands p to the publisher goroutine, which resolves it from
// then on. If ctx is done or the session closes first, p is not handed
// over: handOver resolves it with that error and returns it.
func (s *amqpSession) handOver(ctx context.Context, p *pendingPublish) error {
	var res error
	select {
	case s.requests <- p:
		return nil
	case <-ctx.Done():
		res = ctx.Err()
	case <-s.done:
		res = s.err
	}
	s.pendMu.Lock()
	s.resolve(p, res)
	s.pendMu.Unlock()
	return res
}

// publishResult translates res, the result of a publish handed over (see
// pendingPublish), into the error Publish returns.
func (s *amqpSession) publishResult(res error, exchange, key string) error {
	var se *sendError
	switch {
	case res == nil:
		return nil
	case errors.As(res, &se):
		return s.translate(se.err)
	case errors.Is(res, errChannelClosed):
		<-s.done // closed before: its channel closed unasked
		var ae *amqp.Error
		if errors.As(s.err, &ae) && ae.Server && ae.Recover {
			// The server closed the channel for a publish it refused.
			// Its reason names the exchange and the vhost ("no exchange
			// 'x' in vhost 'y'"): an exchange named as the vhost is not
			// the one missing unless it stands in the exchange's place.
			if ae.Code == amqp.NotFound && exchange != "" && strings.Contains(ae.Reason, "no exchange '"+exchange+"' in vhost '") {
				return fmt.Errorf("%w: exchange %q does not exist (%s)", ErrUnroutable, exchange, ae.Reason)
			}
			if ae.Code != amqp.NotFound {
				return fmt.Errorf("broker: publish refused by the server: %w", ae)
			}
		}
		return s.err
	default:
		return fmt.Errorf("%w: exchange %q, routing key %q", res, exchange, key)
	}
}
