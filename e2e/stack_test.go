package e2e_test

// The whole recommended stack, end to end, over miniredis: what a user of
// a plain amqp091 channel gets from Chain and Settle.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// fixture is the recommended stack over one miniredis, in front of a
// business handler that records its effects by message id.
type fixture struct {
	m       *miniredis.Miniredis
	client  *redis.Client
	trips   *redistest.RoundTrips
	store   *redisstore.Store
	log     *bytes.Buffer
	logMu   sync.Mutex
	effects sync.Map // message id -> *atomic.Int64
	stack   rabbitmw.Middleware
}

func newFixture(t *testing.T, dedup middleware.DedupOptions) *fixture {
	t.Helper()
	m, c, rt := redistest.Start(t)
	f := &fixture{m: m, client: c, trips: rt, store: redisstore.New(c, redisstore.Options{}), log: new(bytes.Buffer)}
	logger := slog.New(slog.NewJSONHandler(lockedWriter{&f.logMu, f.log}, nil))
	if dedup.BusyDelay == 0 {
		dedup.BusyDelay = 10 * time.Millisecond
	}
	f.stack = rabbitmw.Chain(
		middleware.Log(logger),
		middleware.Retry(f.store, middleware.RetryOptions{Backoff: func(int) time.Duration { return time.Millisecond }}),
		middleware.Recover(),
		middleware.Dedup(f.store, dedup),
		middleware.Timeout(5*time.Second),
	)
	return f
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

// effect records one business effect of message id.
func (f *fixture) effect(id string) {
	v, _ := f.effects.LoadOrStore(id, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

func (f *fixture) effectsOf(id string) int64 {
	v, ok := f.effects.Load(id)
	if !ok {
		return 0
	}
	return v.(*atomic.Int64).Load()
}

// recording is a business handler that records an effect per success.
func (f *fixture) recording() rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		f.effect(d.MessageId)
		return nil
	})
}

// untilSettled redelivers msg, as RabbitMQ would after a requeue, until it
// leaves the queue (acked or dead-lettered), and returns every result.
func untilSettled(t *testing.T, h rabbitmw.Handler, msg amqp.Publishing) []deliverytest.Result {
	t.Helper()
	var all []deliverytest.Result
	for i := 0; i < 50; i++ {
		r := deliverytest.Run(t, h, msg, i > 0)
		all = append(all, r)
		if r.Settled != "requeued" {
			return all
		}
	}
	t.Fatalf("message %q still requeued after 50 deliveries: %v", msg.MessageId, all)
	return nil
}

func TestStackDuplicatesAckedWithOneEffect(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	h := f.stack(f.recording())
	for i := range 5 {
		r := deliverytest.Run(t, h, amqp.Publishing{MessageId: "order-1", Body: []byte("x")}, i%2 == 1)
		want := rabbitmw.Duplicate
		if i == 0 {
			want = rabbitmw.Ack
		}
		if r.Settled != "acked" || r.Decision.Outcome != want {
			t.Errorf("delivery %d: settled %s as %v; want acked as %v", i, r.Settled, r.Decision.Outcome, want)
		}
	}
	if n := f.effectsOf("order-1"); n != 1 {
		t.Fatalf("effects of order-1 = %d; want 1", n)
	}
}

func TestStackFailingMessageRetriedThenDeadLettered(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	var attempts atomic.Int64
	h := f.stack(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		attempts.Add(1)
		return errors.New("payment gateway said no")
	}))
	results := untilSettled(t, h, amqp.Publishing{MessageId: "fail-1", Body: []byte("x")})
	if n := attempts.Load(); n != 5 {
		t.Errorf("handler attempts = %d; want 5", n)
	}
	for i, r := range results[:len(results)-1] {
		if r.Decision.Outcome != rabbitmw.Delay || r.Decision.Attempts != i+1 {
			t.Errorf("attempt %d: %v, attempts %d; want delayed, attempts %d", i+1, r.Decision.Outcome, r.Decision.Attempts, i+1)
		}
	}
	last := results[len(results)-1]
	if last.Settled != "dead-lettered" || last.Decision.Outcome != rabbitmw.DeadLetter || last.Decision.Attempts != 5 {
		t.Errorf("last delivery: settled %s as %v, attempts %d; want dead-lettered, attempts 5", last.Settled, last.Decision.Outcome, last.Decision.Attempts)
	}
	if !errors.Is(last.Decision.Err, middleware.ErrRetriesExhausted) || !strings.Contains(last.Decision.Err.Error(), "payment gateway said no") {
		t.Errorf("dead-letter reason %q; want the last error, after ErrRetriesExhausted", last.Decision.Err)
	}
	for _, key := range []string{"msg:fail-1", "retry:fail-1"} {
		if f.m.Exists(key) {
			t.Errorf("%s left behind after the dead-letter", key)
		}
	}
}

func TestStackPanicCountsAsFailedAttempt(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	var calls atomic.Int64
	h := f.stack(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if calls.Add(1) == 1 {
			panic("nil map in the payment code")
		}
		f.effect(d.MessageId)
		return nil
	}))
	results := untilSettled(t, h, amqp.Publishing{MessageId: "panic-1", Body: []byte("x")})
	if len(results) != 2 {
		t.Fatalf("deliveries = %d; want 2 (a panic, then a success)", len(results))
	}
	var pe *rabbitmw.PanicError
	if r := results[0]; r.Decision.Outcome != rabbitmw.Delay || r.Decision.Attempts != 1 || !errors.As(r.Decision.Err, &pe) {
		t.Errorf("first delivery: %v, attempts %d, err %v; want delayed, attempts 1, a PanicError", r.Decision.Outcome, r.Decision.Attempts, r.Decision.Err)
	}
	if r := results[1]; r.Settled != "acked" {
		t.Errorf("second delivery settled %s; want acked", r.Settled)
	}
	if n := f.effectsOf("panic-1"); n != 1 {
		t.Errorf("effects = %d; want 1", n)
	}
	if !strings.Contains(f.log.String(), `"outcome":"delayed"`) || !strings.Contains(f.log.String(), "nil map in the payment code") {
		t.Errorf("log does not show the panic as a delayed failure:\n%s", f.log)
	}
}

// A panic in every attempt ends in the dead-letter queue: never a crash,
// never an endless requeue.
func TestStackAlwaysPanickingIsDeadLettered(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	h := f.stack(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { panic("always") }))
	results := untilSettled(t, h, amqp.Publishing{MessageId: "panic-2", Body: []byte("x")})
	if last := results[len(results)-1]; last.Settled != "dead-lettered" || len(results) != 5 {
		t.Fatalf("after %d deliveries settled %s; want dead-lettered after 5", len(results), last.Settled)
	}
}

func TestStackConcurrentDeliveriesOfOneID(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	const n = 100
	// The delivery that claims the message holds the claim until the first
	// deliveries of the n-1 others have all been turned away as busy; those
	// wait until the claiming delivery has ended (its done mark written)
	// before their redeliveries.
	var (
		arrived    atomic.Int64
		allArrived = make(chan struct{})
		claimed    = make(chan struct{})
		claimOnce  sync.Once
	)
	stack := f.stack(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		select {
		case <-allArrived:
		case <-ctx.Done(): // the stack's Timeout: the others never came
			return ctx.Err()
		}
		f.effect(d.MessageId)
		return nil
	}))
	h := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		err := stack.Handle(ctx, d)
		switch {
		case d.Redelivered:
		case errors.Is(err, middleware.ErrBusy):
			if arrived.Add(1) == n-1 {
				close(allArrived)
			}
			<-claimed
		default: // the claiming delivery (one, unless Dedup is broken)
			claimOnce.Do(func() { close(claimed) })
		}
		return err
	})
	var (
		wg       sync.WaitGroup
		start    = make(chan struct{})
		outcomes sync.Map // outcome -> *atomic.Int64
	)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for _, r := range untilSettled(t, h, amqp.Publishing{MessageId: "same", Body: []byte("x")}) {
				v, _ := outcomes.LoadOrStore(r.Decision.Outcome, new(atomic.Int64))
				v.(*atomic.Int64).Add(1)
			}
		}()
	}
	close(start)
	wg.Wait()
	if got := f.effectsOf("same"); got != 1 {
		t.Fatalf("%d concurrent deliveries of one id applied the effect %d times; want 1", n, got)
	}
	count := func(o rabbitmw.Outcome) int64 {
		v, ok := outcomes.Load(o)
		if !ok {
			return 0
		}
		return v.(*atomic.Int64).Load()
	}
	if acks, dups := count(rabbitmw.Ack), count(rabbitmw.Duplicate); acks != 1 || dups != n-1 {
		t.Errorf("outcomes: %d acked, %d duplicates; want 1 and %d", acks, dups, n-1)
	}
}

// A handler that outlives its lease while the store cannot renew it (here,
// the claim vanishes, as when it expired) is cancelled; it records nothing,
// and another consumer then processes the message exactly once.
func TestStackLeaseExpiresMidHandler(t *testing.T) {
	// The lease runs on the wall clock, miniredis being a server: its
	// renewals, every lease/3, must be answered within lease/3 on a loaded
	// machine, or the handler is cancelled for an unavailable store rather
	// than for its lost claim (as happened with a 150 ms lease).
	const lease = 1500 * time.Millisecond
	f := newFixture(t, middleware.DedupOptions{Lease: lease})
	started := make(chan struct{})
	var cancelled atomic.Bool
	slow := f.stack(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		close(started)
		select {
		case <-ctx.Done(): // the well-behaved handler stops before its effect
			cancelled.Store(true)
			return ctx.Err()
		case <-time.After(5 * time.Second): // never cancelled: a real-time bound, as the store is a server
			f.effect(d.MessageId)
			return nil
		}
	}))
	first := make(chan deliverytest.Result, 1)
	go func() {
		first <- deliverytest.Run(t, slow, amqp.Publishing{MessageId: "slow-1", Body: []byte("x")}, false)
	}()
	<-started
	f.m.FastForward(2 * lease) // the lease runs out while the handler runs
	r := <-first
	if !cancelled.Load() {
		t.Fatal("the handler's context was not cancelled when its lease expired")
	}
	if r.Decision.Outcome != rabbitmw.Delay || !errors.Is(r.Decision.Err, middleware.ErrLeaseLost) {
		t.Errorf("first delivery: %v (%v); want delayed with ErrLeaseLost", r.Decision.Outcome, r.Decision.Err)
	}
	if f.m.Exists("retry:slow-1") {
		t.Error("a lost lease was counted as a failed attempt")
	}
	// The redelivery goes to a well-behaved consumer.
	results := untilSettled(t, f.stack(f.recording()), amqp.Publishing{MessageId: "slow-1", Body: []byte("x")})
	if last := results[len(results)-1]; last.Settled != "acked" || f.effectsOf("slow-1") != 1 {
		t.Errorf("redelivery settled %s with %d effects; want acked with 1", last.Settled, f.effectsOf("slow-1"))
	}
}

// The happy path costs two store round trips (claim, complete), and a
// duplicate one (claim), for the whole stack.
func TestStackRoundTrips(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	h := f.stack(f.recording())
	deliverytest.Run(t, h, amqp.Publishing{MessageId: "warm-up"}, false) // loads the scripts
	for _, tc := range []struct {
		name        string
		redelivered bool
		want        int64
	}{
		{"first delivery", false, 2},
		{"duplicate", false, 1},
		{"redelivered duplicate", true, 1},
	} {
		before := f.trips.Count()
		deliverytest.Run(t, h, amqp.Publishing{MessageId: "order-7", Body: []byte("x")}, tc.redelivered)
		if got := f.trips.Count() - before; got != tc.want {
			t.Errorf("%s: %d round trips; want %d", tc.name, got, tc.want)
		}
	}
}

// Bad input gets a clear error and a defined settlement; nothing panics
// out of the stack and nothing is silently dropped.
func TestStackBadInput(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	h := f.stack(f.recording())
	huge := bytes.Repeat([]byte("x"), 16<<20)
	tests := []struct {
		name        string
		msg         amqp.Publishing
		wantSettled string
		wantErr     string
	}{
		{"no message id and an empty body: dead-lettered with the reason", amqp.Publishing{}, "dead-lettered", "no message id and an empty body"},
		{"no message id: keyed by the body", amqp.Publishing{Body: []byte("a body")}, "acked", ""},
		{"a 16 MiB body", amqp.Publishing{Body: huge}, "acked", ""},
		{"headers of every type", amqp.Publishing{MessageId: "h-1", Headers: amqp.Table{
			rabbitmw.HeaderAttempts: "not a number",
			"x-death":               []any{amqp.Table{"count": int64(1), "reason": "expired"}},
			"x-delivery-count":      int64(3),
			"nested":                amqp.Table{"deep": amqp.Table{"er": []any{1.5, []byte("b"), nil, true}}},
			"when":                  time.Unix(0, 0),
			"decimal":               amqp.Decimal{Scale: 2, Value: 314},
		}, Body: []byte("x")}, "acked", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := deliverytest.Run(t, h, tt.msg, false)
			if r.Settled != tt.wantSettled {
				t.Errorf("settled %s (%v); want %s", r.Settled, r.Decision.Err, tt.wantSettled)
			}
			if tt.wantErr != "" && (r.Decision.Err == nil || !strings.Contains(r.Decision.Err.Error(), tt.wantErr)) {
				t.Errorf("error %v; want it to say %q", r.Decision.Err, tt.wantErr)
			}
		})
	}
	t.Run("nil context and nil delivery", func(t *testing.T) {
		var ctx context.Context
		rec := rabbitmwtest.NewRecorder()
		d := rec.Deliver(amqp.Publishing{MessageId: "nil-ctx", Body: []byte("x")})
		assert.NoError(t, h.Handle(ctx, d), "Handle with a nil context")
		assert.ErrorIs(t, h.Handle(context.Background(), nil), rabbitmw.ErrNoDelivery, "Handle of a nil delivery")
	})
}

// With the store down, the stack fails closed: nothing is processed, the
// message is delayed and not counted as failing, and it goes through once
// the store is back.
func TestStackStoreOutage(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{UnavailableDelay: time.Millisecond})
	h := f.stack(f.recording())
	f.m.SetError("LOADING Redis is loading the dataset in memory")
	for range 10 { // more than MaxAttempts: an outage must never dead-letter
		r := deliverytest.Run(t, h, amqp.Publishing{MessageId: "o-1", Body: []byte("x")}, true)
		if r.Decision.Outcome != rabbitmw.Delay || !errors.Is(r.Decision.Err, middleware.ErrStoreUnavailable) {
			t.Fatalf("during the outage: %v (%v); want delayed with ErrStoreUnavailable", r.Decision.Outcome, r.Decision.Err)
		}
	}
	if n := f.effectsOf("o-1"); n != 0 {
		t.Fatalf("effects during the outage = %d; want 0 (fail closed)", n)
	}
	f.m.SetError("")
	if r := deliverytest.Run(t, h, amqp.Publishing{MessageId: "o-1", Body: []byte("x")}, true); r.Settled != "acked" || f.effectsOf("o-1") != 1 {
		t.Fatalf("after the outage: settled %s with %d effects; want acked with 1", r.Settled, f.effectsOf("o-1"))
	}
}

// legacyConsumer is the hand-written pattern that teams run today, ported
// as is (its flaws included), to check that our consumers can share a queue
// and a Redis with a fleet of them during a migration. It returns how the
// delivery is to be settled: "acked", "requeued", or "dropped" (acked at the
// fifth failure, logged as "moved to dead letter": the message is gone).
func legacyConsumer(ctx context.Context, c *redis.Client, d *amqp.Delivery, effect func(string) error) string {
	id := d.MessageId
	if ok, _ := c.SetNX(ctx, "msg:"+id, "processing", 0).Result(); !ok {
		if v, _ := c.Get(ctx, "msg:"+id).Result(); v == "done" {
			return "acked"
		}
		return "requeued"
	}
	c.Expire(ctx, "msg:"+id, 300*time.Second)
	if err := effect(id); err != nil {
		c.Del(ctx, "msg:"+id)
		n, _ := c.Incr(ctx, "retry:"+id).Result()
		c.Expire(ctx, "retry:"+id, 24*time.Hour)
		if n >= 5 {
			return "dropped"
		}
		return "requeued"
	}
	c.Set(ctx, "msg:"+id, "done", 0)
	c.Expire(ctx, "msg:"+id, 24*time.Hour)
	c.Del(ctx, "retry:"+id)
	return "acked"
}

func TestStackJoinsHandWrittenFleet(t *testing.T) {
	f := newFixture(t, middleware.DedupOptions{})
	ours := f.stack(f.recording())
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const ids, copies = 50, 4
	// A copy is requeued while another holds the message; it is delivered
	// again once a copy of the message has been acked.
	acked := make([]chan struct{}, ids)
	ack := make([]sync.Once, ids)
	for i := range acked {
		acked[i] = make(chan struct{})
	}
	var wg sync.WaitGroup
	for i := range ids {
		for c := range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				msg := amqp.Publishing{MessageId: fmt.Sprint("mixed-", i), Body: []byte("x")}
				for attempt := 0; attempt < 100; attempt++ {
					var settled string
					if (i+c+attempt)%2 == 0 {
						settled = deliverytest.Run(t, ours, msg, attempt > 0).Settled
					} else {
						settled = legacyConsumer(ctx, f.client, &amqp.Delivery{MessageId: msg.MessageId}, func(id string) error {
							f.effect(id)
							return nil
						})
					}
					if settled != "requeued" {
						ack[i].Do(func() { close(acked[i]) })
						return
					}
					select {
					case <-acked[i]:
					case <-ctx.Done():
						t.Errorf("message %s requeued, and no copy of it acked: %v", msg.MessageId, ctx.Err())
						return
					}
				}
				t.Errorf("message %s never settled", msg.MessageId)
			}()
		}
	}
	wg.Wait()
	for i := range ids {
		if n := f.effectsOf(fmt.Sprint("mixed-", i)); n != 1 {
			t.Errorf("mixed-%d applied %d times by the mixed fleet; want 1", i, n)
		}
	}
}

// A fleet of both kinds shares the failure count, retry:<id>: a message
// that failed four times in one kind reaches the limit at its fifth failure
// in the other. Ours dead-letters it; a hand-written consumer acks it
// ("moved to dead letter"), and the message is gone.
func TestStackSharesFailureCountWithHandWrittenFleet(t *testing.T) {
	ctx := context.Background()
	down := errors.New("down")
	failing := func(string) error { return down }
	msg := amqp.Publishing{MessageId: "shared-1", Body: []byte("x")}
	t.Run("hand-written failures first", func(t *testing.T) {
		f := newFixture(t, middleware.DedupOptions{})
		ours := f.stack(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return down }))
		for i := range 4 {
			if got := legacyConsumer(ctx, f.client, &amqp.Delivery{MessageId: msg.MessageId}, failing); got != "requeued" {
				t.Fatalf("hand-written failure %d: %s; want requeued", i+1, got)
			}
		}
		if r := deliverytest.Run(t, ours, msg, true); r.Decision.Outcome != rabbitmw.DeadLetter || !errors.Is(r.Decision.Err, middleware.ErrRetriesExhausted) {
			t.Errorf("our fifth failure: %v (%v); want dead-lettered with ErrRetriesExhausted", r.Decision.Outcome, r.Decision.Err)
		}
	})
	t.Run("rabbitmw failures first", func(t *testing.T) {
		f := newFixture(t, middleware.DedupOptions{})
		ours := f.stack(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return down }))
		for i := range 4 {
			if r := deliverytest.Run(t, ours, msg, i > 0); r.Decision.Outcome != rabbitmw.Delay {
				t.Fatalf("our failure %d: %v; want delayed", i+1, r.Decision.Outcome)
			}
		}
		if got := legacyConsumer(ctx, f.client, &amqp.Delivery{MessageId: msg.MessageId}, failing); got != "dropped" {
			t.Errorf("hand-written fifth failure: %s; want dropped", got)
		}
	})
	// With a FailurePrefix of our own, our failures stay out of their count.
	t.Run("rabbitmw failures first, counted apart", func(t *testing.T) {
		f := newFixture(t, middleware.DedupOptions{})
		st := redisstore.New(f.client, redisstore.Options{FailurePrefix: "rabbitmw-retry:"})
		ours := rabbitmw.Chain(
			middleware.Retry(st, middleware.RetryOptions{Backoff: func(int) time.Duration { return time.Millisecond }}),
			middleware.Dedup(st, middleware.DedupOptions{}),
		)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return down }))
		for i := range 4 {
			if r := deliverytest.Run(t, ours, msg, i > 0); r.Decision.Outcome != rabbitmw.Delay {
				t.Fatalf("our failure %d: %v; want delayed", i+1, r.Decision.Outcome)
			}
		}
		if got := legacyConsumer(ctx, f.client, &amqp.Delivery{MessageId: msg.MessageId}, failing); got != "requeued" {
			t.Errorf("hand-written first failure after four of ours: %s; want requeued", got)
		}
	})
}
