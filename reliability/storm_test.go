//go:build reliability

package reliability_test

// Scenario 4, duplicate storm across processes: three consumer processes
// share one queue and one store, and each message id is published ten
// times at once. The copies of an id reach the three processes at the
// same moment; one claims it, the others find it busy (and try again
// after a delay) or done (and acknowledge it). Each effect happens once.

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/reliability/internal/stats"
)

func TestDuplicateStorm(t *testing.T) {
	const (
		ids       = 300
		copies    = 10
		consumers = 3
		workers   = 8
	)
	r := newRun(t, "storm", 250*time.Millisecond, time.Second)
	opts := consumerOpts{
		workers:     workers,
		lease:       10 * time.Second,
		timeout:     5 * time.Second,
		busy:        200 * time.Millisecond,
		unavailable: 200 * time.Millisecond,
		// Long enough for the other copies to arrive while it holds the
		// claim.
		work: 20 * time.Millisecond,
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	began := time.Now()

	var procs []*proc
	for i := range consumers {
		procs = append(procs, r.startConsumer(fmt.Sprintf("storm-%c", 'A'+i), opts))
	}
	// The copies of each id are published together, from one goroutine
	// each, released at once; eight ids at a time.
	var keys []string
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		pubErr   error
		inFlight = make(chan struct{}, 8)
	)
	for i := range ids {
		id := fmt.Sprintf("s-%04d", i)
		keys = append(keys, id)
		inFlight <- struct{}{}
		start := make(chan struct{})
		var idWG sync.WaitGroup
		for range copies {
			idWG.Add(1)
			go func() {
				defer idWG.Done()
				<-start
				if err := r.b.Publish(ctx, "", r.queue, amqp.Publishing{MessageId: id, Body: []byte(id)}); err != nil {
					mu.Lock()
					pubErr = fmt.Errorf("publish %s: %w", id, err)
					mu.Unlock()
				}
			}()
		}
		close(start)
		wg.Add(1)
		go func() {
			defer wg.Done()
			idWG.Wait()
			<-inFlight
		}()
	}
	wg.Wait()
	require.NoError(t, pubErr)
	require.NoError(t, r.awaitQuiet(ctx, ids, 2*time.Second))
	e := r.end(ctx, keys, procs...)
	e.wantEachOnce(t)
	v := e.v
	var total stats.Consumer
	appliedBy := map[string]int64{}
	for i, st := range e.stats {
		total.Acked += st.Acked
		total.Duplicates += st.Duplicates
		total.Busy += st.Busy
		total.Deliveries += st.Deliveries
		appliedBy[procs[i].name] = st.Effects
	}
	// Every copy ended: one acknowledged as done per id, the others as
	// duplicates; and the storm was real: copies met a claim held by
	// another consumer, and each process did part of the work.
	if total.Acked != ids || total.Duplicates != ids*(copies-1) {
		t.Errorf("%d copies acked as processed and %d as duplicates; want %d and %d", total.Acked, total.Duplicates, ids, ids*(copies-1))
	}
	if total.Busy == 0 {
		t.Error("no copy found its id busy; the copies did not meet")
	}
	for name, n := range appliedBy {
		if n == 0 {
			t.Errorf("consumer %s applied no effect; want the three to share the work", name)
		}
	}
	var parts []string
	for _, p := range procs {
		parts = append(parts, fmt.Sprintf("%s %d", p.name, appliedBy[p.name]))
	}
	shares := strings.Join(parts, ", ")
	t.Logf("effects by consumer %v; %d deliveries, %d busy; took %v", appliedBy, total.Deliveries, total.Busy, time.Since(began).Round(time.Millisecond))
	record(t, v.counted(row{
		Scenario:   "4 duplicate storm",
		Messages:   ids * copies,
		Duplicates: ids * (copies - 1),
		Faults:     fmt.Sprintf("%d copies of each id at once, %d processes", copies, consumers),
		Note:       fmt.Sprintf("%d copies met a busy claim; effects by process: %s", total.Busy, shares),
	}))
}
