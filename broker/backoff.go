package broker

import (
	"math"
	"math/rand/v2"
	"time"

	// As doubling: this package's backoff is the type below.
	doubling "github.com/rabbitmw/rabbitmw/internal/backoff"
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
	ceil := doubling.Doubled(b.min, b.n, b.max)
	b.n++
	if ceil == math.MaxInt64 {
		return rand.N(ceil)
	}
	return rand.N(ceil + 1)
}

// reset starts the sequence again from min, after a connection that worked.
func (b *backoff) reset() { b.n = 0 }
