//go:build reliability

package reliability_test

// The Redis store's batching (redisstore.New's default) against real
// servers: a Redis Cluster, where its pipelines must split by slot, and a
// redis-server restarted while batches are in flight.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
	"github.com/rabbitmw/rabbitmw/store/storetest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestBatcherCluster(t *testing.T) {
	t.Parallel()
	c := startRedisCluster(t)
	audit := new(slotAudit)
	s := redisstore.New(c.client(t, audit), redisstore.Options{Prefix: "batch:"})
	require.NoError(t, s.Load(context.Background()))
	t.Run("storetest", func(t *testing.T) {
		storetest.Run(t, func(*testing.T) store.Store { return s })
	})

	// Many workers at once, so that pipelines hold keys of every node: each
	// gets its own answer, and every key is done afterwards.
	const workers, each = 16, 100
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			ctx := context.Background()
			for i := range each {
				key := fmt.Sprintf("w%d-%d", w, i)
				tok := "tok-" + key
				if st, err := s.Claim(ctx, key, tok, time.Minute); st != store.Claimed || err != nil {
					t.Errorf("Claim(%s) = %v, %v; want claimed", key, st, err)
					continue
				}
				assert.NoError(t, s.Complete(ctx, key, tok, time.Hour), "Complete(%s)", key)
				if st, err := s.Claim(ctx, key, "other", time.Minute); st != store.Done || err != nil {
					t.Errorf("Claim(%s) after Complete = %v, %v; want done", key, st, err)
				}
			}
		})
	}
	wg.Wait()
	audit.verify(t)
	perNode := c.keysPerNode(t)
	for addr, n := range perNode {
		if n == 0 {
			t.Errorf("node %s holds no key (keys per node %v); want keys on every node", addr, perNode)
		}
	}
	t.Logf("keys per node: %s", c.perNode(perNode))
}

// Redis restarts while 16 workers keep calls in flight through a batched
// store:
// calls fail while it is down, each with an error and none with another
// caller's answer, and every call succeeds again once it is back.
func TestBatcherRedisRestart(t *testing.T) {
	t.Parallel()
	srv := startRedisServer(t)
	s := redisstore.New(srv.client(), redisstore.Options{})

	var stop atomic.Bool
	var ok, failed, wrong atomic.Int64
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Go(func() {
			for i := 0; !stop.Load(); i++ {
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				key := fmt.Sprintf("w%d-%d", w, i)
				st, err := s.Claim(ctx, key, "tok-"+key, time.Minute)
				cancel()
				switch {
				case err != nil:
					failed.Add(1)
				case st == store.Claimed:
					ok.Add(1)
				default: // a fresh key, claimed by nobody else
					wrong.Add(1)
					t.Errorf("Claim(%s) of a fresh key = %v; want claimed", key, st)
				}
			}
		})
	}
	waitFor := func(n int64) {
		require.EventuallyWithT(t, func(c *assert.CollectT) { // the workers talk to a real server
			assert.GreaterOrEqual(c, ok.Load(), n, "claims succeeded within 30s")
		}, 30*time.Second, 5*time.Millisecond)
	}
	waitFor(500)
	sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
	err := srv.shutdown(sctx)
	scancel()
	if err != nil {
		stop.Store(true)
		wg.Wait()
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // longer than go-redis retries: calls fail meanwhile
	if err := srv.restart(); err != nil {
		stop.Store(true)
		wg.Wait()
		t.Fatal(err)
	}
	back := ok.Load()
	waitFor(back + 500)
	stop.Store(true)
	wg.Wait()
	if failed.Load() == 0 {
		t.Errorf("no call failed while Redis was down")
	}
	t.Logf("claims: %d succeeded, %d failed, %d wrong", ok.Load(), failed.Load(), wrong.Load())

	// And every call after the workers stopped succeeds.
	if _, err := s.Claim(context.Background(), "after", "tok", time.Minute); err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("Claim after the restart = %v", err)
	}
}
