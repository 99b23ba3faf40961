package redisstore

import (
	"context"
	"fmt"
	"runtime"
	"slices"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// DefaultMaxBatch is the most commands a [Batcher] sends in one
// pipeline when its options leave MaxBatch zero.
const DefaultMaxBatch = 64

// BatcherOptions configures a [Batcher]. The zero value selects
// the defaults.
type BatcherOptions struct {
	// MaxBatch caps the commands in one pipeline; the callers beyond it wait
	// for the next one. Default [DefaultMaxBatch]. It panics if negative.
	MaxBatch int
}

// PipelineClient is what a [Batcher] needs of the client it wraps:
// scripts and pipelines. A [redis.Client], a [redis.ClusterClient] and a
// [redis.Ring] have both.
type PipelineClient interface {
	redis.Scripter
	Pipeline() redis.Pipeliner
}

// A Batcher is a [Client] that coalesces the script calls (Eval,
// EvalSha, EvalRO, EvalShaRO), DELs and SETs of concurrent callers into
// pipelines, one round trip for many commands. [New] puts one over the
// clients it knows can pipeline (see [Options]); make one yourself to wrap
// it in a Client of your own (one that instruments each call, say) or to
// share one between several stores, and give that to New, which uses a
// Client it does not know as it is.
//
// Batching has no timer and no goroutine of its own: callers send the
// pipelines. A call made when no pipeline of this batcher is in flight is
// sent in the caller's goroutine and under its context, at once but for
// one thing: the caller first yields its processor (runtime.Gosched), and
// again while a yield brings new calls, so that the goroutines ready to
// run join its pipeline. A call made while a pipeline is in flight waits.
// When a pipeline's results are in, its sender wakes its other callers and
// the oldest waiting caller, which sends the next pipeline, carrying every
// call that queued meanwhile, at most MaxBatch of them (the rest wait for
// the one after), and does the same when its results are in. It yields
// first too, so that the callers just given their results, which are
// about to call again (a claim's caller, to complete), join it rather
// than wait for the pipeline after. So at light load a call
// waits for nothing but its turn at the processor, and is its own round
// trip; under load the batches grow with the concurrency (the callers of
// a pipeline just done, woken together, share the next one rather than
// the first of them going alone); and a caller never sends a pipeline
// that does not carry its own command.
//
// Each call gets its own command and result, as on the wrapped client: one
// command's error (a script's NOSCRIPT, which makes [redis.Script.Run]
// send the script again with EVAL as its next call) does not touch the
// others of its pipeline; an error of the connection fails every command
// of that pipeline. A caller whose context ends while it waits returns at
// once with the context's error: if its command was not yet taken into a
// pipeline, it is never sent; if it was, its result is dropped and the
// command may or may not have taken effect, as the [store.Store] contract
// allows for any error. A pipeline of several calls runs until the latest
// deadline of its callers, or with no deadline when one of them has none
// (the client's own timeouts then bound it); its sender returns when it
// does, even if its own context ended first.
//
// On a Redis Cluster, wrap the [redis.ClusterClient]: its pipelines split
// the commands by slot, send one pipeline per node, in parallel, and follow
// MOVED and ASK redirections per command, so a batch never crosses nodes
// on the wire. One batcher then has one batch in flight for the whole
// cluster.
//
// Commands go through the wrapped client's pipelines and therefore through
// its connection pool, which checks a connection's health (one system call)
// each time a pipeline takes one: that is one check per batch rather than
// per command, and it is what finds a connection that the server closed
// (after a restart, say) before a batch is written to it.
//
// ScriptLoad and ScriptExists are not batched; they go straight to the
// wrapped client, so that on a Cluster [Store.Load] reaches every primary.
// A Batcher is safe for concurrent use and holds nothing to close.
type Batcher struct {
	client PipelineClient
	max    int

	mu    sync.Mutex
	busy  bool         // a pipeline is in flight, or a caller is woken to send one; calls queue
	queue []*batchCall // calls waiting, in order, not yet taken into a pipeline
}

// NewBatcher returns a batcher over client, which the caller keeps
// and closes. It panics if client is nil or opts.MaxBatch is negative.
func NewBatcher(client PipelineClient, opts BatcherOptions) *Batcher {
	if client == nil {
		panic("redisstore: NewBatcher: nil client")
	}
	if opts.MaxBatch < 0 {
		panic(fmt.Sprintf("redisstore: NewBatcher: negative MaxBatch %d", opts.MaxBatch))
	}
	max := opts.MaxBatch
	if max == 0 {
		max = DefaultMaxBatch
	}
	return &Batcher{client: client, max: max}
}

type batchOp uint8

const (
	opEval batchOp = iota
	opEvalSha
	opEvalRO
	opEvalShaRO
	opDel
	opSet
	opCmd // a command built by the caller: see Batcher.process
)

// A batchCall is one caller's command. wake is sent one token, under
// Batcher.mu: when the call's result is in cmd, del, status or ready
// (written before), or, with lead set, when its caller is to send the next
// pipeline. Its buffer of one lets the token be sent to a caller that left
// (its context ended), which takes no more tokens.
type batchCall struct {
	ctx    context.Context
	op     batchOp
	script string // source or SHA1
	keys   []string
	args   []any
	value  any           // opSet's value, with keys[0] its key
	set    redis.SetArgs // opSet's options
	wake   chan struct{}
	lead   bool // set with wake's token: the caller sends the next pipeline

	cmd    *redis.Cmd
	del    *redis.IntCmd
	status *redis.StatusCmd
	ready  redis.Cmder // opCmd's
}

// calls holds the batchCalls of calls that are over, for new calls to
// use: a call, with its channel, is then no allocation.
var calls = sync.Pool{New: func() any { return &batchCall{wake: make(chan struct{}, 1)} }}

// newCall returns a batchCall for a call of op under ctx, its wake empty.
func newCall(ctx context.Context, op batchOp) *batchCall {
	c := calls.Get().(*batchCall)
	c.ctx, c.op = ctx, op
	return c
}

// free puts c back for another call. Only a call for which do returned nil
// is freed, once its results are read: no other goroutine holds it then,
// and its wake is empty. One that do left with an error may still be in a
// pipeline whose sender will write to it and send it the token.
func (c *batchCall) free() {
	*c = batchCall{wake: c.wake}
	calls.Put(c)
}

// Eval implements [redis.Scripter], batched.
func (b *Batcher) Eval(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return b.script(ctx, opEval, script, keys, args)
}

// EvalSha implements [redis.Scripter], batched.
func (b *Batcher) EvalSha(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return b.script(ctx, opEvalSha, sha1, keys, args)
}

// EvalRO implements [redis.Scripter], batched.
func (b *Batcher) EvalRO(ctx context.Context, script string, keys []string, args ...any) *redis.Cmd {
	return b.script(ctx, opEvalRO, script, keys, args)
}

// EvalShaRO implements [redis.Scripter], batched.
func (b *Batcher) EvalShaRO(ctx context.Context, sha1 string, keys []string, args ...any) *redis.Cmd {
	return b.script(ctx, opEvalShaRO, sha1, keys, args)
}

// ScriptExists implements [redis.Scripter] on the wrapped client.
func (b *Batcher) ScriptExists(ctx context.Context, hashes ...string) *redis.BoolSliceCmd {
	return b.client.ScriptExists(ctx, hashes...)
}

// ScriptLoad implements [redis.Scripter] on the wrapped client.
func (b *Batcher) ScriptLoad(ctx context.Context, script string) *redis.StringCmd {
	return b.client.ScriptLoad(ctx, script)
}

// Del deletes keys, batched.
func (b *Batcher) Del(ctx context.Context, keys ...string) *redis.IntCmd {
	c := newCall(ctx, opDel)
	c.keys = keys
	if err := b.do(c); err != nil {
		cmd := redis.NewIntCmd(ctx, "del")
		cmd.SetErr(err)
		return cmd
	}
	cmd := c.del
	c.free()
	return cmd
}

// SetArgs sets key to value with the options a, batched.
func (b *Batcher) SetArgs(ctx context.Context, key string, value any, a redis.SetArgs) *redis.StatusCmd {
	c := newCall(ctx, opSet)
	c.keys, c.value, c.set = []string{key}, value, a
	if err := b.do(c); err != nil {
		cmd := redis.NewStatusCmd(ctx, "set", key)
		cmd.SetErr(err)
		return cmd
	}
	cmd := c.status
	c.free()
	return cmd
}

// process sends cmd, a command built by the caller, in a pipeline with the
// other calls, as the methods do theirs: a store's own calls build their
// commands in fewer allocations than go-redis's generic methods. It
// returns a non-nil error, the context's, only when ctx ended before cmd's
// result came; cmd is then not to be touched (its pipeline may still write
// its result).
func (b *Batcher) process(ctx context.Context, cmd redis.Cmder) error {
	c := newCall(ctx, opCmd)
	c.ready = cmd
	err := b.do(c)
	if err == nil {
		c.free()
	}
	return err
}

func (b *Batcher) script(ctx context.Context, op batchOp, script string, keys []string, args []any) *redis.Cmd {
	c := newCall(ctx, op)
	c.script, c.keys, c.args = script, keys, args
	if err := b.do(c); err != nil {
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(err)
		return cmd
	}
	cmd := c.cmd
	c.free()
	return cmd
}

// do runs c, in a pipeline that c's caller sends if nothing is in
// flight, else in a later one. It returns a non-nil error only when c's
// context ended before c's result came; c's own result is then not to be
// read.
func (b *Batcher) do(c *batchCall) error {
	b.mu.Lock()
	if !b.busy {
		// c sends the next pipeline, with the calls that gather finds.
		b.busy = true
		b.queue = append(b.queue, c)
		b.gather()
		batch := b.take()
		b.mu.Unlock()
		ctx, cancel := batchContext(batch)
		b.send(ctx, batch)
		cancel()
		b.done(batch[1:])
		return nil
	}
	b.queue = append(b.queue, c)
	b.mu.Unlock()

	woken := false
	select {
	case <-c.wake:
		woken = true
	case <-c.ctx.Done():
	}
	b.mu.Lock()
	if !woken {
		select {
		case <-c.wake:
			woken = true
		default:
		}
	}
	switch {
	case woken && !c.lead:
		b.mu.Unlock()
		return nil // the result came
	case !woken:
		// Still queued, or taken into a pipeline whose sender has it.
		if i := slices.Index(b.queue, c); i >= 0 {
			b.queue = slices.Delete(b.queue, i, i+1)
		}
		b.mu.Unlock()
		return c.ctx.Err()
	}
	// c is to send the next pipeline: it is at the head of the queue, where
	// it was when it was woken.
	if err := c.ctx.Err(); err != nil {
		b.queue = slices.Delete(b.queue, 0, 1)
		b.handOff()
		b.mu.Unlock()
		return err
	}
	b.gather()
	batch := b.take()
	b.mu.Unlock()
	ctx, cancel := batchContext(batch)
	b.send(ctx, batch)
	cancel()
	b.done(batch[1:])
	return nil
}

// gather, with b.mu held by the caller that is to send the next pipeline
// (it found b idle, or was woken to send), yields the processor while
// other callers join the queue, until a yield brings none or the queue
// holds MaxBatch calls. The callers of the pipeline just done are ready to
// run, and about to call again: without it, a caller that found b idle
// would send its call alone and the others would wait for it, every other
// pipeline carrying one command; and a woken sender would leave behind the
// callers woken with it, pipelines of about half the callers each
// (BENCHMARKS.md §6).
func (b *Batcher) gather() {
	for n := 0; n < len(b.queue) && len(b.queue) < b.max; {
		n = len(b.queue)
		b.mu.Unlock()
		runtime.Gosched()
		b.mu.Lock()
	}
}

// take, with b.mu held, takes the next pipeline's calls off the queue, at
// most MaxBatch of them, skipping those whose context ended (their callers
// are leaving). The first, the caller that sends it, is kept whatever its
// context.
func (b *Batcher) take() []*batchCall {
	batch := []*batchCall{b.queue[0]}
	i := 1
	for ; i < len(b.queue) && len(batch) < b.max; i++ {
		if c := b.queue[i]; c.ctx.Err() == nil {
			batch = append(batch, c)
		}
	}
	b.queue = slices.Delete(b.queue, 0, i)
	return batch
}

// done is called by the sender of a pipeline once its results are in: it
// gives the others of the pipeline their results and hands the next
// pipeline on.
func (b *Batcher) done(others []*batchCall) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, o := range others {
		o.wake <- struct{}{}
	}
	b.handOff()
}

// handOff, with b.mu held and no pipeline of b in flight, wakes the oldest
// queued caller to send the next pipeline, or marks b idle.
func (b *Batcher) handOff() {
	if len(b.queue) == 0 {
		b.busy = false
		return
	}
	c := b.queue[0]
	c.lead = true
	c.wake <- struct{}{}
}

// batchContext returns the context a pipeline of batch runs under: the
// context of its one call, or else no values and no cancellation of any
// one caller, and the latest of their deadlines if every one has a
// deadline.
func batchContext(batch []*batchCall) (context.Context, context.CancelFunc) {
	if len(batch) == 1 {
		return batch[0].ctx, func() {}
	}
	var latest time.Time
	for _, c := range batch {
		d, ok := c.ctx.Deadline()
		if !ok {
			return context.Background(), func() {}
		}
		if d.After(latest) {
			latest = d
		}
	}
	return context.WithDeadline(context.Background(), latest)
}

// send sends batch as one pipeline under ctx and leaves each call's result
// in its command.
func (b *Batcher) send(ctx context.Context, batch []*batchCall) {
	pipe := b.client.Pipeline()
	for _, c := range batch {
		switch c.op {
		case opEval:
			c.cmd = pipe.Eval(ctx, c.script, c.keys, c.args...)
		case opEvalSha:
			c.cmd = pipe.EvalSha(ctx, c.script, c.keys, c.args...)
		case opEvalRO:
			c.cmd = pipe.EvalRO(ctx, c.script, c.keys, c.args...)
		case opEvalShaRO:
			c.cmd = pipe.EvalShaRO(ctx, c.script, c.keys, c.args...)
		case opDel:
			c.del = pipe.Del(ctx, c.keys...)
		case opSet:
			c.status = pipe.SetArgs(ctx, c.keys[0], c.value, c.set)
		case opCmd:
			_ = pipe.Process(ctx, c.ready)
		}
	}
	// Exec's error is the first command's error; each command holds its own.
	_, _ = pipe.Exec(ctx)
}

var _ Client = (*Batcher)(nil)
