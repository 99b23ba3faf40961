package relay

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// retries keeps one time per step, rounded up, in order, and drops those
// that passed.
func TestRetries(t *testing.T) {
	base := time.Date(2026, 12, 3, 1, 0, 0, 0, time.UTC)
	ms := func(n int) time.Time { return base.Add(time.Duration(n) * time.Millisecond) }
	q := retries{step: 100 * time.Millisecond}
	_, ok := q.next()
	assert.False(t, ok, "none")
	for _, n := range []int{250, 30, 201, 300, 1, 100} {
		q.add(ms(n))
	}
	assert.Equal(t, []time.Time{ms(100), ms(300)}, q.at)
	next, ok := q.next()
	assert.True(t, ok)
	assert.Equal(t, ms(100), next)

	q.passed(ms(99))
	assert.Equal(t, []time.Time{ms(100), ms(300)}, q.at, "none passed")
	q.passed(ms(100))
	assert.Equal(t, []time.Time{ms(300)}, q.at)
	q.passed(ms(1000))
	assert.Empty(t, q.at)
}

// A row's backoff, drawn from its attempts, which the table keeps across
// relays and versions (thousands, for a row nacked under a relay that
// sent it again on every pass), stays within [0, BackoffMax], also when
// BackoffMax is the longest duration there is (no ceiling).
func TestBackoffOfManyAttempts(t *testing.T) {
	for _, bmax := range []time.Duration{10 * time.Second, math.MaxInt64} {
		r := &Relay{bmin: 100 * time.Millisecond, bmax: bmax}
		for _, attempts := range []int{0, 1, 36, 37, 63, 64, 5000} {
			var d time.Duration
			require.NotPanics(t, func() { d = r.backoff(attempts + 1) }, "BackoffMax %d, %d attempts", bmax, attempts)
			assert.GreaterOrEqual(t, d, time.Duration(0))
			assert.LessOrEqual(t, d, bmax)
		}
	}
}
