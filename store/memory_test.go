package store_test

import (
	"context"
	"fmt"
	"math"
	"testing"
	"testing/synctest"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/storetest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMemoryConformance(t *testing.T) {
	storetest.Run(t, func(*testing.T) store.Store { return store.NewMemory() })
}

func TestMemoryZeroValue(t *testing.T) {
	var m store.Memory
	if got, err := m.Claim(context.Background(), "k", "t", time.Minute); err != nil || got != store.Claimed {
		t.Fatalf("Claim on a zero Memory = %v, %v; want claimed, nil", got, err)
	}
}

// The sweep must keep a long-running Memory from growing with expired
// entries that are never touched again.
func TestMemorySweepsExpiredEntries(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// Claims abandoned for a millisecond: they expire with the rest.
		m := &store.Memory{AbandonedRetention: time.Millisecond}
		ctx := context.Background()
		for i := range 5000 {
			k := fmt.Sprint("short-", i)
			_, err := m.Claim(ctx, k, "t", time.Millisecond)
			require.NoError(t, err)
			_, err = m.Fail(ctx, k, time.Millisecond)
			require.NoError(t, err)
		}
		time.Sleep(10 * time.Millisecond)
		// A sweep comes within as many writes as the last one kept entries
		// (at most 10,000 here), and it removes every expired entry.
		const live = 20000
		for i := range live {
			_, err := m.Claim(ctx, fmt.Sprint("live-", i), "t", time.Hour)
			require.NoError(t, err)
		}
		claims, failures := m.Len()
		if claims != live || failures != 0 {
			t.Fatalf("Len() = %d, %d; want %d, 0", claims, failures, live)
		}
		if held := m.Held(); held != live {
			t.Fatalf("Memory holds %d entries for %d live ones; want the 10,000 expired ones swept", held, live)
		}
	})
}

// An abandoned claim is kept for the abandoned retention after its lease,
// then forgotten, on the store's clock.
func TestMemoryAbandonedRetention(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		for _, tc := range []struct {
			name string
			m    *store.Memory
			keep time.Duration
		}{
			{"default", store.NewMemory(), store.DefaultAbandonedRetention},
			{"an hour", &store.Memory{AbandonedRetention: time.Hour}, time.Hour},
		} {
			claim := func(key string, want store.Status) {
				t.Helper()
				if got, err := tc.m.Claim(ctx, key, "t", time.Minute); err != nil || got != want {
					t.Fatalf("%s: Claim(%s) = %v, %v; want %v", tc.name, key, got, err, want)
				}
			}
			claim("a", store.Claimed)
			claim("b", store.Claimed)
			time.Sleep(time.Minute + tc.keep - time.Second)
			claim("a", store.Abandoned)
			if claims, _ := tc.m.Len(); claims != 0 {
				t.Errorf("%s: Len() = %d claims with one abandoned; want 0", tc.name, claims)
			}
			time.Sleep(time.Second)
			claim("b", store.Claimed)
		}
	})
}

// Durations too long for the store's clock to add keep their entries for
// good, rather than wrap around into the past.
func TestMemoryLongestDurations(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := store.NewMemory()
		ctx := context.Background()
		const forever = time.Duration(math.MaxInt64)
		_, err := m.Claim(ctx, "first", "t", time.Minute) // starts the store's clock
		require.NoError(t, err)
		time.Sleep(time.Hour)
		_, err = m.Claim(ctx, "done", "t", forever)
		require.NoError(t, err)
		require.NoError(t, m.Complete(ctx, "done", "t", forever))
		_, err = m.Claim(ctx, "held", "t", forever)
		require.NoError(t, err)
		n, err := m.Fail(ctx, "failed", forever)
		require.NoError(t, err)
		require.EqualValues(t, 1, n)
		time.Sleep(24 * time.Hour)
		got, err := m.Claim(ctx, "done", "t2", time.Minute)
		require.NoError(t, err)
		require.Equal(t, store.Done, got)
		got, err = m.Claim(ctx, "held", "t2", time.Minute)
		require.NoError(t, err)
		require.Equal(t, store.Processing, got)
		n, err = m.Fail(ctx, "failed", time.Minute)
		require.NoError(t, err)
		require.EqualValues(t, 2, n)
	})
}

// Durations that are not positive, outside Store's contract, end their
// entries at once, as a time that has passed: a negative retention must
// not pin a key done for good, nor a negative lease hold it.
func TestMemoryNonPositiveDurations(t *testing.T) {
	for _, d := range []time.Duration{0, -time.Nanosecond, -time.Hour, math.MinInt64} {
		t.Run(d.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				m := store.NewMemory()
				ctx := context.Background()
				_, err := m.Claim(ctx, "first", "t", time.Minute) // starts the store's clock
				require.NoError(t, err)
				time.Sleep(time.Hour)

				_, err = m.Claim(ctx, "held", "t", d)
				require.NoError(t, err)
				got, err := m.Claim(ctx, "held", "t2", time.Minute)
				require.NoError(t, err)
				assert.Equal(t, store.Abandoned, got, "Claim after a claim with lease %v", d)

				_, err = m.Claim(ctx, "done", "t", time.Minute)
				require.NoError(t, err)
				require.NoError(t, m.Complete(ctx, "done", "t", d))
				got, err = m.Claim(ctx, "done", "t2", time.Minute)
				require.NoError(t, err)
				assert.Equal(t, store.Claimed, got, "Claim after Complete with retention %v", d)

				_, err = m.Fail(ctx, "failed", d)
				require.NoError(t, err)
				n, err := m.Fail(ctx, "failed", time.Minute)
				require.NoError(t, err)
				assert.EqualValues(t, 1, n, "Fail after a Fail with ttl %v", d)
			})
		})
	}
}

// A key whose hash is another done mark's must behave as any other key.
func TestMemoryHashCollision(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		m := store.NewMemory()
		m.PlantCollision("k", "other", time.Hour)

		got, err := m.Claim(ctx, "k", "t1", time.Minute)
		require.NoError(t, err)
		require.Equal(t, store.Claimed, got, "the other key's mark is not k's")
		require.NoError(t, m.Complete(ctx, "k", "t1", 2*time.Hour))
		got, err = m.Claim(ctx, "k", "t2", time.Minute)
		require.NoError(t, err)
		assert.Equal(t, store.Done, got)
		ks, err := m.Inspect(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, store.Done, ks.Status)
		claims, _ := m.Len()
		assert.Equal(t, 2, claims, "both marks")

		time.Sleep(90 * time.Minute) // the other mark expires, k's stays
		got, err = m.Claim(ctx, "k", "t2", time.Minute)
		require.NoError(t, err)
		assert.Equal(t, store.Done, got)

		time.Sleep(time.Hour) // k's expires
		got, err = m.Claim(ctx, "k", "t3", time.Minute)
		require.NoError(t, err)
		require.Equal(t, store.Claimed, got)
		require.NoError(t, m.Complete(ctx, "k", "t3", time.Hour))
		got, err = m.Claim(ctx, "k", "t4", time.Minute)
		require.NoError(t, err)
		assert.Equal(t, store.Done, got)
		claims, _ = m.Len()
		assert.Equal(t, 1, claims)
		assert.Equal(t, 1, m.Held(), "k's mark, in place of the other's, expired")
	})
}

// Each entry ends at the very moment its duration runs out, for every
// method, and not before: a claim then is no longer its token's, and a
// done mark no longer stops a claim. A sweep removes none of them early.
func TestMemoryExpiresAtTheBoundary(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		const lease, keep, retention = time.Second, time.Minute, 10 * time.Second
		m := &store.Memory{AbandonedRetention: keep}
		claim := func(token string) store.Status {
			t.Helper()
			st, err := m.Claim(ctx, "k", token, lease)
			require.NoError(t, err)
			return st
		}
		sweep := func(prefix string) { // enough writes of other keys for a sweep
			for i := range 3000 {
				_, err := m.Claim(ctx, fmt.Sprint(prefix, i), "t", time.Hour)
				require.NoError(t, err)
			}
		}

		require.Equal(t, store.Claimed, claim("t1"))
		time.Sleep(lease - 1)
		require.NoError(t, m.Extend(ctx, "k", "t1", lease), "Extend a nanosecond before the lease ends")
		sweep("a")
		time.Sleep(lease - 1)
		assert.Equal(t, store.Processing, claim("t2"), "Claim a nanosecond before the extended lease ends")
		time.Sleep(1)
		assert.ErrorIs(t, m.Complete(ctx, "k", "t1", retention), store.ErrLostClaim, "Complete as the lease ends")
		assert.ErrorIs(t, m.Extend(ctx, "k", "t1", lease), store.ErrLostClaim, "Extend as the lease ends")
		assert.ErrorIs(t, m.Release(ctx, "k", "t1"), store.ErrLostClaim, "Release as the lease ends")
		sweep("b")
		assert.Equal(t, store.Abandoned, claim("t2"), "Claim as the lease ends")

		require.Equal(t, store.Claimed, claim("t3"))
		require.NoError(t, m.Complete(ctx, "k", "t3", retention))
		sweep("c")
		time.Sleep(retention - 1)
		assert.Equal(t, store.Done, claim("t4"), "Claim a nanosecond before the done mark ends")
		time.Sleep(1)
		assert.Equal(t, store.Claimed, claim("t4"), "Claim as the done mark ends")

		time.Sleep(lease + keep - 1) // t4's claim, abandoned, until a nanosecond before it is forgotten
		sweep("d")
		ks, err := m.Inspect(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, store.Abandoned, ks.Status, "a nanosecond before the abandoned claim is forgotten")
		time.Sleep(1)
		assert.Equal(t, store.Claimed, claim("t5"), "Claim as the abandoned claim is forgotten")
	})
}
