package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/benchstack"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// The contenders, in the order of the table.
const (
	// plainName is the baseline: a plain amqp091 consumer that acks each
	// message; plainMultiName acks with multiple=true every multiAckEvery
	// messages, the limit of what coalescing acks can save.
	plainName      = "plain"
	plainMultiName = "plain-multi"
	handName       = "hand-written"
	// watermillName: see watermill.go.
	memoryName   = "rabbitmw-memory"
	redisName    = "rabbitmw-redis"
	redisDupName = "rabbitmw-redis-dup"
	// redisUnbatchedName is the Redis contender with batching off
	// (redisstore.Options.NoBatching); rabbitmw-redis batches, as
	// redisstore.New does by default.
	redisUnbatchedName = "rabbitmw-redis-unbatched"
	// handPgName, postgresName, postgresGroupName and pgStoreName: see
	// postgres.go.
)

const (
	// The hand-written Redis pattern's expiries.
	handClaimTTL = 300 * time.Second
	handDoneTTL  = 24 * time.Hour
	// minDuplicatesGap is the least distance, in messages, between a
	// message and a later one that repeats its id (rabbitmw-redis-dup).
	minDuplicatesGap = 1000
	// multiAckEvery is how many deliveries plain-multi acks at once.
	multiAckEvery = 16
)

// contenderNames is every contender, in the order of the table;
// defaultContenders those that run when -only is not given.
var (
	contenderNames    = []string{plainName, plainMultiName, handName, watermillName, memoryName, redisName, redisUnbatchedName, redisDupName, handPgName, postgresName, postgresGroupName, pgStoreName}
	defaultContenders = []string{plainName, plainMultiName, handName, watermillName, memoryName, redisName, redisUnbatchedName, handPgName, postgresName}
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
	// procs is the consumer processes of a run, each on a queue of its
	// own (0 means 1): see env.runOnce.
	procs int
}

// newContender returns the contender called name at the common prefetch and
// workers; opts is what rabbitmw passes to Consume for them.
func newContender(name string, prefetch, workers int, opts broker.ConsumeOptions) contender {
	if !knownContender(name) {
		panic("bench: unknown contender " + name)
	}
	c := contender{name: name, prefetch: prefetch, workers: workers, opts: opts}
	switch name {
	case handName, redisName, redisUnbatchedName:
		c.redis = true
	case redisDupName:
		c.redis, c.dup = true, true
	case handPgName, postgresName, postgresGroupName, pgStoreName:
		c.pg = true
	}
	return c
}

// consume consumes queue with c until cnt has counted every delivery
// acked, over the run's store clients cl. It runs in the child process
// (see child.go).
func (c contender) consume(ctx context.Context, url, queue string, cl *clients, cnt *counter) error {
	switch c.name {
	case plainName:
		return consumePlain(ctx, url, queue, c.prefetch, c.workers, cnt, func(_ context.Context, d *amqp.Delivery) rabbitmw.Outcome {
			cnt.effect(d.MessageId)
			return rabbitmw.Ack
		})
	case plainMultiName:
		return consumePlainMulti(ctx, url, queue, c.prefetch, cnt)
	case handName:
		return consumePlain(ctx, url, queue, c.prefetch, c.workers, cnt, handWritten(cl.redis, cl.prefix, cnt))
	case watermillName:
		return consumeWatermill(ctx, url, queue, c.prefetch, c.workers, cnt)
	case memoryName:
		return consumeRabbitmw(ctx, url, queue, c.opts, store.NewMemory(), cnt)
	case redisName, redisDupName:
		return consumeRabbitmw(ctx, url, queue, c.opts, redisstore.New(cl.redis, redisstore.Options{Prefix: cl.prefix}), cnt)
	case redisUnbatchedName:
		return consumeRabbitmw(ctx, url, queue, c.opts, redisstore.New(cl.redis, redisstore.Options{Prefix: cl.prefix, NoBatching: true}), cnt)
	case handPgName:
		return consumePlain(ctx, url, queue, c.prefetch, c.workers, cnt, handInbox(cl.pg, cnt))
	case postgresName:
		return consumePostgres(ctx, url, queue, c.opts, cl.pg, pgstore.HandlerOptions{}, cnt)
	case postgresGroupName:
		return consumePostgres(ctx, url, queue, c.opts, cl.pg, pgstore.HandlerOptions{GroupCommit: 32}, cnt)
	case pgStoreName:
		return consumeRabbitmw(ctx, url, queue, c.opts, cl.pg.st, cnt)
	}
	panic("bench: unknown contender " + c.name)
}

// dialPlain opens a connection and a channel with the given prefetch, and
// consumes queue with manual acks.
func dialPlain(url, queue string, prefetch int) (*amqp.Connection, <-chan *amqp.Error, <-chan amqp.Delivery, error) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return nil, nil, nil, err
	}
	closed := conn.NotifyClose(make(chan *amqp.Error, 1))
	ch, err := conn.Channel()
	if err == nil {
		err = ch.Qos(prefetch, 0, false)
	}
	var deliveries <-chan amqp.Delivery
	if err == nil {
		deliveries, err = ch.Consume(queue, "", false, false, false, false, nil)
	}
	if err != nil {
		conn.Close()
		return nil, nil, nil, err
	}
	return conn, closed, deliveries, nil
}

// waitPlain waits until cnt is done, ctx ends or the connection is lost,
// then closes the connection, which ends the workers, and waits for them.
func waitPlain(ctx context.Context, conn *amqp.Connection, closed <-chan *amqp.Error, cnt *counter, wg *sync.WaitGroup) error {
	var err error
	select {
	case <-cnt.done:
	case <-ctx.Done():
		err = ctx.Err()
	case e := <-closed:
		err = fmt.Errorf("connection lost: %v", e)
	}
	conn.Close()
	wg.Wait()
	return err
}

// consumePlain consumes queue with a plain amqp091 consumer: manual acks,
// the given prefetch, and workers goroutines ranging over the delivery
// channel. handle says how to settle each delivery: Ack and Duplicate ack
// it, anything else nacks it with requeue.
func consumePlain(ctx context.Context, url, queue string, prefetch, workers int, cnt *counter,
	handle func(context.Context, *amqp.Delivery) rabbitmw.Outcome) error {
	conn, closed, deliveries, err := dialPlain(url, queue, prefetch)
	if err != nil {
		return err
	}
	// The workers end when deliveries closes, with the connection.
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for d := range deliveries {
				if o := handle(ctx, &d); o == rabbitmw.Ack || o == rabbitmw.Duplicate {
					if d.Ack(false) == nil {
						cnt.ackedAt(d.MessageId)
						cnt.ack(1)
					}
				} else {
					d.Nack(false, true)
				}
			}
		})
	}
	return waitPlain(ctx, conn, closed, cnt, &wg)
}

// consumePlainMulti is the plain consumer that acks with multiple=true: one
// goroutine takes the deliveries in order, runs the effect, and acks every
// multiAckEvery deliveries at once, and the last ones when no more are
// waiting. With a handler that only counts, one goroutine keeps up with
// RabbitMQ, and the ack frames are as few as they can be.
func consumePlainMulti(ctx context.Context, url, queue string, prefetch int, cnt *counter) error {
	conn, closed, deliveries, err := dialPlain(url, queue, prefetch)
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		var held int
		var last *amqp.Delivery
		flush := func() {
			if held > 0 && last.Ack(true) == nil {
				cnt.ack(held)
			}
			held = 0
		}
		for {
			var d amqp.Delivery
			var ok bool
			select {
			case d, ok = <-deliveries:
			default:
				flush() // nothing waiting: ack what is held
				d, ok = <-deliveries
			}
			if !ok {
				return
			}
			cnt.effect(d.MessageId)
			cnt.ackedAt(d.MessageId)
			last = &d
			if held++; held == multiAckEvery {
				flush()
			}
		}
	})
	return waitPlain(ctx, conn, closed, cnt, &wg)
}

// handWritten returns the usual hand-written Redis pattern, ported as it
// is written (the legacyConsumer of package e2e's tests): SETNX
// msg:<id> processing, EXPIRE 300; a key already set means done (ack) or
// being processed (nack with requeue); then the handler, SET msg:<id> done,
// EXPIRE 24h, DEL retry:<id>, ack. Errors are ignored, as in the original.
// Its keys are under prefix.
func handWritten(rc *redis.Client, prefix string, cnt *counter) func(context.Context, *amqp.Delivery) rabbitmw.Outcome {
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
		cnt.effect(id)
		rc.Set(ctx, key, "done", 0)
		rc.Expire(ctx, key, handDoneTTL)
		rc.Del(ctx, prefix+"retry:"+id)
		return rabbitmw.Ack
	}
}

// consumeRabbitmw consumes queue with broker.Consume and the recommended
// stack over st, the business counting its effect.
func consumeRabbitmw(ctx context.Context, url, queue string, opts broker.ConsumeOptions, st store.Store, cnt *counter) error {
	business := rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		cnt.effect(d.MessageId)
		return nil
	})
	return consumeStack(ctx, url, queue, opts, benchstack.Recommended(st), business, cnt)
}

// consumeStack consumes queue with broker.Consume and stack around
// business. The acks are counted by the broker's Observer, once per ack
// frame; OnSettle is set only under -latency.
func consumeStack(ctx context.Context, url, queue string, opts broker.ConsumeOptions, stack rabbitmw.Middleware, business rabbitmw.Handler, cnt *counter) error {
	b := broker.New(url, broker.Options{Observer: broker.Observer{Ack: func(e broker.AckEvent) {
		if e.Err == nil {
			cnt.ack(e.Deliveries)
		}
	}}})
	defer b.Close()
	opts.Topology = topology
	if cnt.ackAt != nil {
		opts.OnSettle = func(d *amqp.Delivery, o rabbitmw.Outcome, err error) {
			if err == nil && (o == rabbitmw.Ack || o == rabbitmw.Duplicate) {
				cnt.ackedAt(d.MessageId)
			}
		}
	}
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-cnt.done:
			cancel()
		case <-cctx.Done():
		}
	}()
	if err := b.Consume(cctx, queue, stack(business), opts); err != nil {
		return err
	}
	select {
	case <-cnt.done:
		return nil
	default:
		if err := ctx.Err(); err != nil {
			return err
		}
		return errors.New("the consumer stopped before every message was settled")
	}
}
