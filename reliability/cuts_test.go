//go:build reliability

package reliability_test

// The set-up the connection-cut scenarios (cutacks_test.go,
// cutcopies_test.go) share: two consumer processes whose connections go
// through a TCP proxy, which counts the basic.consume methods they send,
// so that each cut comes once every consumer is consuming again and has
// been for a moment: every cut finds sessions at work, none in its
// handshake.

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// cutOpts are the consumers' options in the cut scenarios, on the proxy's
// amqpURL: poison mode, four attempts a millisecond or two apart, short
// store delays, and reconnections within 100 ms, so that the cuts come
// fast (the backoff never resets, each session lasting less than a
// second).
func cutOpts(amqpURL string, prefetch int) consumerOpts {
	return consumerOpts{
		amqpURL:      amqpURL,
		workers:      16,
		prefetch:     prefetch,
		mode:         "poison",
		maxAttempts:  4,
		backoffMin:   time.Millisecond,
		backoffMax:   2 * time.Millisecond,
		lease:        10 * time.Second,
		busy:         50 * time.Millisecond,
		unavailable:  50 * time.Millisecond,
		timeout:      5 * time.Second,
		reconnectMax: 100 * time.Millisecond,
	}
}

// cuts is a cut scenario under way.
type cuts struct {
	r        *run
	px       *proxy
	procs    []*proc
	consumes atomic.Int64 // basic.consume methods sent through the proxy
	progress []int64      // effects after each cut
	began    time.Time
}

// startCuts starts the consumers names on r, with opts, through px; sent,
// if not nil, also sees what they send.
func startCuts(r *run, px *proxy, opts consumerOpts, sent func([]byte), names ...string) *cuts {
	c := &cuts{r: r, px: px, began: time.Now()}
	px.onSent(func(b []byte) {
		if bytes.Contains(b, basicConsume) {
			c.consumes.Add(1)
		}
		if sent != nil {
			sent(b)
		}
	})
	for _, name := range names {
		c.procs = append(c.procs, r.startConsumer(name, opts))
	}
	return c
}

// publish publishes msgs, and stops the test if that fails.
func (c *cuts) publish(ctx context.Context, t *testing.T, msgs []amqp.Publishing) {
	t.Helper()
	require.NoError(t, <-c.r.publishAsync(ctx, msgs, 8))
}

// cut waits until every consumer consumes again (at most 20 s), waits
// after, closes every connection through the proxy, and notes the
// effects so far.
func (c *cuts) cut(ctx context.Context, t *testing.T, after time.Duration) {
	t.Helper()
	want := int64(len(c.progress)+1) * int64(len(c.procs))
	if err := awaitCount(ctx, &c.consumes, want, 20*time.Second); err != nil { // the count in the message is read after the wait
		t.Fatalf("the consumers did not all consume again within 20s of cut %d (%d effects then): %v", len(c.progress), c.r.count(ctx, "total"), err)
	}
	time.Sleep(after)
	c.px.heal() // closes every connection through the proxy
	c.progress = append(c.progress, c.r.count(ctx, "total"))
}

// finish follows the last cut: it publishes tail, which is consumed only
// if the consumers resume, waits (at most 40 s) until the messages all
// (tail's included) are done, and ends the run. It returns the ending, the effects at the
// last cut, and how long after it the run ended.
func (c *cuts) finish(ctx context.Context, t *testing.T, all []string, tail []amqp.Publishing) (e ending, atLastCut int64, endedIn time.Duration) {
	t.Helper()
	lastCut := time.Now()
	atLastCut = c.r.count(ctx, "total")
	c.publish(ctx, t, tail)
	qctx, qcancel := context.WithTimeout(ctx, 40*time.Second)
	defer qcancel()
	require.NoError(t, c.r.awaitQuiet(qctx, len(all), 2*time.Second), "after the last cut (%d effects then)", atLastCut)
	endedIn = time.Since(lastCut)
	return c.r.end(ctx, all, c.procs...), atLastCut, endedIn
}

// lostConnections returns the number of lost connections each consumer
// logged.
func (c *cuts) lostConnections() []int {
	var n []int
	for _, p := range c.procs {
		n = append(n, p.logCount(`msg="broker: connection lost"`))
	}
	return n
}

// report logs the effects after each cut, and the consumers' figures.
func (c *cuts) report(t *testing.T, e ending, lostConns []int, endedIn time.Duration) {
	t.Logf("effects after each cut: %v", c.progress)
	t.Logf("consumers: %+v; lost connections logged %v for %d cuts; the run ended %v after the last cut; took %v",
		e.stats, lostConns, len(c.progress), endedIn.Round(time.Millisecond), time.Since(c.began).Round(time.Millisecond))
}

// basicConsume is the class and method id of basic.consume, as a method
// frame carries them.
var basicConsume = []byte{0, 60, 0, 20}

// awaitCount waits until n reaches want, for at most d.
func awaitCount(ctx context.Context, n *atomic.Int64, want int64, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	for n.Load() < want {
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d: %w", n.Load(), want, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	return nil
}
