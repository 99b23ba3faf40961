package pgstore

// ClaimSQL is the statement of s's claims, for the tests of its commit
// mode.
func ClaimSQL(s *Store) string { return s.claimSQL }
