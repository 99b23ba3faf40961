//go:build reliability

package reliability_test

// Scenario 5 over the PostgreSQL inbox: lease loss during a long
// transaction. Consumer A's handler opens its transaction and holds it
// longer than the lease, ignoring its context (the stubborn handler, which
// on Redis applies its effect a second time). A is then frozen (SIGSTOP, as
// a long GC pause or a stalled VM would) for longer than its lease, so its
// renewals stop and its lease ends. A second copy of each message goes to
// consumer B, which takes the messages over once A's lease has ended and
// commits their effects. Then A wakes up (SIGCONT) and finishes its
// transactions: their done marks match no row that A still owns, so they
// roll back, effect included. Each effect once, by B: the inbox fences
// where a lease alone only bounds.

import (
	"context"
	"fmt"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/stretchr/testify/require"
)

func TestPostgresLeaseLoss(t *testing.T) {
	const (
		ids   = leaseLossIDs
		lease = leaseLossLease
		hold  = leaseLossHold
		pause = 4 * time.Second // longer than the lease, from A's last renewal
	)
	url := testenv.PostgresURL(t)
	r := newRun(t, "pgleaseloss", tiers...)
	base := r.usePostgres(url, leaseLossOpts())
	optsA := base
	optsA.mode, optsA.hold = "stubborn", hold
	optsB := base

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var keys []string
	for i := range ids {
		keys = append(keys, fmt.Sprintf("pglease-%d", i))
	}
	a := r.startConsumer("A", optsA)
	r.publishIDs(ctx, keys)
	// A's handlers are in their transactions.
	require.NoError(t, r.waitEvents(ctx, func(ev map[string][]string) bool { return everyHas(ev, keys, "start A") }))
	a.cmd.Process.Signal(syscall.SIGSTOP)
	frozen := time.Now()
	t.Logf("A frozen with its %d transactions open", ids)
	b := r.startConsumer("B", optsB)
	r.publishIDs(ctx, keys)
	require.NoError(t, r.waitCount(ctx, "distinct", ids))
	t.Logf("B committed every effect %v after A froze", time.Since(frozen).Round(time.Millisecond))
	if d := pause - time.Since(frozen); d > 0 {
		time.Sleep(d)
	}
	a.cmd.Process.Signal(syscall.SIGCONT)
	// A's transactions end, rolled back: by their done mark, which
	// matches no row A owns ("no longer owned by this claim"), or, when
	// A's renewer woke first, by the cancellation of the context that the
	// mark runs under. Either way A logs the claim lost.
	deadline, _ := ctx.Deadline()
	require.Eventually(t, func() bool { return a.logCount("claim lost") >= ids },
		time.Until(deadline), 20*time.Millisecond, "A did not finish its transactions")
	fenced := a.logCount("no longer owned by this claim")
	require.NoError(t, r.awaitQuiet(ctx, ids, 3*time.Second))
	e := r.end(ctx, keys, a, b)
	for _, id := range keys {
		if by := e.effects[id]; !slices.Equal(by, []string{"B"}) {
			t.Errorf("message %s committed by %v; want once, by B: A's transaction must not commit after its lease was lost", id, by)
		}
	}
	e.wantEachOnce(t)
	t.Logf("consumers: %+v; %d of A's transactions rolled back by the done mark's owner check", e.stats, fenced)
	record(t, e.v.counted(row{
		Scenario:   "5 lease loss, PostgreSQL inbox",
		Messages:   2 * ids,
		Duplicates: ids,
		Faults:     fmt.Sprintf("A frozen (SIGSTOP) %v in its transactions, lease %v", pause, lease),
		Note:       fmt.Sprintf("A ignores its context; rolled back: %d by the done mark's owner check, the rest by the cancelled context", fenced),
	}))
}
