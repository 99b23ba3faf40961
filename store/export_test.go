package store

// Held returns the number of entries the maps hold, expired or not.
func (m *Memory) Held() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.claims) + len(m.done) + len(m.fails)
}
