package middleware

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
)

// A testItem is an item of a timerList in tests, due at at.
type testItem struct {
	timerLinks[testItem]
	at time.Time
}

func (x *testItem) links() *timerLinks[testItem] { return &x.timerLinks }
func (x *testItem) due() time.Time               { return x.at }

// In a synctest bubble, where each arming makes a timer, the list keeps
// one armed, not one more for each time it went from empty to not: a
// list that serves many short deliveries, then a long one renewed every
// interval, fires once per interval.
func TestTimerListOneTimerInABubble(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const every = 10 * time.Second
		var (
			q     timerList[testItem, *testItem]
			fires int
			mu    = make(chan struct{}, 1) // the owner's mutex
		)
		lock, unlock := func() { mu <- struct{}{} }, func() { <-mu }
		q.fire = func() {
			lock()
			defer unlock()
			now, ok := q.fired()
			if !ok {
				return
			}
			fires++
			for x := q.due(now); x != nil; x = q.due(now) {
				q.unlink(x)
				x.at = now.Add(every) // renewed
				q.push(x, now)
			}
			q.rearm(now)
		}
		for range 100 { // short deliveries: queued, then gone
			var x testItem
			lock()
			now := time.Now()
			x.at = now.Add(every)
			q.push(&x, now)
			q.unlink(&x)
			unlock()
			time.Sleep(time.Millisecond)
		}
		var long testItem
		lock()
		now := time.Now()
		long.at = now.Add(every)
		q.push(&long, now)
		unlock()
		time.Sleep(6*every + every/2)
		lock()
		q.unlink(&long)
		got := fires
		unlock()
		assert.LessOrEqual(t, got, 8, "timer callbacks in 6 intervals")
	})
}
