package main

import (
	"context"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/rabbitmw/rabbitmw"
)

// epoch is the origin of the times a recorder keeps: monotonic nanoseconds
// since the process started.
var epoch = time.Now()

func now() int64 { return int64(time.Since(epoch)) }

// A probe follows one delivery: when its handler started, and the store
// requests that carried its commands.
type probe struct {
	start atomic.Int64
	// requests counts the requests (round trips) that carried a command of
	// the delivery; share sums, in millionths, 1/k for each of them, k the
	// deliveries' commands the request carried (1 unless batched).
	requests, share atomic.Int64
}

// shareUnit is one request's share when it serves one command alone.
const shareUnit = 1_000_000

// add counts a request that carried one command of the delivery among k
// commands in all.
func (p *probe) add(k int) {
	p.requests.Add(1)
	p.share.Add(shareUnit / int64(max(k, 1)))
}

// reset clears the counts, for the next delivery on the probe.
func (p *probe) reset() {
	p.requests.Store(0)
	p.share.Store(0)
}

// cost returns what the delivery on p paid in store requests.
func (p *probe) cost() cost { return cost{requests: p.requests.Load(), share: p.share.Load()} }

// cost is what one delivery paid in store requests: the requests its
// commands travelled in (what it waited for), and its share of them in
// millionths (what it cost, a request shared by k commands counting 1/k).
// requests < 0: not counted for this contender.
type cost struct{ requests, share int64 }

var notCounted = cost{requests: -1}

type probeKey struct{}

// withProbe returns ctx carrying p, for the roundTrips hook.
func withProbe(ctx context.Context, p *probe) context.Context {
	return context.WithValue(ctx, probeKey{}, p)
}

// A recorder collects the figures of one contender's run. Its methods are
// safe for concurrent use by the contender's workers.
type recorder struct {
	target int64         // final settlements that end the run: one per message
	done   chan struct{} // closed when target is reached

	first, last atomic.Int64 // first handler start, last final settlement
	final       atomic.Int64
	deliveries  atomic.Int64
	redelivered atomic.Int64 // deliveries with the Redelivered flag
	failed      atomic.Int64 // settlements that returned an error
	outcomes    [rabbitmw.DeadLetter + 1]atomic.Int64

	lat  []int64 // handler-to-settle latencies, in settlement order
	nlat atomic.Int64

	effects []atomic.Int32 // business handler runs, by message index

	probes []probe // by delivery tag (rabbitmw contenders)

	rttAck, rttDup rttTally

	// -latency only: when each message was published, by index, and the
	// publish-to-ack latencies.
	pubAt  []atomic.Int64
	ackLat []int64
	nack   atomic.Int64
}

// acked records that the delivery of message id was acked, for -latency.
func (r *recorder) acked(id string) {
	if r.pubAt == nil {
		return
	}
	t := now()
	if i, err := strconv.Atoi(id[1:]); err == nil && i >= 0 && i < len(r.pubAt) {
		if p := r.pubAt[i].Load(); p > 0 {
			if j := r.nack.Add(1) - 1; j < int64(len(r.ackLat)) {
				r.ackLat[j] = t - p
			}
		}
	}
}

// rttTally sums the store requests of the deliveries of one outcome: the
// deliveries, their shares and the most requests that one waited for.
type rttTally struct{ n, share, max atomic.Int64 }

func (t *rttTally) add(c cost) {
	t.n.Add(1)
	t.share.Add(c.share)
	for m := t.max.Load(); c.requests > m && !t.max.CompareAndSwap(m, c.requests); m = t.max.Load() {
	}
}

func newRecorder(messages, prefetch int) *recorder {
	return &recorder{
		target:  int64(messages),
		done:    make(chan struct{}),
		lat:     make([]int64, 2*messages+prefetch),
		effects: make([]atomic.Int32, messages),
		// Delivery tags count from 1; a redelivered message gets a new tag.
		// Deliveries past the end go unsampled, which only a run with
		// many busy or failed messages would see.
		probes: make([]probe, 2*messages+prefetch+1),
	}
}

// begin marks the start of a handler and returns the time.
func (r *recorder) begin(redelivered bool) int64 {
	t := now()
	r.deliveries.Add(1)
	if redelivered {
		r.redelivered.Add(1)
	}
	for f := r.first.Load(); (f == 0 || t < f) && !r.first.CompareAndSwap(f, t); f = r.first.Load() {
	}
	return t
}

// probe returns the probe of the delivery with the given tag, or nil.
func (r *recorder) probe(tag uint64) *probe {
	if tag < uint64(len(r.probes)) {
		return &r.probes[tag]
	}
	return nil
}

// effect is the business handler: it records that message id ran.
func (r *recorder) effect(id string) {
	if i, err := strconv.Atoi(id[1:]); err == nil && i >= 0 && i < len(r.effects) {
		r.effects[i].Add(1)
	}
}

// end records the settlement of a delivery whose handler began at start
// (0 if unknown), with the store requests it made.
func (r *recorder) end(start int64, o rabbitmw.Outcome, c cost, err error) {
	t := now()
	if start > 0 {
		if i := r.nlat.Add(1) - 1; i < int64(len(r.lat)) {
			r.lat[i] = t - start
		}
	}
	if o > 0 && int(o) < len(r.outcomes) {
		r.outcomes[o].Add(1)
	}
	if err != nil {
		r.failed.Add(1)
		return
	}
	switch o {
	case rabbitmw.Ack:
		if c.requests >= 0 {
			r.rttAck.add(c)
		}
	case rabbitmw.Duplicate:
		if c.requests >= 0 {
			r.rttDup.add(c)
		}
	case rabbitmw.DeadLetter:
		// Final too: a dead-lettered message does not come back. None
		// should be; the report says so if one was.
	default:
		return // requeued or delayed: it comes back
	}
	for l := r.last.Load(); t > l && !r.last.CompareAndSwap(l, t); l = r.last.Load() {
	}
	if r.final.Add(1) == r.target {
		close(r.done)
	}
}

// latencies returns the recorded latencies.
func (r *recorder) latencies() []int64 {
	return slices.Clone(r.lat[:min(r.nlat.Load(), int64(len(r.lat)))])
}

// elapsed is the time from the first delivery to the last settlement.
func (r *recorder) elapsed() time.Duration {
	return time.Duration(r.last.Load() - r.first.Load())
}

// effectCounts returns the business effects: in total, the messages that
// had at least one, and those that had more than one.
func (r *recorder) effectCounts() (total, unique, repeated int64) {
	for i := range r.effects {
		n := int64(r.effects[i].Load())
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
