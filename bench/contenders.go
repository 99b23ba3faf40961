package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/benchstack"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// The contenders, in the order of the table.
const (
	rawName      = "raw"
	handP1Name   = "hand-written-p1"
	handName     = "hand-written"
	memoryName   = "rabbitmw-memory"
	redisName    = "rabbitmw-redis"
	redisDupName = "rabbitmw-redis-dup"
	// postgresName and pgStoreName: see postgres.go.
	// redisUnbatchedName is the Redis contender with batching off
	// (redisstore.Options.NoBatching); rabbitmw-redis batches, as
	// redisstore.New does by default. Until the batching became the
	// default, rabbitmw-redis was unbatched and the batched contender was
	// rabbitmw-redis-batch.
	redisUnbatchedName = "rabbitmw-redis-unbatched"
	// redisAPName runs only when -only names it: the Redis contender over
	// go-redis's autopipeliner, which batches the commands of concurrent
	// callers into pipelines (BENCHMARKS.md says what it showed).
	redisAPName = "rabbitmw-redis-ap"
)

const (
	// The hand-written pattern's expiries, and the settings teams run it
	// with (hand-written-p1).
	handClaimTTL   = 300 * time.Second
	handDoneTTL    = 24 * time.Hour
	handP1Prefetch = 1
	handP1Workers  = 1
	// minDuplicatesGap is the least distance, in messages, between a
	// message and a later one that repeats its id (rabbitmw-redis-dup).
	minDuplicatesGap = 1000
)

// contenderNames is every contender, in the order of the table;
// defaultContenders those that run when -only is not given.
var (
	contenderNames    = []string{rawName, handP1Name, handName, memoryName, redisName, redisDupName, pgStoreName, postgresName, redisUnbatchedName, watermillName, redisAPName}
	defaultContenders = slices.Clip(contenderNames[:len(contenderNames)-1])
)

func knownContender(name string) bool { return slices.Contains(contenderNames, name) }

// A contender is one way of consuming a queue.
type contender struct {
	name              string
	prefetch, workers int // as run
	// opts are what the rabbitmw contenders pass to broker.Consume: zeros
	// when the run is at the broker's defaults, so that the broker applies
	// them itself.
	opts  broker.ConsumeOptions
	redis bool // uses Redis
	pg    bool // uses PostgreSQL
	dup   bool // its messages repeat ids (-dup)
	kind  kind
}

type kind int

const (
	kindRaw kind = iota
	kindHand
	kindRabbitmwMemory
	kindRabbitmwRedis
	kindRabbitmwRedisAP
	kindRabbitmwPostgres
	kindRabbitmwPgStore
	kindRabbitmwRedisUnbatched
	kindWatermill
)

// newContender returns the contender called name at the common prefetch and
// workers; opts is what rabbitmw passes to Consume for them.
func newContender(name string, prefetch, workers int, opts broker.ConsumeOptions) contender {
	c := contender{name: name, prefetch: prefetch, workers: workers, opts: opts}
	switch name {
	case rawName:
		c.kind = kindRaw
	case handP1Name:
		c.kind, c.redis = kindHand, true
		c.prefetch, c.workers = handP1Prefetch, handP1Workers
	case handName:
		c.kind, c.redis = kindHand, true
	case memoryName:
		c.kind = kindRabbitmwMemory
	case redisName:
		c.kind, c.redis = kindRabbitmwRedis, true
	case redisDupName:
		c.kind, c.redis, c.dup = kindRabbitmwRedis, true, true
	case redisAPName:
		c.kind, c.redis = kindRabbitmwRedisAP, true
	case postgresName:
		c.kind, c.pg = kindRabbitmwPostgres, true
	case pgStoreName:
		c.kind, c.pg = kindRabbitmwPgStore, true
	case redisUnbatchedName:
		c.kind, c.redis = kindRabbitmwRedisUnbatched, true
	case watermillName:
		c.kind = kindWatermill
	default:
		panic("bench: unknown contender " + name)
	}
	return c
}

// consume consumes b with c until every message is settled for good (acked,
// or acked as a duplicate), recording into rec, over the run's store
// clients cl.
func (c contender) consume(ctx context.Context, e *env, b batch, cl *clients, rec *recorder) error {
	rc, pg := cl.redis, cl.pg
	switch c.kind {
	case kindRaw:
		return consumeRaw(ctx, e.cfg.amqpURL, b.queue, c.prefetch, c.workers, rec,
			func(_ context.Context, d *amqp.Delivery) rabbitmw.Outcome {
				rec.effect(d.MessageId)
				return rabbitmw.Ack
			})
	case kindHand:
		return consumeRaw(ctx, e.cfg.amqpURL, b.queue, c.prefetch, c.workers, rec, handWritten(rc, b.prefix, rec))
	case kindRabbitmwMemory:
		return consumeRabbitmw(ctx, e.cfg.amqpURL, b.queue, c.opts, store.NewMemory(), false, rec)
	case kindRabbitmwRedis:
		// The batcher that redisstore.New would put over rc, made here so
		// that attributed sits between it and the store: a pipeline serves
		// several deliveries, and each pays its share.
		bt := redisstore.NewBatcher(rc, redisstore.BatcherOptions{})
		st := redisstore.New(attributed{bt, cl.rtt.shares}, redisstore.Options{Prefix: b.prefix})
		return consumeRabbitmw(ctx, e.cfg.amqpURL, b.queue, c.opts, st, true, rec)
	case kindRabbitmwRedisAP:
		// Not counted per delivery: the autopipeliner's dispatch does not
		// show the hook which command a pipeline carried.
		ap, err := rc.AutoPipeline()
		if err != nil {
			return fmt.Errorf("Redis autopipeline: %w", err)
		}
		defer ap.Close()
		return consumeRabbitmw(ctx, e.cfg.amqpURL, b.queue, c.opts, redisstore.New(ap, redisstore.Options{Prefix: b.prefix}), false, rec)
	case kindRabbitmwPostgres:
		return consumePostgres(ctx, e.cfg.amqpURL, b.queue, c.opts, pg, rec)
	case kindRabbitmwPgStore:
		return consumeRabbitmw(ctx, e.cfg.amqpURL, b.queue, c.opts, pg.st, true, rec)
	case kindWatermill:
		return consumeWatermill(ctx, e.cfg.amqpURL, b.queue, c.prefetch, c.workers, rec)
	case kindRabbitmwRedisUnbatched:
		st := redisstore.New(attributed{rc, cl.rtt.shares}, redisstore.Options{Prefix: b.prefix, NoBatching: true})
		return consumeRabbitmw(ctx, e.cfg.amqpURL, b.queue, c.opts, st, true, rec)
	}
	panic("bench: unknown contender kind")
}

// consumeRaw consumes queue with a plain amqp091 consumer: manual acks,
// the given prefetch, and workers goroutines ranging over the delivery
// channel. handle says how to settle each delivery: Ack and Duplicate ack
// it, anything else nacks it with requeue.
func consumeRaw(ctx context.Context, url, queue string, prefetch, workers int, rec *recorder,
	handle func(context.Context, *amqp.Delivery) rabbitmw.Outcome) error {
	conn, err := amqp.Dial(url)
	if err != nil {
		return err
	}
	defer conn.Close()
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Qos(prefetch, 0, false); err != nil {
		return err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return err
	}
	// The workers end when deliveries closes, with the connection.
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			var p probe // counts the Redis round trips of the delivery in hand
			pctx := withProbe(ctx, &p)
			for d := range deliveries {
				start := rec.begin(d.Redelivered)
				p.reset()
				o := handle(pctx, &d)
				var err error
				if o == rabbitmw.Ack || o == rabbitmw.Duplicate {
					if err = d.Ack(false); err == nil {
						rec.acked(d.MessageId)
					}
				} else {
					err = d.Nack(false, true)
				}
				rec.end(start, o, p.cost(), err)
			}
		})
	}
	select {
	case <-rec.done:
	case <-ctx.Done():
		err = ctx.Err()
	case e := <-closed:
		err = fmt.Errorf("connection lost: %v", e)
	}
	conn.Close()
	wg.Wait()
	return err
}

// handWritten returns the usual hand-written Redis pattern, ported as it
// is written (the legacyConsumer of package e2e's tests): SETNX
// msg:<id> processing, EXPIRE 300; a key already set means done (ack) or
// being processed (nack with requeue); then the handler, SET msg:<id> done,
// EXPIRE 24h, DEL retry:<id>, ack. Errors are ignored, as in the original.
// Its keys are under prefix.
func handWritten(rc *redis.Client, prefix string, rec *recorder) func(context.Context, *amqp.Delivery) rabbitmw.Outcome {
	return func(ctx context.Context, d *amqp.Delivery) rabbitmw.Outcome {
		id := d.MessageId
		key := prefix + "msg:" + id
		if ok, _ := rc.SetNX(ctx, key, "processing", 0).Result(); !ok {
			if v, _ := rc.Get(ctx, key).Result(); v == "done" {
				return rabbitmw.Duplicate
			}
			return rabbitmw.Requeue
		}
		rc.Expire(ctx, key, handClaimTTL)
		rec.effect(id)
		rc.Set(ctx, key, "done", 0)
		rc.Expire(ctx, key, handDoneTTL)
		rc.Del(ctx, prefix+"retry:"+id)
		return rabbitmw.Ack
	}
}

// consumeRabbitmw consumes queue with broker.Consume and the recommended
// stack over st. An outermost layer stamps the start of each delivery, by
// its delivery tag, and ConsumeOptions.OnSettle the end.
func consumeRabbitmw(ctx context.Context, url, queue string, opts broker.ConsumeOptions, st store.Store, trackRTT bool, rec *recorder) error {
	business := rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		rec.effect(d.MessageId)
		return nil
	})
	return consumeStack(ctx, url, queue, opts, benchstack.Recommended(st), business, trackRTT, rec)
}

// consumeStack consumes queue with broker.Consume and stack around
// business, as consumeRabbitmw describes.
func consumeStack(ctx context.Context, url, queue string, opts broker.ConsumeOptions, stack rabbitmw.Middleware, business rabbitmw.Handler, trackRTT bool, rec *recorder) error {
	var frames, acked atomic.Int64
	b := broker.New(url, broker.Options{Observer: broker.Observer{Ack: func(e broker.AckEvent) {
		frames.Add(1)
		acked.Add(int64(e.Deliveries))
	}}})
	defer b.Close()
	defer func() {
		if n := frames.Load(); n > 0 {
			fmt.Fprintf(os.Stderr, "bench: %s: %d deliveries acked in %d basic.ack frames: %.2f per frame\n", queue, acked.Load(), n, float64(acked.Load())/float64(n))
		}
	}()
	h := rabbitmw.Chain(stamp(rec, trackRTT), stack)(business)
	opts.Topology = topology
	opts.OnSettle = func(d *amqp.Delivery, o rabbitmw.Outcome, err error) {
		if err == nil && (o == rabbitmw.Ack || o == rabbitmw.Duplicate) {
			rec.acked(d.MessageId)
		}
		var start int64
		c := notCounted
		if p := rec.probe(d.DeliveryTag); p != nil {
			start = p.start.Swap(0)
			if trackRTT {
				c = p.cost()
			}
		}
		rec.end(start, o, c, err)
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-rec.done:
			cancel()
		case <-cctx.Done():
		}
	}()
	if err := b.Consume(cctx, queue, h, opts); err != nil {
		return err
	}
	select {
	case <-rec.done:
		return nil
	default:
		if err := ctx.Err(); err != nil {
			return err
		}
		return errors.New("the consumer stopped before every message was settled")
	}
}

// stamp is the outermost layer of the rabbitmw contenders: it records the
// start of each delivery's handling on the probe of its delivery tag and,
// if trackRTT, passes the probe down in the context for the round trip hook.
func stamp(rec *recorder, trackRTT bool) rabbitmw.Middleware {
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			t := rec.begin(d.Redelivered)
			if p := rec.probe(d.DeliveryTag); p != nil {
				p.reset()
				p.start.Store(t)
				if trackRTT {
					ctx = withProbe(ctx, p)
				}
			}
			return next.Handle(ctx, d)
		})
	}
}
