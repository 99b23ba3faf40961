package broker

import (
	"context"
	"math"
	"math/rand/v2"
	"time"
)

// backoff computes waits between connection attempts: exponential, capped,
// with full jitter (the n-th wait is uniform in [0, min(max, min*2^n)]), so
// that many consumers cut off at once do not reconnect in step.
type backoff struct {
	min, max time.Duration
	n        int
}

func newBackoff(minimum, maximum time.Duration) *backoff {
	return &backoff{min: minimum, max: maximum}
}

// next returns the next wait.
func (b *backoff) next() time.Duration {
	ceil := b.max
	if b.n < 62 {
		if c := b.min << b.n; c > 0 && c < b.max && c>>b.n == b.min {
			ceil = c
		}
	}
	b.n++
	if ceil == math.MaxInt64 {
		return rand.N(ceil)
	}
	return rand.N(ceil + 1)
}

// reset starts the sequence again from min, after a connection that worked.
func (b *backoff) reset() { b.n = 0 }

// sleep waits for d or until ctx is done, and reports whether the whole d
// passed.
func sleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
