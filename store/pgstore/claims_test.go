package pgstore_test

import (
	"context"
	"crypto/rand"
	"fmt"
	mathrand "math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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
	tx := lockRow(t, pool, table, "blocker")
	blocked := make(chan store.Status)
	go func() {
		st, _ := s.Claim(ctx, "blocker", "t1", time.Minute)
		blocked <- st
	}()
	waitForLock(t, pool, table)

	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err := s.Claim(cctx, "x", "gave-up", time.Minute)
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

// lockRow makes a claim of key wait: a transaction, rolled back when t
// ends if not before, holds an uncommitted row of key in table.
func lockRow(t *testing.T, pool *pgxpool.Pool, table, key string) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `INSERT INTO `+table+` (key, token, lease_until, forget_at) VALUES ($1, 'tx', now() + interval '1 minute', now() + interval '1 hour')`, []byte(key))
	require.NoError(t, err)
	return tx
}

// waitForLock waits until a statement on table waits for a lock.
func waitForLock(t *testing.T, pool *pgxpool.Pool, table string) {
	t.Helper()
	require.Eventually(t, func() bool {
		var waiting bool
		pool.QueryRow(context.Background(), `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%`+table+`%')`).Scan(&waiting)
		return waiting
	}, 10*time.Second, 10*time.Millisecond, "no statement on %s waits for a lock", table)
}

// holdClaims makes the claims of s wait: a transaction holds an
// uncommitted row of key "blocker", and a claim of it is the Store's
// statement in flight until the returned function rolls the transaction
// back; the claim of blocker is then answered on the returned channel.
func holdClaims(t *testing.T, pool *pgxpool.Pool, table string, s *pgstore.Store) (release func(), blocked <-chan store.Status) {
	t.Helper()
	ctx := context.Background()
	tx := lockRow(t, pool, table, "blocker")
	ch := make(chan store.Status, 1)
	go func() {
		st, _ := s.Claim(ctx, "blocker", "t1", time.Minute)
		ch <- st
	}()
	waitForLock(t, pool, table)
	return func() { require.NoError(t, tx.Rollback(ctx)) }, ch
}

// A claim that the database refuses (a key too long for the primary key's
// index) fails alone: the claims sent in the same statement get their own
// answers, and nothing is claimed for the refused one.
func TestClaimsTogetherOneRefused(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	s := newStore(t, pool, pgstore.Options{Table: table})
	release, blocked := holdClaims(t, pool, table, s)

	long := make([]byte, 10<<10)
	rand.Read(long) // incompressible: too long for a btree entry
	keys := []string{"a", string(long), "b\x00c", "d"}
	type answer struct {
		st  store.Status
		err error
	}
	answers := make([]answer, len(keys))
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Go(func() {
			st, err := s.Claim(ctx, k, "t1", time.Minute)
			answers[i] = answer{st, err}
		})
	}
	require.Eventually(t, func() bool { return pgstore.Queued(s) == len(keys) }, 10*time.Second, time.Millisecond)
	release()
	wg.Wait()
	assert.Equal(t, store.Claimed, <-blocked)
	for i, k := range keys {
		if i == 1 {
			assert.Error(t, answers[i].err, "the claim of the long key")
			continue
		}
		if assert.NoError(t, answers[i].err, "claim of %q, sent with a refused one", k) {
			assert.Equal(t, store.Claimed, answers[i].st, "claim of %q", k)
		}
		got, err := s.Inspect(ctx, k)
		require.NoError(t, err)
		assert.Equal(t, store.Processing, got.Status, "Inspect(%q)", k)
	}
}

// A statement of claims whose connection ends while it runs (its backend
// terminated as it waits for a row lock) answers each of its claims with
// an error, and is not sent again: whether a statement that ended with
// its connection committed is unknown in general. Here it did not: none
// of its keys is claimed, and the Store's next claims take them.
func TestClaimsTogetherConnectionEnds(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	s := newStore(t, pool, pgstore.Options{Table: table})
	// A second transaction holds "x", so that the statement of x, y and z
	// waits.
	tx := lockRow(t, pool, table, "x")
	release, blocked := holdClaims(t, pool, table, s)

	keys := []string{"x", "y", "z"}
	errs := make([]error, len(keys))
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Go(func() { _, errs[i] = s.Claim(ctx, k, "t1", time.Minute) })
	}
	require.Eventually(t, func() bool { return pgstore.Queued(s) == len(keys) }, 10*time.Second, time.Millisecond)
	release()
	assert.Equal(t, store.Claimed, <-blocked)
	var pid int
	require.Eventually(t, func() bool {
		err := pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%unnest%' AND query LIKE '%`+table+`%'`).Scan(&pid)
		return err == nil
	}, 10*time.Second, 10*time.Millisecond, "the statement of x, y and z never waited")
	_, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid)
	require.NoError(t, err)
	wg.Wait()
	for i, k := range keys {
		assert.Error(t, errs[i], "claim of %q, whose statement's connection ended", k)
		got, err := s.Inspect(ctx, k)
		require.NoError(t, err)
		assert.NotEqual(t, "t1", got.Token, "%q claimed by the statement whose connection ended", k)
	}

	require.NoError(t, tx.Rollback(ctx))
	for _, k := range keys {
		st, err := s.Claim(ctx, k, "t2", time.Minute)
		require.NoError(t, err)
		assert.Equal(t, store.Claimed, st, "claim of %q afterwards", k)
	}
}

// Claims sent together take any bytes as keys and tokens, in every mode
// in which a pool may send its statements: each gets its own key's
// answer.
func TestClaimsTogetherInEveryExecMode(t *testing.T) {
	keys := []string{"", "a,b", "{c}", `d"e`, `f\g`, "h\x00i", "NULL", "\xff\xfe", "j k"}
	for _, mode := range execModes {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := context.Background()
			pool := newPoolWith(t, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode })
			table := uniqueTable(t, pool)
			s := newStore(t, pool, pgstore.Options{Table: table})
			_, err := s.Claim(ctx, "a,b", "earlier", time.Minute)
			require.NoError(t, err)
			release, blocked := holdClaims(t, pool, table, s)
			statuses := make([]store.Status, len(keys))
			var wg sync.WaitGroup
			for i, k := range keys {
				wg.Go(func() {
					st, err := s.Claim(ctx, k, "t\x00"+k, time.Minute)
					assert.NoError(t, err, "claim of %q", k)
					statuses[i] = st
				})
			}
			require.Eventually(t, func() bool { return pgstore.Queued(s) == len(keys) }, 10*time.Second, time.Millisecond)
			release()
			wg.Wait()
			assert.Equal(t, store.Claimed, <-blocked)
			for i, k := range keys {
				want, token := store.Claimed, "t\x00"+k
				if k == "a,b" {
					want, token = store.Processing, "earlier"
				}
				assert.Equal(t, want, statuses[i], "claim of %q", k)
				got, err := s.Inspect(ctx, k)
				require.NoError(t, err)
				assert.Equal(t, token, got.Token, "Inspect(%q)", k)
			}
		})
	}
}

// Two Stores over one table (two consumers) whose claims of the same keys
// arrive in different orders, in statements of many claims: each key is
// claimed once, every other claim of it finds it processing, and none
// fails.
func TestClaimsTogetherTwoStores(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	stores := []*pgstore.Store{newStore(t, pool, pgstore.Options{Table: table}), newStore(t, pool, pgstore.Options{Table: table})}
	const keys, workers = 16, 16
	var mu sync.Mutex
	claimed := make(map[string]int)
	var wg sync.WaitGroup
	for si, s := range stores {
		for w := range workers {
			wg.Go(func() {
				for _, k := range mathrand.Perm(keys) {
					key := fmt.Sprintf("k%d", k)
					st, err := s.Claim(ctx, key, fmt.Sprintf("s%d-w%d", si, w), time.Minute)
					if !assert.NoError(t, err, "claim of %s", key) {
						continue
					}
					assert.Contains(t, []store.Status{store.Claimed, store.Processing}, st, "claim of %s", key)
					if st == store.Claimed {
						mu.Lock()
						claimed[key]++
						mu.Unlock()
					}
				}
			})
		}
	}
	wg.Wait()
	for k := range keys {
		assert.Equal(t, 1, claimed[fmt.Sprintf("k%d", k)], "claims won of k%d", k)
	}
}

// A claim sent alone whose context ends while its statement waits for a
// row lock returns with its context's error and claims nothing; the
// claims queued behind it are sent at once, without waiting for the lock.
func TestClaimsSenderCancelled(t *testing.T) {
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	s := newStore(t, pool, pgstore.Options{Table: table})
	tx := lockRow(t, pool, table, "blocker")

	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sent := make(chan error, 1)
	go func() {
		_, err := s.Claim(sctx, "blocker", "t1", time.Minute)
		sent <- err
	}()
	waitForLock(t, pool, table)
	keys := []string{"a", "b"}
	statuses := make([]store.Status, len(keys))
	var wg sync.WaitGroup
	for i, k := range keys {
		wg.Go(func() {
			st, err := s.Claim(ctx, k, "t1", time.Minute)
			assert.NoError(t, err, "claim of %q", k)
			statuses[i] = st
		})
	}
	require.Eventually(t, func() bool { return pgstore.Queued(s) == len(keys) }, 10*time.Second, time.Millisecond)
	cancel()
	select {
	case err := <-sent:
		assert.ErrorIs(t, err, context.Canceled, "the cancelled claim of blocker")
	case <-time.After(5 * time.Second):
		t.Fatal("the claim of blocker still waits 5 s after its context ended")
	}
	wg.Wait() // the transaction still holds blocker
	assert.Equal(t, []store.Status{store.Claimed, store.Claimed}, statuses)

	// A claim that returned an error may or may not have taken effect
	// (the Store contract): pgx gives up on the connection when the
	// context ends, and the server, still waiting for the row, may carry
	// the statement out once the lock is gone. Either way it is the
	// cancelled claim's own token, and nothing else.
	require.NoError(t, tx.Rollback(ctx))
	got, err := s.Inspect(ctx, "blocker")
	require.NoError(t, err)
	if got.Status != 0 {
		assert.Equal(t, store.Processing, got.Status, "blocker after the cancelled claim and the rollback: absent, or claimed by it")
		assert.Equal(t, "t1", got.Token, "blocker after the cancelled claim and the rollback")
	}
}

// Claims whose contexts end at random moments (before they queue, while
// they wait, while their statement is in flight) each return: a claim
// answered without an error has a valid status, an error is its
// context's, and the Store's claims go on working.
func TestClaimsCancelledAtRandom(t *testing.T) {
	ctx := context.Background()
	s := newStore(t, newPool(t), pgstore.Options{})
	const workers, claims = 16, 40
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range claims {
				cctx, cancel := context.WithTimeout(ctx, time.Duration(mathrand.IntN(3000))*time.Microsecond)
				st, err := s.Claim(cctx, fmt.Sprintf("k%d", mathrand.IntN(8)), fmt.Sprintf("w%d-%d", w, i), time.Minute)
				if err != nil {
					assert.Error(t, cctx.Err(), "claim failed before its context ended: %v", err)
				} else {
					assert.True(t, st.Valid(), "status %v", st)
				}
				cancel()
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("claims still running after 60 s")
	}
	st, err := s.Claim(ctx, "after", "t1", time.Minute)
	require.NoError(t, err)
	assert.Equal(t, store.Claimed, st)
}

// The ways a transaction holds a row locked: with SELECT … FOR UPDATE,
// and with an uncommitted UPDATE, as SQLHandler's transaction holds its
// key's row between the done mark and the commit.
var rowLockers = map[string]string{
	"for update":         `SELECT FROM %s WHERE key = $1 FOR UPDATE`,
	"uncommitted update": `UPDATE %s SET lease_until = statement_timestamp() + interval '1 hour' WHERE key = $1`,
}

// busyRow is a Store on a table of its own, one of whose rows another
// transaction holds locked.
type busyRow struct {
	pool  *pgxpool.Pool
	table string
	s     *pgstore.Store
	tx    pgx.Tx // holds the row locked
}

// holdRow returns a busyRow whose key's row is held locked with locker,
// one of rowLockers, by a transaction rolled back when t ends if not
// before. The key's row is first a done mark whose retention has ended,
// so that a claim takes it once the transaction ends.
func holdRow(t *testing.T, key, locker string) busyRow {
	t.Helper()
	ctx := context.Background()
	pool := newPool(t)
	table := uniqueTable(t, pool)
	s := newStore(t, pool, pgstore.Options{Table: table})
	st, err := s.Claim(ctx, key, "earlier", time.Minute)
	require.NoError(t, err)
	require.Equal(t, store.Claimed, st, "the first claim of %q", key)
	require.NoError(t, s.Complete(ctx, key, "earlier", time.Microsecond))
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { tx.Rollback(ctx) })
	tag, err := tx.Exec(ctx, fmt.Sprintf(locker, table), []byte(key))
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected(), "rows of %q locked", key)
	return busyRow{pool, table, s, tx}
}

// busyBound is how long a claim may take when its row, or another row of
// its statement, is held locked by another transaction.
const busyBound = 2 * time.Second

// claimAnswer is a claim's answer, and when it came.
type claimAnswer struct {
	st  store.Status
	err error
	at  time.Time
}

// claimAsync claims key for token, with a context that ends after 15 s
// (longer than a statement sent for others may wait), and answers on the
// returned channel.
func claimAsync(s *pgstore.Store, key, token string) <-chan claimAnswer {
	ch := make(chan claimAnswer, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		st, err := s.Claim(ctx, key, token, time.Minute)
		ch <- claimAnswer{st, err, time.Now()}
	}()
	return ch
}

// A claim sent alone whose row another transaction holds locked does not
// wait for it: it finds the key processing at once, and the claims queued
// behind it are sent at once. Once the transaction ends, the key can be
// claimed.
func TestClaimLockedRowAlone(t *testing.T) {
	for name, locker := range rowLockers {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			row := holdRow(t, "a", locker)
			s := row.s

			start := time.Now()
			a := claimAsync(s, "a", "t1")
			require.Eventually(t, func() bool { return pgstore.InFlight(s) || len(a) > 0 }, 10*time.Second, time.Millisecond)
			b, c := claimAsync(s, "b", "t1"), claimAsync(s, "c", "t1")
			for _, w := range []struct {
				key  string
				ch   <-chan claimAnswer
				want store.Status
			}{{"a", a, store.Processing}, {"b", b, store.Claimed}, {"c", c, store.Claimed}} {
				got := <-w.ch
				if assert.NoError(t, got.err, "claim of %q", w.key) {
					assert.Equal(t, w.want, got.st, "claim of %q", w.key)
				}
				assert.Less(t, got.at.Sub(start), busyBound, "claim of %q answered after", w.key)
			}

			require.NoError(t, row.tx.Rollback(ctx))
			st, err := s.Claim(ctx, "a", "t2", time.Minute)
			require.NoError(t, err)
			assert.Equal(t, store.Claimed, st, "claim of a once the transaction ended")
		})
	}
}

// Claims sent together, one of whose rows another transaction holds
// locked, do not wait for it: that claim finds its key processing, the
// others get their own answers at once. Once the transaction ends, the
// key can be claimed.
func TestClaimsTogetherLockedRow(t *testing.T) {
	for name, locker := range rowLockers {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			row := holdRow(t, "a", locker)
			s := row.s
			release, blocked := holdClaims(t, row.pool, row.table, s)

			keys := []string{"a", "b", "c", "d"}
			answers := make([]<-chan claimAnswer, len(keys))
			for i, k := range keys {
				answers[i] = claimAsync(s, k, "t1")
			}
			require.Eventually(t, func() bool { return pgstore.Queued(s) == len(keys) }, 10*time.Second, time.Millisecond)
			start := time.Now()
			release()
			assert.Equal(t, store.Claimed, <-blocked)
			for i, k := range keys {
				want := store.Claimed
				if k == "a" {
					want = store.Processing
				}
				got := <-answers[i]
				if assert.NoError(t, got.err, "claim of %q", k) {
					assert.Equal(t, want, got.st, "claim of %q", k)
				}
				assert.Less(t, got.at.Sub(start), busyBound, "claim of %q answered after", k)
			}

			require.NoError(t, row.tx.Rollback(ctx))
			st, err := s.Claim(ctx, "a", "t2", time.Minute)
			require.NoError(t, err)
			assert.Equal(t, store.Claimed, st, "claim of a once the transaction ended")
		})
	}
}
