package redisstore

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/store"
)

// inspectScript returns the value of KEYS[1] (false when absent) and its
// PTTL. A script, rather than GET and PTTL, because Client is
// scripts and DEL; it touches one key, so it runs on Redis Cluster.
var inspectScript = redis.NewScript(`
return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}`)

// Inspect implements [store.Inspector]: two round trips, one for the claim key
// and one for the failure key (which may live on different Cluster
// shards).
func (r *Store) Inspect(ctx context.Context, key string) (store.KeyState, error) {
	var k store.KeyState
	ck, fk := r.claimPre+key, r.failurePre+key
	v, ttl, err := r.peek(ctx, ck)
	if err != nil {
		return k, r.fail("inspect", key, ck, err)
	}
	if v != nil {
		k.Status, k.Token, k.TTL = claimState(*v, ttl)
	}
	v, ttl, err = r.peek(ctx, fk)
	if err != nil {
		return k, r.fail("inspect", key, fk, err)
	}
	if v != nil {
		n, err := strconv.ParseInt(*v, 10, 64)
		if err != nil {
			return k, r.fail("inspect", key, fk, fmt.Errorf("failure count %q: %w", *v, err))
		}
		k.Failures, k.FailuresTTL = n, ttl
	}
	return k, nil
}

// claimState reads the value v of a claim key with time to live ttl (see
// the key layout on [Store]) as claimScript does: a claim of ours is
// processing while its key's PTTL is more than the claim's retention, and
// abandoned after, or when the key has no expiry.
func claimState(v string, ttl time.Duration) (store.Status, string, time.Duration) {
	if v == doneMark {
		return store.Done, "", ttl
	}
	rest, ok := strings.CutPrefix(v, claimTag)
	ms, token, colon := strings.Cut(rest, ":")
	if !ok || !colon || ms == "" || strings.Trim(ms, "0123456789") != "" {
		return store.Processing, v, ttl // a hand-written consumer's mark
	}
	keep, err := strconv.ParseInt(ms, 10, 64)
	if err != nil {
		keep = math.MaxInt64 // too many digits: a retention no PTTL exceeds
	}
	if ttl >= 0 && ttl.Milliseconds() > keep {
		return store.Processing, token, ttl - time.Duration(keep)*time.Millisecond
	}
	return store.Abandoned, token, ttl
}

// peek returns the value of k (nil when absent) and its time to live (-1
// when it has no expiry).
func (r *Store) peek(ctx context.Context, k string) (*string, time.Duration, error) {
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	res, err := inspectScript.Run(ctx, r.client, []string{k}).Slice()
	if err != nil {
		return nil, 0, err
	}
	if len(res) != 2 {
		return nil, 0, fmt.Errorf("unexpected script result %v", res)
	}
	s, ok := res[0].(string)
	if !ok {
		return nil, 0, nil
	}
	ms, _ := res[1].(int64)
	ttl := time.Duration(ms) * time.Millisecond
	if ms < 0 {
		ttl = -1
	}
	return &s, ttl, nil
}

var _ store.Inspector = (*Store)(nil)
