package store

// Held returns the number of entries the maps hold, expired or not.
func (m *Memory) Held() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.claims) + len(m.fails)
}

// Queued returns the number of calls waiting for the next pipeline.
func (b *RedisBatcher) Queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.queue)
}
