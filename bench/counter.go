package main

import (
	"strconv"
	"sync/atomic"
	"time"
)

// epoch is the origin of the times a counter keeps: monotonic nanoseconds
// since the process started.
var epoch = time.Now()

func now() int64 { return int64(time.Since(epoch)) }

// A counter is all that a contender's per-delivery path touches in a
// timed run: the business handler adds one to its message's effect count,
// and each ack adds the deliveries it settled to acked. Nothing else is
// recorded per delivery; latency samples (ackAt) exist only under
// -latency. Its methods are safe for concurrent use.
type counter struct {
	target int64         // deliveries whose acks end the run
	done   chan struct{} // closed when acked reaches target

	first atomic.Int64 // the first effect, ns since epoch
	last  atomic.Int64 // when acked reached target
	acked atomic.Int64

	effects []atomic.Int32 // business handler runs, by message index

	// ackAt is, under -latency only, when each message's ack was sent, in
	// Unix nanoseconds (so that the publishing process can compare).
	ackAt []atomic.Int64
}

func newCounter(deliveries int) *counter {
	return &counter{target: int64(deliveries), done: make(chan struct{}), effects: make([]atomic.Int32, deliveries)}
}

// index returns the message index of id ("m<i>"), or -1.
func index(id string) int {
	if len(id) < 2 {
		return -1
	}
	i, err := strconv.Atoi(id[1:])
	if err != nil {
		return -1
	}
	return i
}

// effect is the business handler: message id ran once more.
func (c *counter) effect(id string) {
	if c.first.Load() == 0 {
		c.first.CompareAndSwap(0, now())
	}
	if i := index(id); i >= 0 && i < len(c.effects) {
		c.effects[i].Add(1)
	}
}

// ack counts k deliveries acked (or acked as duplicates).
func (c *counter) ack(k int) {
	if a := c.acked.Add(int64(k)); a >= c.target && a-int64(k) < c.target {
		c.last.Store(now())
		close(c.done)
	}
}

// ackedAt records, under -latency, when the ack of message id was sent.
func (c *counter) ackedAt(id string) {
	if i := index(id); c.ackAt != nil && i >= 0 && i < len(c.ackAt) {
		c.ackAt[i].Store(time.Now().UnixNano())
	}
}

// elapsed is the time from the first effect to the last ack.
func (c *counter) elapsed() time.Duration { return time.Duration(c.last.Load() - c.first.Load()) }

// effectCounts returns the business effects: in total, the messages that
// had at least one, and those that had more than one.
func (c *counter) effectCounts() (total, unique, repeated int64) {
	for i := range c.effects {
		n := int64(c.effects[i].Load())
		total += n
		if n > 0 {
			unique++
		}
		if n > 1 {
			repeated++
		}
	}
	return total, unique, repeated
}

// percentile returns the p-th percentile (0 < p <= 100, nearest rank) of
// sorted.
func percentile(sorted []int64, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted))*p/100+0.999999) - 1
	return time.Duration(sorted[max(0, min(i, len(sorted)-1))])
}
