package redisstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/store"
)

// Options configures a [Store]. The zero value selects the
// defaults, which match the key layout that hand-written consumers commonly
// use, so that a consumer built on this package can join a fleet of them on
// the same queue and Redis during a migration.
type Options struct {
	// Prefix is prepended to every key the store writes, to keep several
	// applications apart in one Redis. Default: none.
	Prefix string
	// ClaimPrefix precedes a message key in the key holding its claim or
	// done mark. Default "msg:".
	ClaimPrefix string
	// FailurePrefix precedes a message key in the key holding its failure
	// count. Default "retry:".
	FailurePrefix string
	// AbandonedRetention is how long a claim whose lease ended without
	// Complete or Release is remembered after the lease, for Claim to
	// report it Abandoned (see [store.Store]); a claim's key lives for its lease
	// plus this. Each claim carries its own, so stores with different
	// settings can share keys. Default [store.DefaultAbandonedRetention].
	AbandonedRetention time.Duration

	// NoBatching makes [New] use a client it could batch over as it is,
	// each command its own round trip. By default New puts a [Batcher]
	// over a *[redis.Client], a *[redis.ClusterClient] or a *[redis.Ring]
	// (what [redis.NewUniversalClient] and the Sentinel constructors
	// return), which coalesces the commands of concurrent store calls into
	// pipelines; any other [Client] (go-redis's autopipeliner, a Batcher of
	// your own, a wrapper) is used as it is, so that its own methods run.
	NoBatching bool
	// Batch configures the Batcher that New puts over the client. Its zero
	// value selects the defaults.
	Batch BatcherOptions
}

// Store is a [store.Store] in Redis, over any [redis.UniversalClient]: a
// single server, a Sentinel-managed primary, or a Cluster. By default the
// commands of concurrent calls share pipelines (see [Options.NoBatching]
// and [Batcher]); a call made while no pipeline is in flight is sent at
// once, after one yield of the processor that lets the goroutines ready to
// run join it, so batching adds no timed wait at light load.
//
// Key layout, with the default options, for message key K:
//
//	msg:K    "done" once K is done; "rabbitmw:claim:<ms>:<token>" while it
//	         is claimed by <token> of a Redis store, its key expiring <ms>
//	         (the abandoned retention) after its lease ends; any other
//	         value is the mark of a hand-written consumer processing K
//	         ("processing")
//	retry:K  the failure count of K, an integer
//
// Redis's own clock measures the lease: a claim of ours is processing
// while its key's remaining time (PTTL) is more than <ms>, and abandoned
// after that, until the key expires. Hand-written consumers see an
// abandoned claim as work in progress, as they see their own marks; the
// first Claim by this store that finds it removes it.
//
// Extend, Complete, Release and Fail are one command each: one Lua
// script (EVALSHA; a script not yet in Redis's cache costs one more round
// trip, once, unless [Store.Load] cached it). Claim is one native SET NX
// GET when it finds the key absent or done, the common cases; when it
// finds a claim or a hand-written mark it runs a script as well, to read
// the key's remaining time and decide (two commands, one after the other).
// On a Redis before 7.0, which refuses NX with GET, Claim runs the script
// alone. Without batching each command is a round trip of its own; with
// it, it shares one with the commands of other calls made meanwhile, but
// for Fail's, which go-redis must not send twice (see [Store.Fail]). Every command touches a single key, so the store works
// unchanged on Redis Cluster. A mark of a hand-written consumer
// is processing until it expires, and nobody owns it: this store never
// completes or releases it. One left without expiry (a hand-written
// consumer that died between SETNX and EXPIRE) is given the claimer's
// lease the first time Claim finds it, so it cannot block its message
// forever.
//
// go-redis sends a command again, or a whole pipeline, when its answer
// does not come within the client's read timeout, though the first send
// may have taken effect (see [Store.Claim]). What each command finds the
// second time: a Claim, its own claim, and reports Claimed; an Extend or a
// ResetFailures does again what it did; a Complete or a Release finds the
// claim gone and returns store.ErrLostClaim (middleware.Dedup then tries
// the message again later, and finds it done, or free to claim); a Claim
// that had found the key abandoned finds it absent and claims it, so that
// the attempt that never finished goes uncounted. Fail alone is sent once
// (see [Store.Fail]).
//
// Errors from the client, including timeouts, are wrapped with the
// operation and key; redis.Nil never escapes. A key that holds a value
// of another type than a string, written by something else, is refused
// with [ErrWrongType]; ResetFailures alone reads nothing, and deletes the
// failure key whatever it holds.
//
// Create the client with ContextTimeoutEnabled: true. Without it go-redis
// ignores the deadline of a call's context and waits out its own
// ReadTimeout (3s by default) on each retry, so a store call to an
// unreachable Redis can block for many seconds, where the store.Store contract
// asks for a prompt return. Dedup does not depend on it for safety (it
// cancels a handler whose lease may end on the clock, not on the store's
// answer), but every store call of a delivery is bounded by it.
type Store struct {
	client               Client   // Load and Inspect's
	cmds                 Client   // the state changes': client or a Batcher over it
	batcher              *Batcher // cmds, if it is a Batcher: see Store.set and Store.run
	claimPre, failurePre string
	abandoned            int64  // the abandoned retention, in milliseconds
	keep                 any    // the same, formatted: an argument of the owner-checked scripts
	claimVal             string // claimTag, keep and a colon: the value of a claim but its token

	// noSetGet is set once Redis refused SET NX GET (before 7.0): every
	// Claim then runs claimScript alone.
	noSetGet atomic.Bool
}

// New returns a store that uses client, which the caller keeps
// and closes; it batches over client unless opts say otherwise (see
// [Options.NoBatching]). The store starts no goroutine and holds nothing
// to close. It panics if client is nil or opts.Batch.MaxBatch is negative.
func New(client Client, opts Options) *Store {
	if client == nil {
		panic("redisstore: New: nil client")
	}
	if opts.Batch.MaxBatch < 0 {
		panic(fmt.Sprintf("redisstore: New: negative Batch.MaxBatch %d", opts.Batch.MaxBatch))
	}
	cmds := client
	if !opts.NoBatching {
		switch c := client.(type) {
		case *redis.Client, *redis.ClusterClient, *redis.Ring:
			cmds = NewBatcher(c.(PipelineClient), opts.Batch)
		}
	}
	claimPre, failurePre := opts.ClaimPrefix, opts.FailurePrefix
	if claimPre == "" {
		claimPre = "msg:"
	}
	if failurePre == "" {
		failurePre = "retry:"
	}
	abandoned := opts.AbandonedRetention
	if abandoned <= 0 {
		abandoned = store.DefaultAbandonedRetention
	}
	keep := strconv.FormatInt(millis(abandoned), 10)
	b, _ := cmds.(*Batcher)
	return &Store{
		client:     client,
		cmds:       cmds,
		batcher:    b,
		claimPre:   opts.Prefix + claimPre,
		failurePre: opts.Prefix + failurePre,
		abandoned:  millis(abandoned),
		keep:       keep,
		claimVal:   claimTag + keep + ":",
	}
}

// Client is the part of a go-redis client that a [Store] uses:
// its scripts, SET and DEL. Every [redis.UniversalClient] has it (a
// [redis.Client], a [redis.ClusterClient], a [redis.Ring], a Sentinel
// failover client, the [redis.AutoPipeliner] they return from
// AutoPipeline), so does a [Batcher], and a wrapper or a test fake needs
// no more than this.
type Client interface {
	redis.Scripter
	Del(ctx context.Context, keys ...string) *redis.IntCmd
	SetArgs(ctx context.Context, key string, value any, a redis.SetArgs) *redis.StatusCmd
}

// The value of a done mark. Hand-written consumers compare with it.
const doneMark = "done"

// claimTag begins the value of every claim this store writes, followed by
// the claim's abandoned retention in milliseconds, a colon and the token.
const claimTag = "rabbitmw:claim:"

// Each script touches KEYS[1] only. Results: claim returns 1 (claimed),
// 2 (processing), 3 (done) or 4 (abandoned); the owner-checked ones return
// 1 when the token owned the key, else 0; fail returns the new count.
//
// The owner-checked scripts begin with ownedLua, which sets keep to the
// abandoned retention of the claim in KEYS[1] if the token owns it: the
// value is ours, its token is the caller's, and its lease has not ended.
// ARGV[1] is the value of the caller's claim as a store with the caller's
// settings writes it, ARGV[2] that store's abandoned retention (the number
// in ARGV[1]): a key that holds ARGV[1], the common case, is compared, not
// parsed; any other value (a claim made with another retention, a mark that
// is no claim of ours) is parsed, and its token compared with the caller's,
// which ends ARGV[1] (after the tag, the retention and a colon). Milliseconds are formatted with %d: Lua would print a
// large number in exponent notation, which PX and PEXPIRE refuse.
const ownedLua = `
local v = redis.call('GET', KEYS[1])
local keep = ARGV[2]
if v ~= ARGV[1] then
  local token
  if v then
    keep, token = string.match(v, '^rabbitmw:claim:(%d+):(.*)$')
  end
  if token ~= string.sub(ARGV[1], #'rabbitmw:claim:' + #ARGV[2] + 2) then
    return 0
  end
end
if redis.call('PTTL', KEYS[1]) <= tonumber(keep) then
  return 0
end
`

// A script is a Lua script with its SHA1 made an argument once, not at
// each EVALSHA, and its source kept for an EVAL of the store's own.
type script struct {
	*redis.Script
	sha any
	src string
}

func newScript(src string) script {
	s := redis.NewScript(src)
	return script{s, s.Hash(), src}
}

var (
	// ARGV: the claim's value, its PX (lease plus abandoned retention),
	// the lease alone (for a hand-written mark without expiry). It
	// returns a store.Status's number: 1 claimed, 2 processing, 3 done,
	// 4 abandoned. A key that holds the claim's own value is claimed: see
	// Store.Claim.
	claimScript = newScript(`
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
local v = redis.call('GET', KEYS[1])
if v == 'done' then
  return 3
end
if v == ARGV[1] then
  return 1
end
local keep = string.match(v, '^rabbitmw:claim:(%d+):')
if keep then
  if redis.call('PTTL', KEYS[1]) > tonumber(keep) then
    return 2
  end
  redis.call('DEL', KEYS[1])
  return 4
end
if redis.call('PTTL', KEYS[1]) == -1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return 2`)

	// ARGV: ownedLua's, the lease.
	extendScript = newScript(ownedLua + `
redis.call('PEXPIRE', KEYS[1], string.format('%d', tonumber(ARGV[3]) + tonumber(keep)))
return 1`)

	// ARGV: ownedLua's, the retention of the done mark.
	completeScript = newScript(ownedLua + `
redis.call('SET', KEYS[1], 'done', 'PX', ARGV[3])
return 1`)

	// ARGV: ownedLua's.
	releaseScript = newScript(ownedLua + `
redis.call('DEL', KEYS[1])
return 1`)

	failScript = newScript(`
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
func (r *Store) Load(ctx context.Context) error {
	for _, s := range []script{claimScript, extendScript, completeScript, releaseScript, failScript} {
		if err := s.Load(ctx, r.client).Err(); err != nil {
			return fmt.Errorf("redisstore: load scripts: %w", err)
		}
	}
	return nil
}

// Claim implements [store.Store]. The common claims, of an absent key and
// of a done one, are one SET NX GET; a claim that finds a claim or a
// hand-written mark runs claimScript, which reads the key's PTTL to decide.
//
// go-redis sends a command again, or a whole pipeline, on a new connection
// when its answer does not come within the client's read timeout (up to
// MaxRetries times), though the first send may have taken effect. A claim
// that finds the key holding its own value (its token, which no other
// claim has) is therefore this claim, sent before: it reports Claimed,
// with the lease that the first send set.
func (r *Store) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	k, value := r.claim(key, token)
	if err := ctx.Err(); err != nil {
		return 0, r.fail("claim", key, k, err)
	}
	ms := millis(lease)
	if !r.noSetGet.Load() {
		old, err := r.set(ctx, k, value, ms+r.abandoned)
		switch {
		case errors.Is(err, redis.Nil):
			return store.Claimed, nil
		case err == nil && old == doneMark:
			return store.Done, nil
		case err == nil && old == value:
			// This very claim, sent before: see Claim's doc.
			return store.Claimed, nil
		case err == nil:
			// A claim or a mark: the script decides.
		case isSyntaxError(err):
			// Redis before 7.0 refuses NX with GET; the script does it all.
			r.noSetGet.Store(true)
		default:
			return 0, r.fail("claim", key, k, err)
		}
	}
	n, err := r.run(ctx, claimScript, k, value, ms+r.abandoned, ms)
	if err != nil {
		return 0, r.fail("claim", key, k, err)
	}
	if st := store.Status(n); st.Valid() {
		return st, nil
	}
	return 0, r.fail("claim", key, k, fmt.Errorf("unexpected script result %d", n))
}

// isSyntaxError reports whether err is Redis's answer to a command it does
// not know the form of.
func isSyntaxError(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.HasPrefix(re.Error(), "ERR syntax error")
}

// claim returns the key of key's claim and the value of token's claim of
// it, made in one allocation.
func (r *Store) claim(key, token string) (k, value string) {
	kv := r.claimPre + key + r.claimVal + token
	n := len(r.claimPre) + len(key)
	return kv[:n], kv[n:]
}

// set sets k to value, to expire in px milliseconds, if k is absent (SET
// NX PX GET), and returns the value k had: redis.Nil if none.
func (r *Store) set(ctx context.Context, k, value string, px int64) (string, error) {
	if r.batcher == nil {
		return r.cmds.SetArgs(ctx, k, value, redis.SetArgs{Mode: "NX", TTL: time.Duration(px) * time.Millisecond, Get: true}).Result()
	}
	cmd := redis.NewStatusCmd(ctx, "set", k, value, "px", px, "nx", "get")
	if err := r.batcher.process(ctx, cmd); err != nil {
		return "", err
	}
	return cmd.Result()
}

// Extend implements [store.Store].
func (r *Store) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	k, value := r.claim(key, token)
	n, err := r.run(ctx, extendScript, k, value, r.keep, millis(lease))
	return r.owned("extend", key, k, n, err)
}

// Complete implements [store.Store].
func (r *Store) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	k, value := r.claim(key, token)
	n, err := r.run(ctx, completeScript, k, value, r.keep, millis(retention))
	return r.owned("complete", key, k, n, err)
}

// Release implements [store.Store].
func (r *Store) Release(ctx context.Context, key, token string) error {
	k, value := r.claim(key, token)
	n, err := r.run(ctx, releaseScript, k, value, r.keep)
	return r.owned("release", key, k, n, err)
}

// owned returns the error of an owner-checked script on key, in Redis
// key k, whose result was n, err.
func (r *Store) owned(op, key, k string, n int64, err error) error {
	if err != nil {
		return r.fail(op, key, k, err)
	}
	if n == 0 {
		return store.ErrLostClaim
	}
	return nil
}

// Fail implements [store.Store]. Unlike the other commands, its script is
// sent once, on a round trip of its own: sent again after its answer was
// lost (see Claim), its INCR would count the failure twice, and middleware.Retry
// would dead-letter the message an attempt early. A Fail whose answer is
// lost returns an error instead, its count unknown, as the [store.Store]
// contract allows. Over a client that New does not batch over (a wrapper of
// your own, go-redis's autopipeliner), Fail calls the client's EvalSha, as
// the other methods do, and is sent again as that client sends any
// command.
func (r *Store) Fail(ctx context.Context, key string, ttl time.Duration) (int64, error) {
	k := r.failurePre + key
	n, err := r.once(ctx, failScript, k, millis(ttl))
	if err != nil {
		return 0, r.fail("fail", key, k, err)
	}
	return n, nil
}

// ResetFailures implements [store.Store].
func (r *Store) ResetFailures(ctx context.Context, key string) error {
	k := r.failurePre + key
	if err := ctx.Err(); err != nil {
		return r.fail("reset failures", key, k, err)
	}
	if err := r.cmds.Del(ctx, k).Err(); err != nil {
		return r.fail("reset failures", key, k, err)
	}
	return nil
}

// run runs s on the single key k, as s.Run does: EVALSHA, then EVAL if
// Redis does not have the script. A done context fails at once, whatever
// the client would do with it (go-redis's autopipeliner, for one, still
// sends the command). Over the Batcher, the EVALSHA is built with its
// arguments in one slice; over any other client, s.Run builds it.
func (r *Store) run(ctx context.Context, s script, k string, args ...any) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if r.batcher == nil {
		return s.Run(ctx, r.cmds, []string{k}, args...).Int64()
	}
	argv := append(make([]any, 0, 4+len(args)), "evalsha", s.sha, 1, k)
	argv = append(argv, args...)
	cmd := redis.NewCmd(ctx, argv...)
	cmd.SetFirstKeyPos(3)
	if err := r.batcher.process(ctx, cmd); err != nil {
		return 0, err
	}
	if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		return s.Eval(ctx, r.cmds, []string{k}, args...).Int64()
	}
	return cmd.Int64()
}

// noResend is a command that go-redis sends once, not again on a new
// connection when its answer does not come (its Cmder.NoRetry): a pipeline
// that holds one is not sent again either.
type noResend struct{ *redis.Cmd }

// NoRetry implements [redis.Cmder].
func (noResend) NoRetry() bool { return true }

// once runs s on the single key k, as run does, but sends it once (see
// Store.Fail), on its own round trip: over a Batcher, on the client the
// batcher wraps, so that the pipelines of other calls keep go-redis's
// resends. That client must be one that New batches over (see
// [Options.NoBatching]); any other Client runs s as run does, through its
// own methods, and resends it as it resends any command.
func (r *Store) once(ctx context.Context, s script, k string, args ...any) (int64, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	var c any = r.client
	if r.batcher != nil {
		c = r.batcher.client
	}
	var p interface {
		Process(ctx context.Context, cmd redis.Cmder) error
	}
	switch c := c.(type) {
	case *redis.Client:
		p = c
	case *redis.ClusterClient:
		p = c
	case *redis.Ring:
		p = c
	default:
		return r.run(ctx, s, k, args...)
	}
	send := func(name string, script any) *redis.Cmd {
		argv := append(make([]any, 0, 4+len(args)), name, script, 1, k)
		cmd := redis.NewCmd(ctx, append(argv, args...)...)
		cmd.SetFirstKeyPos(3)
		_ = p.Process(ctx, noResend{cmd})
		return cmd
	}
	cmd := send("evalsha", s.sha)
	if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		cmd = send("eval", s.src)
	}
	return cmd.Int64()
}

// fail returns the error of op on key, in Redis key k, that failed with
// err.
func (r *Store) fail(op, key, k string, err error) error {
	switch {
	case errors.Is(err, redis.Nil):
		err = errors.New("empty reply")
	case isWrongType(err):
		return &wrongTypeError{op: op, key: key, k: k, err: err}
	}
	return fmt.Errorf("redisstore: %s %q: %w", op, key, err)
}

// millis converts d to whole milliseconds for PX and PEXPIRE, at least 1.
func millis(d time.Duration) int64 {
	if ms := d.Milliseconds(); ms > 0 {
		return ms
	}
	return 1
}

var _ store.Store = (*Store)(nil)
