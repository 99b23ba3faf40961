package pgstore

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
)

// Claims that arrive together are sent together: one statement, one round
// trip and one commit for all of them, rather than one each. A Claim that
// finds no statement of claims in flight sends its own at once; one that
// finds a statement in flight waits in the queue. When a statement is
// answered, the claim that sent it hands the queue to the first claim
// still waiting in it, which sends the queue as the next statement. So a
// Store has at most one statement of claims in flight, a claim waits at
// most for the one before its own, and no goroutine runs but the
// callers'. A statement does not wait for a row that another transaction
// holds locked: its claim is answered processing (see Store), so that a
// locked row holds up neither the queue nor the other claims of its
// statement.

// A claimReq is a Claim waiting in the queue.
type claimReq struct {
	key, token string
	lease      time.Duration
	state      atomic.Int32 // reqWaiting, then one of the others, once
	wake       chan struct{}
	// The answer, once state is reqTaken and wake has fired.
	status store.Status
	err    error
}

const (
	reqWaiting   int32 = iota
	reqTaken           // in a statement: its answer will come
	reqLeading         // handed the queue: it sends it
	reqCancelled       // its caller gave up before either
)

// claimQueue is a Store's queue of claims.
type claimQueue struct {
	mu       sync.Mutex
	inFlight bool // a statement of claims is in flight, or being made
	queue    []*claimReq
}

// batchTimeout bounds a statement of claims sent for others: it does not
// end with the context of the claim that sends it.
const batchTimeout = 10 * time.Second

// claim claims key for token, through the queue.
func (s *Store) claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	if err := ctx.Err(); err != nil {
		return 0, s.fail("claim", key, err)
	}
	q := &s.queue
	q.mu.Lock()
	if !q.inFlight {
		q.inFlight = true
		q.mu.Unlock()
		st, err := s.claimOne(ctx, key, token, lease)
		s.handOver()
		return st, err
	}
	r := &claimReq{key: key, token: token, lease: lease, wake: make(chan struct{}, 1)}
	q.queue = append(q.queue, r)
	q.mu.Unlock()
	select {
	case <-r.wake:
	case <-ctx.Done():
		if r.state.CompareAndSwap(reqWaiting, reqCancelled) {
			return 0, s.fail("claim", key, ctx.Err()) // never sent
		}
		<-r.wake // taken or leading: the answer comes soon
	}
	if r.state.Load() == reqLeading {
		s.sendQueue(ctx)
		<-r.wake
	}
	return r.status, r.err
}

// handOver ends the statement in flight: it hands the queue to the first
// claim still waiting in it, or, if there is none, leaves the next claim
// to send its own.
func (s *Store) handOver() {
	q := &s.queue
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.queue) > 0 {
		r := q.queue[0]
		if r.state.CompareAndSwap(reqWaiting, reqLeading) {
			r.wake <- struct{}{}
			return
		}
		q.queue = q.queue[1:] // cancelled
	}
	q.queue = nil
	q.inFlight = false
}

// sendQueue sends the claims waiting in the queue as one statement, gives
// each its answer, and hands the queue over. A key already in the
// statement stays in the queue, for the next: a statement claims each row
// at most once.
func (s *Store) sendQueue(ctx context.Context) {
	q := &s.queue
	q.mu.Lock()
	var batch, rest []*claimReq
	keys := make(map[string]bool, len(q.queue))
	for _, r := range q.queue {
		switch {
		case r.state.Load() == reqCancelled:
		case keys[r.key]:
			rest = append(rest, r)
		case r.state.Load() == reqLeading || r.state.CompareAndSwap(reqWaiting, reqTaken):
			keys[r.key] = true
			batch = append(batch, r)
		}
	}
	q.queue = rest
	q.mu.Unlock()

	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), batchTimeout)
	defer cancel()
	if len(batch) == 1 {
		r := batch[0]
		r.status, r.err = s.claimOne(sctx, r.key, r.token, r.lease)
	} else {
		s.claimMany(sctx, batch)
	}
	s.handOver()
	for _, r := range batch {
		r.state.Store(reqTaken)
		r.wake <- struct{}{}
	}
}
