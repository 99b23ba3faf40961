package pgstore_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// Claims sent together, in one statement, answer as claims sent alone:
// of two claims of a key, one takes it and the other finds it processing,
// whether they share a statement or not.
func TestClaimsTogether(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, newPool(t), pgstore.Options{})
	const keys = 64
	statuses := make([][2]store.Status, keys)
	var wg sync.WaitGroup
	for k := range keys {
		for i := range 2 {
			wg.Go(func() {
				st, err := s.Claim(ctx, fmt.Sprintf("k%d", k), fmt.Sprintf("t%d-%d", k, i), time.Minute)
				assert.NoError(t, err)
				statuses[k][i] = st
			})
		}
	}
	wg.Wait()
	for k, st := range statuses {
		if !(st == [2]store.Status{store.Claimed, store.Processing} || st == [2]store.Status{store.Processing, store.Claimed}) {
			t.Errorf("claims of k%d = %v; want one claimed, one processing", k, st)
			continue
		}
		owner := 0
		if st[1] == store.Claimed {
			owner = 1
		}
		require.NoError(t, s.Complete(ctx, fmt.Sprintf("k%d", k), fmt.Sprintf("t%d-%d", k, owner), time.Minute))
	}
	wg = sync.WaitGroup{}
	for k := range keys {
		wg.Go(func() {
			st, err := s.Claim(ctx, fmt.Sprintf("k%d", k), "late", time.Minute)
			assert.NoError(t, err)
			assert.Equal(t, store.Done, st, "k%d after Complete", k)
		})
	}
	wg.Wait()
}

// A claim that waits for the statement in flight, and whose context ends
// first, returns at once and claims nothing; the claims behind it are sent
// once the statement in flight is answered.
func TestClaimsWaitingCancelled(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	s := newStore(t, pool, pgstore.Options{Table: table})
	// A transaction holds an uncommitted claim of "blocker": a claim of it
	// waits for the transaction, and holds the Store's statement in flight.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, `INSERT INTO `+table+` (key, token, lease_until, forget_at) VALUES ('blocker', 'tx', now() + interval '1 minute', now() + interval '1 hour')`)
	require.NoError(t, err)
	blocked := make(chan store.Status)
	go func() {
		st, _ := s.Claim(ctx, "blocker", "t1", time.Minute)
		blocked <- st
	}()
	require.Eventually(t, func() bool {
		var waiting bool
		pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%`+table+`%')`).Scan(&waiting)
		return waiting
	}, 10*time.Second, 10*time.Millisecond, "the claim of blocker never waited")

	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = s.Claim(cctx, "x", "gave-up", time.Minute)
	assert.Error(t, err, "a claim whose context ended while it waited")
	assert.Less(t, time.Since(start), 5*time.Second, "the cancelled claim waited for the statement in flight")
	behind := make(chan store.Status)
	go func() {
		st, _ := s.Claim(ctx, "y", "t1", time.Minute)
		behind <- st
	}()

	require.NoError(t, tx.Rollback(ctx))
	assert.Equal(t, store.Claimed, <-blocked, "blocker, once the transaction rolled back")
	assert.Equal(t, store.Claimed, <-behind, "y, queued behind")
	st, err := s.Claim(ctx, "x", "t2", time.Minute)
	require.NoError(t, err)
	assert.Equal(t, store.Claimed, st, "x, after the claim that gave up")
}
