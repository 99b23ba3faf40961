package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/broker/deadletter"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// The demo's timings: short, so the whole run takes seconds. In production
// the defaults apply (a 5-minute lease, retries over about a minute).
const (
	lease    = 600 * time.Millisecond
	slowFor  = 3 * lease / 2 // the slow handler outlives its lease, which is renewed
	attempts = 5
)

var (
	delayTiers = []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, time.Second}
	backoff    = middleware.Exponential(50*time.Millisecond, 400*time.Millisecond)
)

// run publishes the scenarios, consumes them to the end with two
// consumers, and returns what happened.
func run(ctx context.Context, cfg config) (*report, error) {
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	runID := randomHex(4)
	queue := "rabbitmw-example-" + runID

	tel, err := openTelemetry(cfg, queue)
	if err != nil {
		return nil, err
	}
	var observer broker.Observer
	if tel != nil {
		defer tel.close(context.WithoutCancel(ctx))
		observer = tel.tel.Broker()
	}
	b, closeBroker, err := openBroker(cfg, observer)
	if err != nil {
		return nil, err
	}
	defer closeBroker()
	var (
		st         store.Store
		inbox      *inbox // with -postgres: the PostgreSQL inbox
		closeStore func()
	)
	if cfg.inbox {
		inbox, err = openInbox(ctx, cfg.postgresURL, "rabbitmw_example_"+runID)
		if err != nil {
			return nil, err
		}
		st, closeStore = inbox.st, inbox.close
	} else if st, closeStore, err = openStore(cfg, "rabbitmw-example:"+runID+":"); err != nil {
		return nil, err
	}
	defer closeStore()

	topo := broker.Topology{Delays: delayTiers}
	if err := b.Declare(ctx, queue, topo); err != nil {
		return nil, fmt.Errorf("declaring %s: %w", queue, err)
	}
	defer b.Delete(context.WithoutCancel(ctx), queue, topo)

	rep := newReport(cfg, queue)
	st = &countingStore{Store: st, renewals: rep.renewed}

	// Two consumers on one queue, each with the recommended stack, in
	// front of the business handler. The two outer layers are the demo's
	// own: one records what each delivery came to, the other drops the
	// acknowledgement of one message once, as a crash after its effect
	// would. The stack is written out rather than built by
	// middleware.Stack: its slow handler outlives its lease on purpose, to
	// show the renewals, where Stack keeps the Timeout below the lease.
	biz := &business{effect: rep.effect}
	var handler rabbitmw.Handler = biz
	if inbox != nil {
		handler = inbox.handler(biz)
	}
	lose := &loseAckOnce{key: lostAckKey}
	var consumers sync.WaitGroup
	consumeCtx, stopConsumers := context.WithCancel(ctx)
	defer stopConsumers()
	errs := make(chan error, 2)
	var first []rabbitmw.Middleware // the telemetry layer, if any
	var observe func(context.Context, middleware.DedupEvent)
	if tel != nil {
		first, observe = []rabbitmw.Middleware{tel.tel.Middleware()}, tel.tel.Dedup()
	}
	for _, name := range []string{"A", "B"} {
		h := rabbitmw.Chain(append(first,
			rep.observe(name),
			lose.layer(),
			middleware.Log(cfg.logger.With("consumer", name)),
			middleware.Retry(st, middleware.RetryOptions{MaxAttempts: attempts, Backoff: backoff}),
			middleware.Recover(),
			middleware.Dedup(st, middleware.DedupOptions{Lease: lease, BusyDelay: 100 * time.Millisecond, UnavailableDelay: 200 * time.Millisecond, Observe: observe}),
			middleware.Timeout(10*time.Second),
		)...)(handler)
		consumers.Add(1)
		go func() {
			defer consumers.Done()
			errs <- b.Consume(consumeCtx, queue, h, broker.ConsumeOptions{
				Workers: 4, Topology: topo, ShutdownTimeout: 5 * time.Second,
				ConsumerTag: "rabbitmw-example-" + name,
			})
		}()
	}

	if err := publishAll(ctx, b, queue, rep); err != nil {
		stopConsumers()
		consumers.Wait()
		return nil, err
	}
	waitErr := rep.waitSettled(ctx, b, queue, errs)
	if waitErr == nil {
		// The operator reads the dead-letter queue, fixes the cause of
		// fail-1's failures, and replays it, with its failure count reset.
		waitErr = rep.replayFixed(ctx, b, queue, st, biz)
	}
	stopConsumers()
	consumers.Wait()
	close(errs)
	for err := range errs {
		if err != nil && waitErr == nil {
			waitErr = fmt.Errorf("consumer: %w", err)
		}
	}
	if waitErr != nil {
		return nil, waitErr
	}
	if tel != nil {
		rep.spans = tel.spans
		if tel.server != nil && cfg.serving != nil {
			cfg.serving(tel.addr)
		}
	}
	return rep, nil
}

// replayFixed reads the dead-letter queue into the report, fixes the
// business handler, and replays fail-1, resetting its failure count; it
// returns once the replayed message's effect happened.
func (r *report) replayFixed(ctx context.Context, b *broker.Broker, queue string, st store.Store, biz *business) error {
	dead, err := deadletter.New(b).List(ctx, queue, deadletter.ListOptions{})
	if err != nil {
		return fmt.Errorf("listing the dead-letter queue: %w", err)
	}
	r.mu.Lock()
	for _, dl := range dead {
		r.dead = append(r.dead, *dl.Delivery)
	}
	r.mu.Unlock()
	biz.fixed.Store(true)
	res, err := deadletter.New(b).Replay(ctx, queue, deadletter.ReplayOptions{
		Filter: deadletter.Filter{IDs: []string{"fail-1"}},
		ResetFailures: func(ctx context.Context, d *amqp.Delivery) error {
			key, err := middleware.Key(d)
			if err != nil {
				return err
			}
			return st.ResetFailures(ctx, key)
		},
	})
	if err != nil {
		return fmt.Errorf("replaying fail-1: %w", err)
	}
	r.mu.Lock()
	r.replayed = res.Replayed
	r.mu.Unlock()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		r.mu.Lock()
		done := r.stats("fail-1").effects > 0
		r.mu.Unlock()
		if done {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("the replayed fail-1 was not handled in time: %w", ctx.Err())
		case <-tick.C:
		}
	}
}

// publishAll publishes every scenario's copies.
func publishAll(ctx context.Context, b *broker.Broker, queue string, rep *report) error {
	for _, s := range scenarios {
		msg := amqp.Publishing{MessageId: s.id, Type: s.kind, ContentType: "application/json", Body: []byte(s.body)}
		var wg sync.WaitGroup
		errs := make(chan error, s.copies)
		for range s.copies {
			publish := func() {
				if err := b.Publish(ctx, "", queue, msg); err != nil {
					errs <- fmt.Errorf("publishing %s: %w", s.name(), err)
				}
			}
			if s.atOnce {
				wg.Add(1)
				go func() { defer wg.Done(); publish() }()
			} else {
				publish()
			}
		}
		wg.Wait()
		close(errs)
		if err := <-errs; err != nil {
			return err
		}
		rep.published(s.copies)
	}
	return nil
}

// openBroker returns the in-memory broker, or one for cfg.amqpURL.
func openBroker(cfg config, observer broker.Observer) (*broker.Broker, func(), error) {
	opts := broker.Options{Logger: cfg.logger, KeepEmptyMessageID: true, Observer: observer}
	if cfg.amqpURL == "" {
		m := brokertest.NewServer()
		b := broker.New(m.URL(), opts)
		return b, func() { b.Close(); m.Close() }, nil
	}
	b := broker.New(cfg.amqpURL, opts)
	return b, func() { b.Close() }, nil
}

// openStore returns a Redis store on an embedded miniredis, or on
// cfg.redisAddr, with every key under prefix.
func openStore(cfg config, prefix string) (store.Store, func(), error) {
	addr := cfg.redisAddr
	var mini *miniredis.Miniredis
	if addr == "" {
		mini = miniredis.NewMiniRedis()
		if err := mini.Start(); err != nil {
			return nil, nil, fmt.Errorf("starting miniredis: %w", err)
		}
		mini.ClockTTL(true) // expire keys in real time, as Redis does
		addr = mini.Addr()
	}
	client := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
	closeAll := func() {
		if mini == nil { // a real Redis: remove this run's keys
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			iter := client.Scan(ctx, 0, prefix+"*", 100).Iterator()
			for iter.Next(ctx) {
				client.Del(ctx, iter.Val())
			}
		}
		client.Close()
		if mini != nil {
			mini.Close()
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st := redisstore.New(client, redisstore.Options{Prefix: prefix})
	if err := st.Load(ctx); err != nil { // caches the scripts; fails fast if Redis is down
		closeAll()
		return nil, nil, fmt.Errorf("connecting to Redis at %s: %w", addr, err)
	}
	return st, closeAll, nil
}

// countingStore counts lease renewals per key, for the report.
type countingStore struct {
	store.Store
	renewals func(key string)
}

func (c *countingStore) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	err := c.Store.Extend(ctx, key, token, lease)
	if err == nil {
		c.renewals(key)
	}
	return err
}

// business is the handler the stack protects: it applies a message's
// effect (in a real service, a charge or a shipment) by recording it.
type business struct {
	effect func(key string)
	fixed  atomic.Bool // the cause of kindFail's failures is fixed

	mu       sync.Mutex
	panicked map[string]bool
}

var errDeclined = errors.New("card declined by the issuer")

func (b *business) Handle(ctx context.Context, d *amqp.Delivery) error {
	key, err := middleware.Key(d)
	if err != nil {
		return rabbitmw.Permanent(err)
	}
	if err := b.decide(ctx, key, d); err != nil {
		return err
	}
	b.effect(key)
	return nil
}

// decide is everything the business does before its effect: it fails,
// panics or takes its time as the message's scenario says.
func (b *business) decide(ctx context.Context, key string, d *amqp.Delivery) error {
	switch d.Type {
	case kindFail:
		if !b.fixed.Load() {
			return errDeclined
		}
	case kindPanicOnce:
		b.mu.Lock()
		first := !b.panicked[key]
		if b.panicked == nil {
			b.panicked = map[string]bool{}
		}
		b.panicked[key] = true
		b.mu.Unlock()
		if first {
			panic("nil pointer in the invoice template")
		}
	case kindSlow:
		select {
		case <-time.After(slowFor):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// loseAckOnce drops the acknowledgement of the first successful delivery
// of one message: it turns the success into a plain error after the
// effect happened and the message was marked done, so the broker requeues
// it, exactly as RabbitMQ redelivers a message whose consumer crashed
// before its ack arrived.
type loseAckOnce struct {
	key  string
	once sync.Once
}

var errAckLost = errors.New("demo: the acknowledgement was lost (as in a crash after the effect)")

func (l *loseAckOnce) layer() rabbitmw.Middleware {
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			err := next.Handle(ctx, d)
			if key, _ := middleware.Key(d); key == l.key && err == nil {
				lost := false
				l.once.Do(func() { lost = true })
				if lost {
					return errAckLost
				}
			}
			return err
		})
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// redactURL hides the password of an AMQP URL.
func redactURL(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}
