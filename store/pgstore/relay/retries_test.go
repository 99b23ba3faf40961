package relay

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
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
