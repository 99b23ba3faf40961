package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisOptions configures a [Redis] store. The zero value selects the
// defaults, which match the key layout that hand-written consumers commonly
// use, so that a consumer built on this package can join a fleet of them on
// the same queue and Redis during a migration.
type RedisOptions struct {
	// Prefix is prepended to every key the store writes, to keep several
	// applications apart in one Redis. Default: none.
	Prefix string
	// ClaimPrefix precedes a message key in the key holding its claim or
	// done mark. Default "msg:".
	ClaimPrefix string
	// FailurePrefix precedes a message key in the key holding its failure
	// count. Default "retry:".
	FailurePrefix string
}

// Redis is a [Store] in Redis, over any [redis.UniversalClient]: a single
// server, a Sentinel-managed primary, or a Cluster; also go-redis's
// experimental autopipeliner (BENCHMARKS.md measures it: on one machine it
// saved Redis CPU but did not raise throughput).
//
// Key layout, with the default options, for message key K:
//
//	msg:K    "done" once K is done; any other value is the token of the owner
//	         processing K (hand-written consumers write "processing")
//	retry:K  the failure count of K, an integer
//
// Every state change is one round trip: Claim, Extend, Complete, Release and
// Fail each run one Lua script (EVALSHA; a script not yet in Redis's cache
// costs one more round trip, once, unless [Redis.Load] cached it), and each
// script touches a single key, so the
// store works unchanged on Redis Cluster. A claim left without expiry (a
// hand-written consumer that died between SETNX and EXPIRE) is given the
// claimer's lease the first time Claim finds it, so it cannot block its
// message forever.
//
// Errors from the client, including timeouts, are wrapped with the
// operation and key; redis.Nil never escapes.
//
// Create the client with ContextTimeoutEnabled: true. Without it go-redis
// ignores the deadline of a call's context and waits out its own
// ReadTimeout (3s by default) on each retry, so a store call to an
// unreachable Redis can block for many seconds, where the Store contract
// asks for a prompt return. Dedup does not depend on it for safety (it
// cancels a handler whose lease may end on the clock, not on the store's
// answer), but every store call of a delivery is bounded by it.
type Redis struct {
	client               RedisClient
	claimPre, failurePre string
}

// NewRedis returns a Redis store that uses client, which the caller keeps
// and closes. It panics if client is nil.
func NewRedis(client RedisClient, opts RedisOptions) *Redis {
	if client == nil {
		panic("store: NewRedis: nil client")
	}
	claimPre, failurePre := opts.ClaimPrefix, opts.FailurePrefix
	if claimPre == "" {
		claimPre = "msg:"
	}
	if failurePre == "" {
		failurePre = "retry:"
	}
	return &Redis{
		client:     client,
		claimPre:   opts.Prefix + claimPre,
		failurePre: opts.Prefix + failurePre,
	}
}

// RedisClient is the part of a go-redis client that the [Redis] store uses:
// its scripts and one DEL. Every [redis.UniversalClient] has it (a
// [redis.Client], a [redis.ClusterClient], a [redis.Ring], a Sentinel
// failover client, the [redis.AutoPipeliner] they return from
// AutoPipeline), and a wrapper or a test fake needs no more than this.
type RedisClient interface {
	redis.Scripter
	Del(ctx context.Context, keys ...string) *redis.IntCmd
}

// The value of a done mark. Hand-written consumers compare with it.
const doneMark = "done"

// Each script touches KEYS[1] only. Results: claim returns 1 (claimed),
// 2 (processing) or 3 (done); the owner-checked ones return 1 when the
// token owned the key, else 0; fail returns the new count.
var (
	claimScript = redis.NewScript(`
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', KEYS[1]) == 'done' then
  return 3
end
if redis.call('PTTL', KEYS[1]) == -1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 2`)

	extendScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0`)

	completeScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], 'done', 'PX', ARGV[2])
  return 1
end
return 0`)

	releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0`)

	failScript = redis.NewScript(`
local n = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return n`)
)

// Load loads the store's scripts into Redis's script cache: on every
// primary of a Cluster, on one shard of a Ring (the others load each script
// on its first use there). It is optional: without it, the first call of each
// script pays one more round trip (EVALSHA answered NOSCRIPT, then EVAL), as
// does the first call after Redis restarts or its script cache is flushed.
// Calling it at start-up also makes a consumer fail fast when Redis cannot
// be reached.
func (r *Redis) Load(ctx context.Context) error {
	for _, s := range []*redis.Script{claimScript, extendScript, completeScript, releaseScript, failScript} {
		if err := s.Load(ctx, r.client).Err(); err != nil {
			return fmt.Errorf("store: redis load scripts: %w", err)
		}
	}
	return nil
}

// Claim implements [Store].
func (r *Redis) Claim(ctx context.Context, key, token string, lease time.Duration) (Status, error) {
	n, err := r.run(ctx, claimScript, r.claimPre+key, token, millis(lease))
	if err != nil {
		return 0, r.fail("claim", key, err)
	}
	switch n {
	case 1:
		return Claimed, nil
	case 2:
		return Processing, nil
	case 3:
		return Done, nil
	}
	return 0, r.fail("claim", key, fmt.Errorf("unexpected script result %d", n))
}

// Extend implements [Store].
func (r *Redis) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	return r.owned(ctx, "extend", extendScript, key, token, millis(lease))
}

// Complete implements [Store].
func (r *Redis) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	return r.owned(ctx, "complete", completeScript, key, token, millis(retention))
}

// Release implements [Store].
func (r *Redis) Release(ctx context.Context, key, token string) error {
	return r.owned(ctx, "release", releaseScript, key, token)
}

func (r *Redis) owned(ctx context.Context, op string, s *redis.Script, key, token string, args ...any) error {
	n, err := r.run(ctx, s, r.claimPre+key, append([]any{token}, args...)...)
	if err != nil {
		return r.fail(op, key, err)
	}
	if n == 0 {
		return ErrLostClaim
	}
	return nil
}

// Fail implements [Store].
func (r *Redis) Fail(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	n, err := r.run(ctx, failScript, r.failurePre+key, millis(ttl))
	if err != nil {
		return 0, r.fail("fail", key, err)
	}
	return n, nil
}

// ResetFailures implements [Store].
func (r *Redis) ResetFailures(ctx context.Context, key string) error {
	if err := ctx.Err(); err != nil {
		return r.fail("reset failures", key, err)
	}
	if err := r.client.Del(ctx, r.failurePre+key).Err(); err != nil {
		return r.fail("reset failures", key, err)
	}
	return nil
}

// run runs s on the single key k. A done context fails at once, whatever
// the client would do with it (go-redis's autopipeliner, for one, still
// sends the command).
func (r *Redis) run(ctx context.Context, s *redis.Script, k string, args ...any) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	return s.Run(ctx, r.client, []string{k}, args...).Int64()
}

func (r *Redis) fail(op, key string, err error) error {
	if errors.Is(err, redis.Nil) {
		err = errors.New("empty reply")
	}
	return fmt.Errorf("store: redis %s %q: %w", op, key, err)
}

// millis converts d to whole milliseconds for PX and PEXPIRE, at least 1.
func millis(d time.Duration) int64 {
	if ms := d.Milliseconds(); ms > 0 {
		return ms
	}
	return 1
}

var _ Store = (*Redis)(nil)
