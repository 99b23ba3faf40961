package store

import (
	"hash/maphash"
	"time"
)

// Held returns the number of entries the maps hold, expired or not.
func (m *Memory) Held() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.claims) + len(m.done) + len(m.doneMore) + len(m.fails)
}

// PlantCollision gives other a done mark, expiring after ttl, in the entry
// of done that key's hash selects, as if other's hash were key's.
func (m *Memory) PlantCollision(key, other string, ttl time.Duration) {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	if m.done == nil {
		m.done = make(map[uint64]doneMark)
	}
	m.done[maphash.String(m.seed, key)] = doneMark{key: other, end: now.after(ttl)}
}
