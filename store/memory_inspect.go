package store

import (
	"context"
	"time"
)

// Inspect implements [Inspector].
func (m *Memory) Inspect(ctx context.Context, key string) (KeyState, error) {
	if err := ctx.Err(); err != nil {
		return KeyState{}, err
	}
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	var k KeyState
	if c, ok := m.claims[key]; ok {
		switch {
		case now.Before(c.expires) && c.token == "":
			k.Status, k.TTL = Done, c.expires.Sub(now)
		case now.Before(c.expires):
			k.Status, k.Token, k.TTL = Processing, c.token, c.expires.Sub(now)
		case now.Before(c.forget):
			k.Status, k.Token, k.TTL = Abandoned, c.token, c.forget.Sub(now)
		}
	}
	if c, ok := m.fails[key]; ok && now.Before(c.expires) {
		k.Failures, k.FailuresTTL = c.n, c.expires.Sub(now)
	}
	return k, nil
}

var _ Inspector = (*Memory)(nil)
