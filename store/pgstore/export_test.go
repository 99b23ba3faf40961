package pgstore

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
