package store

import (
	"context"
	"hash/maphash"
	"time"
)

// Inspect implements [Inspector].
func (m *Memory) Inspect(ctx context.Context, key string) (KeyState, error) {
	if err := ctx.Err(); err != nil {
		return KeyState{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	now := m.now()
	var k KeyState
	if end, ok := m.doneEnd(key, maphash.String(m.seed, key)); ok && now < end {
		k.Status, k.TTL = Done, time.Duration(end-now)
	} else if c, ok := m.claims[key]; ok {
		switch {
		case now < c.expires:
			k.Status, k.Token, k.TTL = Processing, c.token, time.Duration(c.expires-now)
		case now < c.forget:
			k.Status, k.Token, k.TTL = Abandoned, c.token, time.Duration(c.forget-now)
		}
	}
	if c, ok := m.fails[key]; ok && now < c.expires {
		k.Failures, k.FailuresTTL = c.n, time.Duration(c.expires-now)
	}
	return k, nil
}

var _ Inspector = (*Memory)(nil)
