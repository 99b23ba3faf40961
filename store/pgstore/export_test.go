package pgstore

import (
	"context"
	"time"

	"github.com/rabbitmw/rabbitmw"
)

// ClaimSQL is the statement of s's claims, for the tests of its commit
// mode.
func ClaimSQL(s *Store) string { return s.claimSQL }

// Queued returns how many claims wait in s's queue, behind the statement
// in flight.
func Queued(s *Store) int {
	s.queue.mu.Lock()
	defer s.queue.mu.Unlock()
	return len(s.queue.queue)
}

// InFlight reports whether s has a statement of claims in flight.
func InFlight(s *Store) bool {
	s.queue.mu.Lock()
	defer s.queue.mu.Unlock()
	return s.queue.inFlight
}

// GroupQueued returns how many members of h's groups wait for their
// group's connection; h is a Handler with GroupCommit.
func GroupQueued(h rabbitmw.Handler) int {
	gr := h.(*txHandler).groups
	gr.mu.Lock()
	defer gr.mu.Unlock()
	n := 0
	for _, g := range gr.open {
		n += len(g.queue)
	}
	return n
}

// Forget writes, as the claim of a transaction that ended does, the row
// that sends the next delivery of key to Dedup's claim.
func Forget(ctx context.Context, s *Store, key string, retention time.Duration) error {
	_, err := s.pool.Exec(ctx, s.forgottenSQL, []byte(key), retention.Microseconds())
	return err
}
