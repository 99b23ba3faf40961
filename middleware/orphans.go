package middleware

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
)

// maxOrphans bounds the claims a Dedup keeps to release later. Past it the
// oldest is forgotten, and its lease frees its key.
const maxOrphans = 256

// orphans are claims that may hold their keys with nobody to release them:
// a Claim whose answer was lost (the store went away as it answered) and
// whose immediate release failed too. Left alone, such a claim makes its
// message busy until its lease ends. Dedup releases them with the next
// claim that finds the store answering again. They live in the memory of
// one process: a process that dies leaves them to their leases.
type orphans struct {
	n      atomic.Int32 // len(claims), read without the lock on every claim
	mu     sync.Mutex
	claims []orphan
}

type orphan struct {
	key, token string
	until      time.Time // the end of its lease, when the store frees it anyway
}

func (o *orphans) add(key, token string, until time.Time) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.keep(orphan{key: key, token: token, until: until})
}

// keep appends c, dropping the oldest at the bound. o.mu is held.
func (o *orphans) keep(c ...orphan) {
	o.claims = append(o.claims, c...)
	if over := len(o.claims) - maxOrphans; over > 0 {
		o.claims = append(o.claims[:0], o.claims[over:]...)
	}
	o.n.Store(int32(len(o.claims)))
}

// release releases the orphans whose leases have not ended, and reports
// whether key was one of them. At the first release the store does not
// answer, it keeps the rest for the next time. Concurrent callers do not
// release the same orphan twice: the first takes them all.
func (o *orphans) release(ctx context.Context, s store.Store, key string) (found bool) {
	if o.n.Load() == 0 {
		return false
	}
	o.mu.Lock()
	claims := o.claims
	o.claims = nil
	o.n.Store(0)
	o.mu.Unlock()
	now := time.Now()
	for i, c := range claims {
		if !now.Before(c.until) {
			continue
		}
		rctx := settling(ctx, time.Now().Add(time.Second))
		err := s.Release(rctx, c.key, c.token)
		rctx.end()
		if err != nil && !errors.Is(err, store.ErrLostClaim) {
			o.mu.Lock()
			o.keep(claims[i:]...)
			o.mu.Unlock()
			return found
		}
		found = found || c.key == key
	}
	return found
}
