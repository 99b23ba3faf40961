package middleware

import "time"

// A timerList holds items in order of due time, with one timer armed for
// the head that serves them all: the renewals of a Dedup layer's claims
// ([renewer]) and the deadlines of the contexts it gives its handlers
// ([deadlineQueue]). Their items all wait the same interval, so they
// arrive nearly in order of due time: the search for an item's place
// from the tail is short, and the timer is set about once per interval,
// not once per item. An item embeds timerLinks; the list's owner guards
// it with a mutex of its own.
//
// A list may serve deliveries in testing/synctest bubbles, one after
// another, and outside them (a stack built once for a package's tests):
// a timer made in a bubble must not be touched outside it, and the one
// a bubble armed last never fires once the bubble has ended. So, inside a
// bubble, and on leaving one, each arming makes a timer of its own, and
// the callback of a timer made on the other side of a bubble's edge than
// the current one does nothing (see [timerList.fired]).
type timerList[T any, P timerItem[T]] struct {
	head, tail *T
	timer      *time.Timer
	armed      time.Time // when timer fires; zero when it is not armed
	bubbled    bool      // timer was made inside a synctest bubble
	fire       func()    // the timer's callback, which must call fired first
}

// timerLinks are an item's place in a timerList.
type timerLinks[T any] struct {
	prev, next *T
	queued     bool
}

// timerItem is a pointer to an item of a timerList. Its due time is the
// item's own (a context's deadline is one), which must not change while
// it is queued.
type timerItem[T any] interface {
	*T
	links() *timerLinks[T]
	due() time.Time
}

// push queues x, due at its due time, and arms the timer if x becomes the
// head. now is the current time, as the caller has just read it with
// time.Now (a caller that needs the time anyway saves the list a read of
// the clock, which is not cheap on every machine).
func (q *timerList[T, P]) push(x *T, now time.Time) {
	l := P(x).links()
	l.queued = true
	due := P(x).due()
	after := q.tail
	for after != nil && P(after).due().After(due) {
		after = P(after).links().prev
	}
	l.prev = after
	if after != nil {
		l.next = P(after).links().next
		P(after).links().next = x
	} else {
		l.next = q.head
		q.head = x
	}
	if l.next != nil {
		P(l.next).links().prev = x
	} else {
		q.tail = x
	}
	if q.head == x {
		q.arm(now)
	}
}

// unlink removes x, queued, from the list. The timer stays armed even if
// the list is now empty: stopping it here and arming it again at the next
// push would cost two timer updates per item, while letting it fire on an
// empty list costs one wake-up per interval.
func (q *timerList[T, P]) unlink(x *T) {
	l := P(x).links()
	if l.prev != nil {
		P(l.prev).links().next = l.next
	} else {
		q.head = l.next
	}
	if l.next != nil {
		P(l.next).links().prev = l.prev
	} else {
		q.tail = l.prev
	}
	l.prev, l.next, l.queued = nil, nil, false
}

// due returns the head if it is due at now, else nil.
func (q *timerList[T, P]) due(now time.Time) *T {
	if q.head != nil && !P(q.head).due().After(now) {
		return q.head
	}
	return nil
}

// arm makes the timer fire no later than the head's due time. A timer
// already armed for that time or earlier is left alone: when it fires,
// its callback arms it again (rearm) for the head of the list then. The
// list must not be empty; now is the time just read by time.Now.
func (q *timerList[T, P]) arm(now time.Time) {
	due := P(q.head).due()
	if bubbled := inBubble(now); bubbled || q.bubbled {
		// The timer armed may be another bubble's, ended, or one that
		// this goroutine must not touch: a new one, whatever is armed.
		// The old one is stopped if it was a bubble's and this is one,
		// lest each arming leave one more timer that arms another.
		if q.timer != nil && q.bubbled && bubbled {
			q.timer.Stop()
		}
		q.armed, q.bubbled = due, bubbled
		q.timer = time.AfterFunc(due.Sub(now), q.fire)
		return
	}
	if !q.armed.IsZero() && !q.armed.After(due) {
		return
	}
	q.armed = due
	d := due.Sub(now)
	if q.timer == nil {
		q.timer = time.AfterFunc(d, q.fire)
		return
	}
	q.timer.Reset(d)
}

// fired records that the timer has fired, and returns the time to take
// the items due at: the callback calls it first. It reports false,
// recording nothing, to the callback of a timer made on the other side
// of a synctest bubble's edge than the one armed last, which serves the
// list: its clock is not the items' clock. (Timers of two bubbles that
// run at once are not told apart: a list serves one bubble at a time.)
func (q *timerList[T, P]) fired() (now time.Time, ok bool) {
	now = time.Now()
	if inBubble(now) != q.bubbled {
		return now, false
	}
	q.armed = time.Time{}
	return now, true
}

// inBubble reports whether now, just read by time.Now, was read inside a
// testing/synctest bubble, where time.Now gives no monotonic clock
// reading (and == compares it: Round(0) strips it).
func inBubble(now time.Time) bool { return now == now.Round(0) }

// rearm arms the timer for the head, if there is one: the callback calls
// it once it has taken the items due, with the time fired returned.
func (q *timerList[T, P]) rearm(now time.Time) {
	if q.head != nil {
		q.arm(now)
	}
}
