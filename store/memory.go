package store

import (
	"context"
	"hash/maphash"
	"math"
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

	mu   sync.Mutex
	base time.Time    // moment 0: the first call's time
	seed maphash.Seed // of the hashes of done's keys, made with base
	// A key is in at most one of claims (processing or abandoned) and its
	// done marks (until it expires), except for entries that have expired.
	// Done marks have maps of their own, with no token: they are most of
	// what a store holds (a day's worth of messages, where claims are the
	// few in flight), and an entry of done takes two thirds of the memory
	// of one of claims, which the map's growth writes and the garbage
	// collector scans. done is keyed by the hash of the key, which the map
	// hashes again without reading the key's bytes: when the map grows,
	// it moves each entry without a read of memory elsewhere per entry
	// (the key's bytes), which would cost a cache miss each. A key whose
	// hash is another's in done has its mark in doneMore instead: exact,
	// and almost always empty.
	claims   map[string]claim
	done     map[uint64]doneMark // by the hash of the key
	doneMore map[string]moment   // when the done mark expires
	fails    map[string]counter
	writes   int // writes since the last sweep
	kept     int // entries left by the last sweep
}

// A moment is a time as the store keeps it: nanoseconds since its base,
// read from the monotonic clock. An entry's two moments take 16 bytes
// that the garbage collector does not scan, where two time.Time take 48
// with a pointer each; a store that keeps a day of done marks holds
// millions of them.
type moment int64

// after returns the moment d after t, or the last moment if that is
// beyond it. A d that is not positive, outside Store's contract, gives t:
// the entry ends at once, as it did when it ended at a time in the past,
// rather than wrap around to the last moment and stay for good.
func (t moment) after(d time.Duration) moment {
	if d <= 0 {
		return t
	}
	if u := t + moment(d); u >= t {
		return u
	}
	return math.MaxInt64
}

// now returns the current moment. m.mu must be held. Every method calls
// it before it touches the maps: the first call sets m.seed too.
func (m *Memory) now() moment {
	if m.base.IsZero() {
		m.base, m.seed = time.Now(), maphash.MakeSeed()
	}
	return moment(time.Since(m.base))
}

// A doneMark is an entry of done: the key, and when its mark expires.
type doneMark struct {
	key string
	end moment
}

// doneEnd returns when the done mark of key, whose hash is h, expires,
// and false if it has none. m.mu must be held.
func (m *Memory) doneEnd(key string, h uint64) (moment, bool) {
	if d, ok := m.done[h]; ok && d.key == key {
		return d.end, true
	}
	if len(m.doneMore) == 0 {
		return 0, false
	}
	end, ok := m.doneMore[key]
	return end, ok
}

// markDone sets the done mark of key, whose hash is h, to expire at end;
// now is the current moment. m.mu must be held.
func (m *Memory) markDone(key string, h uint64, now, end moment) {
	if d, ok := m.done[h]; ok && d.key != key && now < d.end {
		if m.doneMore == nil {
			m.doneMore = make(map[string]moment)
		}
		m.doneMore[key] = end
		return
	}
	if m.done == nil {
		m.done = make(map[uint64]doneMark)
	}
	m.done[h] = doneMark{key: key, end: end}
	if len(m.doneMore) > 0 {
		delete(m.doneMore, key) // an earlier mark, made while h was another's
	}
}

// unmarkDone deletes the done mark of key, whose hash is h. m.mu must be
// held.
func (m *Memory) unmarkDone(key string, h uint64) {
	if d, ok := m.done[h]; ok && d.key == key {
		delete(m.done, h)
		return
	}
	delete(m.doneMore, key)
}

type claim struct {
	token   string
	expires moment // the end of the lease
	forget  moment // when the entry is gone: expires, plus the abandoned retention
}

type counter struct {
	n       int64
	expires moment
}

// NewMemory returns an empty Memory store.
func NewMemory() *Memory { return new(Memory) }

// Claim implements [Store].
func (m *Memory) Claim(ctx context.Context, key, token string, lease time.Duration) (Status, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	h := maphash.String(m.seed, key)
	if end, ok := m.doneEnd(key, h); ok {
		if now < end {
			return Done, nil
		}
		m.unmarkDone(key, h)
	}
	if c, ok := m.claims[key]; ok {
		switch {
		case now < c.expires:
			return Processing, nil
		case now < c.forget:
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
func (m *Memory) leased(token string, now moment, lease time.Duration) claim {
	end := now.after(lease)
	keep := m.AbandonedRetention
	if keep <= 0 {
		keep = DefaultAbandonedRetention
	}
	return claim{token: token, expires: end, forget: end.after(keep)}
}

// Extend implements [Store].
func (m *Memory) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	return m.owned(ctx, key, token, func(now moment) {
		m.claims[key] = m.leased(token, now, lease)
	})
}

// Complete implements [Store].
func (m *Memory) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return m.owned(ctx, key, token, func(now moment) {
		delete(m.claims, key)
		m.markDone(key, maphash.String(m.seed, key), now, now.after(retention))
	})
}

// Release implements [Store].
func (m *Memory) Release(ctx context.Context, key, token string) error {
	return m.owned(ctx, key, token, func(moment) {
		delete(m.claims, key)
	})
}

// owned runs f under the lock if token owns key, and returns ErrLostClaim
// otherwise.
func (m *Memory) owned(ctx context.Context, key, token string, f func(now moment)) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	c, ok := m.claims[key]
	if !ok || now >= c.expires || c.token != token {
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
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	c := m.fails[key]
	if now >= c.expires {
		c.n = 0
	}
	c.n++
	c.expires = now.after(ttl)
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
func (m *Memory) wrote(now moment) {
	const minSweep = 1024
	m.writes++
	if m.writes < minSweep || m.writes < m.kept {
		return
	}
	m.writes = 0
	for k, c := range m.claims {
		if now >= c.forget {
			delete(m.claims, k)
		}
	}
	for h, d := range m.done {
		if now >= d.end {
			delete(m.done, h)
		}
	}
	for k, end := range m.doneMore {
		if now >= end {
			delete(m.doneMore, k)
		}
	}
	for k, c := range m.fails {
		if now >= c.expires {
			delete(m.fails, k)
		}
	}
	m.kept = len(m.claims) + len(m.done) + len(m.doneMore) + len(m.fails)
}

// Len returns the number of keys that are claimed or done and not expired
// (abandoned claims are not counted), and the number of live failure
// counters. It is meant for tests and diagnostics.
func (m *Memory) Len() (claims, failures int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	for _, c := range m.claims {
		if now < c.expires {
			claims++
		}
	}
	for _, d := range m.done {
		if now < d.end {
			claims++
		}
	}
	for _, end := range m.doneMore {
		if now < end {
			claims++
		}
	}
	for _, c := range m.fails {
		if now < c.expires {
			failures++
		}
	}
	return claims, failures
}

var _ Store = (*Memory)(nil)
