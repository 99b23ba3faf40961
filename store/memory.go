package store

import (
	"context"
	"sync"
	"time"
)

// Memory is a [Store] held in the memory of one process: for tests, for
// demos, and for a single consumer process that accepts losing its marks on
// restart (after which a redelivered message can be processed again).
//
// Expiry is honoured exactly: an entry whose time has passed is treated as
// absent by every method. Expired entries are removed as the store is used
// (each write pays for a small share of a sweep), so a Memory needs no
// goroutine and nothing to close. Its zero value is ready to use.
type Memory struct {
	// AbandonedRetention is how long a claim whose lease ended without
	// Complete or Release is remembered after the lease, for Claim to
	// report it Abandoned (see [Store]). Zero means
	// [DefaultAbandonedRetention]. Set it before the first call.
	AbandonedRetention time.Duration

	mu     sync.Mutex
	claims map[string]claim
	fails  map[string]counter
	writes int // writes since the last sweep
	kept   int // entries left by the last sweep
}

type claim struct {
	token   string    // empty when done
	expires time.Time // the end of the lease, or of the done mark
	forget  time.Time // when the entry is gone: expires, plus the abandoned retention of a claim
}

type counter struct {
	n       int64
	expires time.Time
}

// NewMemory returns an empty Memory store.
func NewMemory() *Memory { return new(Memory) }

// Claim implements [Store].
func (m *Memory) Claim(ctx context.Context, key, token string, lease time.Duration) (Status, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if c, ok := m.claims[key]; ok {
		switch {
		case now.Before(c.expires) && c.token == "":
			return Done, nil
		case now.Before(c.expires):
			return Processing, nil
		case now.Before(c.forget):
			delete(m.claims, key)
			return Abandoned, nil
		}
	}
	if m.claims == nil {
		m.claims = make(map[string]claim)
	}
	m.claims[key] = m.leased(token, now, lease)
	m.wrote(now)
	return Claimed, nil
}

// leased returns the entry of a claim by token for lease from now.
func (m *Memory) leased(token string, now time.Time, lease time.Duration) claim {
	end := now.Add(lease)
	keep := m.AbandonedRetention
	if keep <= 0 {
		keep = DefaultAbandonedRetention
	}
	return claim{token: token, expires: end, forget: end.Add(keep)}
}

// Extend implements [Store].
func (m *Memory) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	return m.owned(ctx, key, token, func(now time.Time) {
		m.claims[key] = m.leased(token, now, lease)
	})
}

// Complete implements [Store].
func (m *Memory) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return m.owned(ctx, key, token, func(now time.Time) {
		end := now.Add(retention)
		m.claims[key] = claim{expires: end, forget: end}
	})
}

// Release implements [Store].
func (m *Memory) Release(ctx context.Context, key, token string) error {
	return m.owned(ctx, key, token, func(time.Time) {
		delete(m.claims, key)
	})
}

// owned runs f under the lock if token owns key, and returns ErrLostClaim
// otherwise.
func (m *Memory) owned(ctx context.Context, key, token string, f func(now time.Time)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	c, ok := m.claims[key]
	if !ok || !now.Before(c.expires) || c.token == "" || c.token != token {
		return ErrLostClaim
	}
	f(now)
	return nil
}

// Fail implements [Store].
func (m *Memory) Fail(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.fails[key]
	if !now.Before(c.expires) {
		c.n = 0
	}
	c.n++
	c.expires = now.Add(ttl)
	if m.fails == nil {
		m.fails = make(map[string]counter)
	}
	m.fails[key] = c
	m.wrote(now)
	return c.n, nil
}

// ResetFailures implements [Store].
func (m *Memory) ResetFailures(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	delete(m.fails, key)
	m.mu.Unlock()
	return nil
}

// wrote counts a write that may have added an entry, and sweeps out expired
// entries once the writes since the last sweep reach the number of entries
// that sweep left (and at least minSweep). A sweep visits at most twice as
// many entries as writes paid for it, so each write costs O(1) amortised,
// and the maps never hold more than twice the entries that were live at the
// last sweep, plus minSweep. m.mu must be held.
func (m *Memory) wrote(now time.Time) {
	const minSweep = 1024
	m.writes++
	if m.writes < minSweep || m.writes < m.kept {
		return
	}
	m.writes = 0
	for k, c := range m.claims {
		if !now.Before(c.forget) {
			delete(m.claims, k)
		}
	}
	for k, c := range m.fails {
		if !now.Before(c.expires) {
			delete(m.fails, k)
		}
	}
	m.kept = len(m.claims) + len(m.fails)
}

// Len returns the number of keys that are claimed or done and not expired
// (abandoned claims are not counted), and the number of live failure
// counters. It is meant for tests and diagnostics.
func (m *Memory) Len() (claims, failures int) {
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, c := range m.claims {
		if now.Before(c.expires) {
			claims++
		}
	}
	for _, c := range m.fails {
		if now.Before(c.expires) {
			failures++
		}
	}
	return claims, failures
}

var _ Store = (*Memory)(nil)
