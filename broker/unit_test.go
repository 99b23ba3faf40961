package broker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
)

func TestTierName(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{time.Second, "1s"}, {5 * time.Second, "5s"}, {30 * time.Second, "30s"},
		{2 * time.Minute, "2m"}, {10 * time.Minute, "10m"}, {time.Hour, "1h"},
		{1500 * time.Millisecond, "1500ms"}, {90 * time.Second, "90s"},
		{3600 * time.Second, "1h"}, {50 * time.Millisecond, "50ms"}, {25 * time.Hour, "25h"},
	} {
		if got := tierName(c.d); got != c.want {
			t.Errorf("tierName(%v) = %q; want %q", c.d, got, c.want)
		}
	}
}

func TestTopologyResolve(t *testing.T) {
	top, err := Topology{}.resolve("orders")
	noErr(t, "resolve(defaults)", err)
	var names []string
	for _, s := range top.specs() {
		names = append(names, s.Name)
	}
	equal(t, "declared queues", names, []string{"orders", "orders.dlq",
		"orders.delay.1s", "orders.delay.5s", "orders.delay.30s", "orders.delay.2m", "orders.delay.10m", "orders.delay.1h"})
	specs := top.specs()
	equal(t, "work queue arguments", specs[0].Args, amqp.Table{"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders.dlq"})
	equal(t, "dead-letter queue arguments", specs[1].Args, amqp.Table(nil))
	equal(t, "delay queue 5s arguments", specs[3].Args, amqp.Table{"x-message-ttl": int64(5000), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": "orders"})

	top, err = Topology{Declare: DeclareSupport, Delays: []time.Duration{time.Minute, time.Second, time.Second}}.resolve("q")
	noErr(t, "resolve(quorum, support)", err)
	specs = top.specs()
	equal(t, "work queue spec with DeclareSupport", specs[0], queueSpec{Name: "q", Passive: true})
	equal(t, "specs with a deduplicated ladder", len(specs), 4)
	equal(t, "tiers sorted", []string{specs[2].Name, specs[3].Name}, []string{"q.delay.1s", "q.delay.1m"})
	top, _ = Topology{Quorum: true, DeliveryLimit: 5}.resolve("q")
	equal(t, "quorum work queue arguments", top.specs()[0].Args, amqp.Table{
		"x-dead-letter-exchange": "", "x-dead-letter-routing-key": "q.dlq", "x-queue-type": "quorum", "x-delivery-limit": int64(5)})
	top, _ = Topology{Declare: DeclareNone}.resolve("q")
	equal(t, "specs with DeclareNone", len(top.specs()), 0)
	equal(t, "names with DeclareNone", len(top.names()), 8)

	for _, bad := range []Topology{
		{Delays: []time.Duration{0}},
		{Delays: []time.Duration{-time.Second}},
		{Delays: []time.Duration{1500 * time.Microsecond}},
		{Delays: []time.Duration{50 * 24 * time.Hour}},
		{DeliveryLimit: 3},
		{Quorum: true, DeliveryLimit: -1},
		{Declare: DeclareMode(7)},
		{Quorum: true, Declare: DeclareSupport},
		{Quorum: true, DeliveryLimit: 3, Declare: DeclareSupport},
		{Quorum: true, Declare: DeclareNone},
	} {
		if _, err := bad.resolve("q"); err == nil {
			t.Errorf("resolve(%+v) = nil error; want one", bad)
		}
	}
	if _, err := (Topology{}).resolve(""); err == nil {
		t.Error("resolve of an empty queue name = nil error; want one")
	}
}

func TestTierFor(t *testing.T) {
	top, _ := Topology{Delays: []time.Duration{time.Second, 5 * time.Second, time.Minute}}.resolve("q")
	for _, c := range []struct {
		d    time.Duration
		want string
		over bool
	}{
		{time.Millisecond, "q.delay.1s", false},
		{time.Second, "q.delay.1s", false},
		{time.Second + 1, "q.delay.5s", false},
		{6 * time.Second, "q.delay.1m", false},
		{time.Minute, "q.delay.1m", false},
		{time.Hour, "q.delay.1m", true},
	} {
		tr, over := top.tierFor(c.d)
		if tr.queue != c.want || over != c.over {
			t.Errorf("tierFor(%v) = %q, %t; want %q, %t", c.d, tr.queue, over, c.want, c.over)
		}
	}
}

func TestRefusalText(t *testing.T) {
	top, _ := Topology{}.resolve("q")
	e406 := &amqp.Error{Code: amqp.PreconditionFailed, Reason: "PRECONDITION_FAILED - inequivalent arg", Server: true, Recover: true}
	err := top.refusal(&queueError{Queue: "q", Err: e406})
	isErr(t, "refusal(406 on q)", err, ErrQueueArguments)
	contains(t, "refusal(406 on q)", err.Error(), "DeclareSupport")
	err = top.refusal(&queueError{Queue: "q.dlq", Err: e406})
	isErr(t, "refusal(406 on q.dlq)", err, ErrQueueArguments)
	contains(t, "refusal(406 on q.dlq)", err.Error(), `"q.dlq"`)
	lost := lostError(&amqp.Error{Code: amqp.ConnectionForced, Server: true})
	if got := top.refusal(lost); got != lost {
		t.Errorf("refusal(lost) = %v; want it unchanged", got)
	}
}

func TestFaultHeaders(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 678, time.FixedZone("X", 3600))
	orig := amqp.Table{"x-death": []any{amqp.Table{"count": int64(2)}}, "keep": []byte("b")}
	d := &amqp.Delivery{Exchange: "ex", RoutingKey: "rk", Headers: orig}
	snapshot := maps.Clone(orig)

	h := faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(fmt.Errorf("wrap: %w", errBoom))), "q", at, "host", "proc[1]")
	equal(t, "d.Headers after faultHeaders", d.Headers, snapshot)
	want := amqp.Table{
		"x-death":                orig["x-death"],
		"keep":                   []byte("b"),
		HeaderError:              "wrap: boom",
		HeaderErrorType:          "error",
		rabbitmw.HeaderAttempts:  int64(1),
		HeaderOriginalExchange:   "ex",
		HeaderOriginalRoutingKey: "rk",
		HeaderOriginalQueue:      "q",
		HeaderFailedAt:           time.Date(2026, 1, 2, 2, 4, 5, 0, time.UTC),
		HeaderHost:               "host",
		HeaderProcess:            "proc[1]",
	}
	equal(t, "faultHeaders", h, want)

	// An earlier hop's origin and attempt count are kept; Decision's count
	// wins when set.
	d.Headers = amqp.Table{HeaderOriginalExchange: "first", HeaderOriginalRoutingKey: "first-rk", rabbitmw.HeaderAttempts: int32(4)}
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(errBoom)), "q", at, "h", "p")
	equal(t, "original exchange kept", h[HeaderOriginalExchange], "first")
	equal(t, "original routing key kept", h[HeaderOriginalRoutingKey], "first-rk")
	equal(t, "attempts from the header, plus this one", h[rabbitmw.HeaderAttempts], int64(5))
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(rabbitmw.WithAttempts(errBoom, 9))), "q", at, "h", "p")
	equal(t, "attempts from the Decision", h[rabbitmw.HeaderAttempts], int64(9))

	// A long error is cut to 4 KiB, at a rune boundary.
	long := strings.Repeat("é", 5000)
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(errors.New(long))), "q", at, "h", "p")
	text := h[HeaderError].(string)
	if len(text) > maxErrorText || !utf8.ValidString(text) || !strings.HasPrefix(long, strings.TrimSuffix(text, "…")) {
		t.Errorf("error text of %d bytes cut to %d bytes (valid UTF-8: %t); want a prefix of at most %d", len(long), len(text), utf8.ValidString(text), maxErrorText)
	}
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(&rabbitmw.PanicError{Value: 42})), "q", at, "h", "p")
	equal(t, "error type of a panic", h[HeaderErrorType], "panic")
	var nilMap error
	func() {
		defer func() { nilMap = &rabbitmw.PanicError{Value: recover()} }()
		var m map[string]int
		m["x"]++
	}()
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(nilMap)), "q", at, "h", "p")
	equal(t, "error type of a nil-map panic", h[HeaderErrorType], "panic")
}

func TestDelayHeadersAndRepublishing(t *testing.T) {
	d := &amqp.Delivery{
		Exchange: "ex", RoutingKey: "rk", UserId: "alice", MessageId: "m", AppId: "app",
		ContentType: "application/json", Priority: 3, DeliveryMode: amqp.Transient, Expiration: "60000",
		Headers: amqp.Table{rabbitmw.HeaderAttempts: int64(2), HeaderNotBefore: int64(1)},
		Body:    []byte("b"),
	}
	snapshot := maps.Clone(d.Headers)
	due := time.UnixMilli(1234567)
	h := delayHeaders(d, rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: time.Second}, "q", due)
	equal(t, "attempts kept when the Decision has none", h[rabbitmw.HeaderAttempts], int64(2))
	equal(t, "not-before", h[HeaderNotBefore], int64(1234567))
	equal(t, "original exchange", h[HeaderOriginalExchange], "ex")
	h = delayHeaders(d, rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: time.Second, Attempts: 3}, "q", time.Time{})
	equal(t, "attempts from the Decision", h[rabbitmw.HeaderAttempts], int64(3))
	if _, ok := h[HeaderNotBefore]; ok {
		t.Error("stale not-before kept; want it removed when the tier covers the delay")
	}
	p := republishing(d, h)
	equal(t, "d.Headers after the copies", d.Headers, snapshot)
	equal(t, "UserId of the copy", p.UserId, "")
	equal(t, "user id header", p.Headers[HeaderUserID], "alice")
	equal(t, "DeliveryMode of the copy", p.DeliveryMode, uint8(amqp.Persistent))
	assert.Equal(t, []any{"m", "app", "application/json", uint8(3), "b"},
		[]any{p.MessageId, p.AppId, p.ContentType, p.Priority, string(p.Body)}, "properties kept")
	assert.Empty(t, p.Expiration, "Expiration of the copy")
	assert.Equal(t, "60000", p.Headers[HeaderOriginalExpiration])
	assert.Equal(t, int64(amqp.Transient), p.Headers[HeaderOriginalDeliveryMode])
	nb, ok := notBefore(amqp.Table{HeaderNotBefore: int64(1234567)})
	equal(t, "notBefore", []any{nb.UnixMilli(), ok}, []any{int64(1234567), true})
	_, ok = notBefore(amqp.Table{HeaderNotBefore: "soon"})
	equal(t, "notBefore of a string", ok, false)
}

// asPublished gives a delivery back the fields that its copies changed,
// from the headers they keep them in, and leaves alone what is malformed
// or carried by the delivery itself.
func TestAsPublished(t *testing.T) {
	first := amqp.Delivery{
		Exchange: "events", RoutingKey: "order.created", UserId: "alice", Expiration: "4000",
		DeliveryMode: amqp.Transient, MessageId: "m", Headers: amqp.Table{"k": "v"},
	}
	copied := republishing(&first, delayHeaders(&first, rabbitmw.Decision{Outcome: rabbitmw.Delay}, "orders", time.Time{}))
	hop := amqp.Delivery{ // the copy, back from the delay queue
		Exchange: "", RoutingKey: "orders", Headers: copied.Headers, UserId: copied.UserId,
		Expiration: copied.Expiration, DeliveryMode: copied.DeliveryMode, MessageId: copied.MessageId,
	}
	view := func(d amqp.Delivery) []any {
		return []any{d.Exchange, d.RoutingKey, d.UserId, d.Expiration, d.DeliveryMode}
	}
	cases := []struct {
		name string
		d    amqp.Delivery
		want []any
	}{
		{"first delivery", first, view(first)},
		{"back from a delay queue", hop, view(first)},
		{"no headers", amqp.Delivery{RoutingKey: "orders", DeliveryMode: 2}, []any{"", "orders", "", "", uint8(2)}},
		{"malformed headers", amqp.Delivery{RoutingKey: "orders", DeliveryMode: 2, Headers: amqp.Table{
			HeaderOriginalExchange: []byte("events"), HeaderOriginalRoutingKey: "order.created",
			HeaderUserID: int32(1), HeaderOriginalExpiration: int64(4000), HeaderOriginalDeliveryMode: int64(7),
		}}, []any{"", "orders", "", "", uint8(2)}},
		{"properties the delivery carries", amqp.Delivery{UserId: "bob", Expiration: "9", DeliveryMode: 1, Headers: amqp.Table{
			HeaderUserID: "alice", HeaderOriginalExpiration: "4000", HeaderOriginalDeliveryMode: int64(0),
		}}, []any{"", "", "bob", "9", uint8(1)}},
	}
	for _, c := range cases {
		d := c.d
		asPublished(&d)
		assert.Equal(t, c.want, view(d), c.name)
	}
}

// FuzzFaultHeaders checks, for headers of every type and any error text,
// that the fault headers keep every header they do not own, never modify
// the delivery, and pass amqp.Table.Validate.
func FuzzFaultHeaders(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3}, "boom", 0, "ex", "rk")
	f.Add([]byte("nested tables and arrays"), strings.Repeat("x", 5000), 7, "", "")
	f.Add([]byte{255, 254, 9, 9, 9, 9, 9}, "\xff\xfe invalid utf-8", -3, "e", "k")
	f.Fuzz(func(t *testing.T, seed []byte, text string, attempts int, exchange, key string) {
		headers := tableFromSeed(seed)
		if err := headers.Validate(); err != nil {
			t.Fatalf("generated headers invalid: %v", err)
		}
		snapshot := rabbit.WireTable(headers)
		d := &amqp.Delivery{Exchange: exchange, RoutingKey: key, Headers: headers}
		err := errors.New(text)
		if attempts != 0 {
			err = rabbitmw.WithAttempts(err, attempts)
		}
		h := faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(err)), "q", time.Now(), "h", "p")
		if err := h.Validate(); err != nil {
			t.Fatalf("faultHeaders(...).Validate() = %v", err)
		}
		if !equalTables(d.Headers, snapshot) {
			t.Fatal("faultHeaders modified the delivery's headers")
		}
		owned := map[string]bool{HeaderError: true, HeaderErrorType: true, rabbitmw.HeaderAttempts: true,
			HeaderOriginalQueue: true, HeaderFailedAt: true, HeaderHost: true, HeaderProcess: true,
			HeaderOriginalExchange: true, HeaderOriginalRoutingKey: true}
		for k, v := range headers {
			if owned[k] && k != HeaderOriginalExchange && k != HeaderOriginalRoutingKey {
				continue
			}
			if !equalTables(amqp.Table{k: h[k]}, amqp.Table{k: v}) {
				t.Fatalf("header %q = %#v; want %#v kept", k, h[k], v)
			}
		}
		if s := h[HeaderError].(string); len(s) > maxErrorText || (utf8.ValidString(text) && !utf8.ValidString(s)) {
			t.Fatalf("error text of %d bytes; want at most %d, valid UTF-8 if the input was", len(s), maxErrorText)
		}
		if n, _ := h[rabbitmw.HeaderAttempts].(int64); n < 1 {
			t.Fatalf("attempts = %v; want >= 1", h[rabbitmw.HeaderAttempts])
		}
	})
}

func equalTables(a, b amqp.Table) bool { return fmt.Sprintf("%#v", a) == fmt.Sprintf("%#v", b) }

// tableFromSeed builds a table of every AMQP type from seed's bytes.
func tableFromSeed(seed []byte) amqp.Table {
	r := rand.New(rand.NewPCG(uint64(len(seed)), 0))
	for i, b := range seed {
		r = rand.New(rand.NewPCG(r.Uint64()^uint64(b), uint64(i)))
	}
	var value func(depth int) any
	value = func(depth int) any {
		switch r.IntN(18) {
		case 0:
			return r.IntN(2) == 0
		case 1:
			return byte(r.Uint32())
		case 2:
			return int8(r.Uint32())
		case 3:
			return int16(r.Uint32())
		case 4:
			return int32(r.Uint32())
		case 5:
			return int64(r.Uint64())
		case 6:
			return uint16(r.Uint32())
		case 7:
			return uint32(r.Uint32())
		case 8:
			return r.Float32()
		case 9:
			return r.Float64()
		case 10:
			return amqp.Decimal{Scale: uint8(r.IntN(10)), Value: int32(r.Uint32())}
		case 11:
			return fmt.Sprint(r.Uint64())
		case 12:
			return []byte(fmt.Sprint(r.Uint32()))
		case 13:
			return time.Unix(r.Int64N(1<<32), 0)
		case 14:
			return nil
		case 15:
			if depth < 3 {
				a := make([]any, r.IntN(4))
				for i := range a {
					a[i] = value(depth + 1)
				}
				return a
			}
		case 16:
			if depth < 3 {
				t := amqp.Table{}
				for range r.IntN(4) {
					t[fmt.Sprint("k", r.IntN(100))] = value(depth + 1)
				}
				return t
			}
		case 17:
			// An x-death record as RabbitMQ writes it.
			return []any{amqp.Table{"count": int64(r.IntN(9)), "reason": "expired", "queue": "q.delay.1s",
				"time": time.Unix(r.Int64N(1<<32), 0), "exchange": "", "routing-keys": []any{"q.delay.1s"}}}
		}
		return "leaf"
	}
	t := amqp.Table{}
	keys := []string{"a", "b", "x-death", "x-delivery-count", HeaderOriginalExchange, HeaderError, rabbitmw.HeaderAttempts}
	for range r.IntN(8) {
		t[keys[r.IntN(len(keys))]+fmt.Sprint(r.IntN(3))] = value(0)
		if r.IntN(4) == 0 {
			t[keys[r.IntN(len(keys))]] = value(0)
		}
	}
	return t
}

func TestBackoff(t *testing.T) {
	b := newBackoff(100*time.Millisecond, 2*time.Second)
	ceilings := []time.Duration{100, 200, 400, 800, 1600, 2000, 2000}
	for i, c := range ceilings {
		c *= time.Millisecond
		for range 50 {
			bb := *b
			if d := bb.next(); d < 0 || d > c {
				t.Fatalf("wait %d = %v; want in [0, %v]", i, d, c)
			}
		}
		b.next()
	}
	b = newBackoff(time.Second, time.Hour)
	for range 200 {
		if d := b.next(); d < 0 || d > time.Hour {
			t.Fatalf("wait after many attempts = %v; want in [0, 1h]", d)
		}
	}
	b.reset()
	if d := b.next(); d > time.Second {
		t.Errorf("wait after reset = %v; want <= 1s", d)
	}
}

func TestOptionsDefaults(t *testing.T) {
	c := Options{}.resolve()
	equal(t, "ReconnectMin", c.rmin, defaultReconnectMin)
	equal(t, "ReconnectMax", c.rmax, defaultReconnectMax)
	equal(t, "Heartbeat", c.heartbeat, defaultHeartbeat)
	if c.log == nil || c.log.Handler().Enabled(context.Background(), slog.LevelError) {
		t.Error("default logger is not a discarding one")
	}
	if !regexp.MustCompile(`^.+\[\d+\]$`).MatchString(c.process) {
		t.Errorf("default Process = %q; want name[pid]", c.process)
	}
	equal(t, "ReconnectMin below a small ReconnectMax", Options{ReconnectMax: 10 * time.Millisecond}.resolve().rmin, 10*time.Millisecond)
	opts := Options{}
	New("amqp://localhost/", opts)
	equal(t, "caller's Options after New", opts, Options{})
	for _, bad := range []Options{{ReconnectMin: -1}, {ReconnectMin: time.Second, ReconnectMax: time.Millisecond}, {Heartbeat: -time.Second}} {
		func() {
			defer func() {
				if r := recover(); r == nil || !strings.HasPrefix(fmt.Sprint(r), "broker: ") {
					t.Errorf("New(%+v) panicked with %v; want a broker: panic", bad, r)
				}
			}()
			New("amqp://localhost/", bad)
		}()
	}
}

func TestConsumeBadOptions(t *testing.T) {
	m := brokertest.NewServer()
	defer m.Close()
	b := New(m.URL(), Options{})
	h := rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil })
	ctx := testContext(t, 5*time.Second)
	for _, o := range []ConsumeOptions{{Workers: -1}, {Prefetch: 70000}, {ShutdownTimeout: -1}, {Topology: Topology{Delays: []time.Duration{-1}}}, {Topology: Topology{Quorum: true, Declare: DeclareSupport}}} {
		if err := b.Consume(ctx, "q", h, o); err == nil {
			t.Errorf("Consume(%+v) = nil; want an error", o)
		}
	}
	if err := b.Consume(ctx, "", h, ConsumeOptions{}); err == nil {
		t.Error("Consume of an empty queue name = nil; want an error")
	}
	defer func() {
		if r := recover(); r == nil {
			t.Error("Consume with a nil handler did not panic")
		}
	}()
	_ = b.Consume(ctx, "q", nil, ConsumeOptions{})
}

func TestMalformedURL(t *testing.T) {
	b := New("http://a b/", Options{})
	defer b.Close()
	err := b.Consume(testContext(t, 5*time.Second), "q", rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }), ConsumeOptions{})
	if err == nil || !strings.Contains(err.Error(), "malformed AMQP URL") {
		t.Errorf("Consume on a malformed URL = %v; want a malformed URL error", err)
	}
}

// closedSession is a session that is already lost.
type closedSession struct{ session }

func (closedSession) Closed() <-chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}

// A delivery taken from a session that has closed is not handled: it
// cannot be settled, and the server redelivers it. The worker's slot is
// freed.
func TestWorkerSkipsDeliveryOfClosedSession(t *testing.T) {
	var calls atomic.Int32
	c := &consumer{h: rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		calls.Add(1)
		return nil
	}), log: slog.New(slog.DiscardHandler), workers: 1, slots: make(chan struct{}, 1)}
	rec := &countingAcker{}
	deliveries := make(chan amqp.Delivery, 1)
	deliveries <- amqp.Delivery{Acknowledger: rec, DeliveryTag: 1}
	close(deliveries)
	a := newAcker("q", 1, &Observer{}, c.log)
	defer a.close()
	newConn(c, closedSession{}, a, deliveries).work(context.Background())
	equal(t, "handler calls", calls.Load(), int32(0))
	equal(t, "settlements", rec.n.Load(), int32(0))
	equal(t, "slots held", len(c.slots), 0)
}

type countingAcker struct{ n atomic.Int32 }

func (a *countingAcker) Ack(uint64, bool) error        { a.n.Add(1); return nil }
func (a *countingAcker) Nack(uint64, bool, bool) error { a.n.Add(1); return nil }
func (a *countingAcker) Reject(uint64, bool) error     { a.n.Add(1); return nil }

// A copy sent to a delay queue carries x-death only in the form RabbitMQ
// writes it, which RabbitMQ relies on when the copy expires; anything else
// moves to HeaderMalformedXDeath, kept.
func TestDelayHeadersMalformedXDeath(t *testing.T) {
	good := []any{amqp.Table{"count": int64(2), "reason": "expired", "queue": "q.delay.1s",
		"time": time.Unix(1, 0), "exchange": "", "routing-keys": []any{"q.delay.1s"}}}
	tests := []struct {
		name  string
		xd    any
		moved bool
	}{
		{"as RabbitMQ writes it", good, false},
		{"empty array", []any{}, false},
		{"a string among the tables", []any{"legacy entry", good[0]}, true},
		{"a string count", []any{amqp.Table{"count": "1", "reason": "expired", "queue": "q"}}, true},
		{"a float count", []any{amqp.Table{"count": 1.0, "queue": "q"}}, true},
		{"an int32 count", []any{amqp.Table{"count": int32(1), "queue": "q"}}, true},
		{"a negative count", []any{amqp.Table{"count": int64(-1)}}, true},
		{"a queue that is not a string", []any{amqp.Table{"count": int64(1), "queue": int64(7)}}, true},
		{"routing keys that are not strings", []any{amqp.Table{"count": int64(1), "routing-keys": []any{int64(1)}}}, true},
		{"a table, not an array", amqp.Table{"count": int64(1)}, true},
		{"an integer", int64(3), true},
	}
	for _, tt := range tests {
		d := &amqp.Delivery{Headers: amqp.Table{"x-death": tt.xd}}
		h := delayHeaders(d, rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: time.Second}, "q", time.Time{})
		_, kept := h["x-death"]
		moved, ok := h[HeaderMalformedXDeath]
		if kept == tt.moved || ok != tt.moved || (tt.moved && !equalTables(amqp.Table{"v": moved}, amqp.Table{"v": tt.xd})) {
			t.Errorf("%s: x-death kept %v, moved %v (%v); want moved %v", tt.name, kept, ok, moved, tt.moved)
		}
		if _, ok := d.Headers["x-death"]; !ok {
			t.Errorf("%s: the delivery's x-death was modified", tt.name)
		}
	}
}

// DefaultDelays hands out a copy: changing it changes no later call, nor
// the default ladder.
func TestDefaultDelaysIsACopy(t *testing.T) {
	d := DefaultDelays()
	want := slices.Clone(d)
	d[0] = time.Hour
	equal(t, "DefaultDelays() after a caller changed its result", DefaultDelays(), want)
	top, err := Topology{}.resolve("q")
	noErr(t, "resolve(defaults)", err)
	equal(t, "the shortest default tier", top.tiers[0].d, time.Second)
}

func TestTopologyQueues(t *testing.T) {
	q, err := Topology{Delays: []time.Duration{time.Minute, 1500 * time.Millisecond, time.Second, time.Second}}.Queues("orders")
	noErr(t, "Queues", err)
	equal(t, "Queues", q, Queues{Work: "orders", DeadLetter: "orders.dlq", Delays: []string{"orders.delay.1s", "orders.delay.1500ms", "orders.delay.1m"}})
	q, err = Topology{}.Queues("orders")
	noErr(t, "Queues", err)
	equal(t, "default delay queues", q.Delays, []string{"orders.delay.1s", "orders.delay.5s", "orders.delay.30s", "orders.delay.2m", "orders.delay.10m", "orders.delay.1h"})
	if _, err := (Topology{Delays: []time.Duration{-time.Second}}).Queues("orders"); err == nil {
		t.Error("Queues of an invalid Topology = nil error; want an error")
	}
}

// death is an x-death record as RabbitMQ writes it.
func death(queue, reason string, count int64, at time.Time) amqp.Table {
	return amqp.Table{"count": count, "reason": reason, "queue": queue, "time": at,
		"exchange": "", "routing-keys": []any{queue}}
}

// A copy sent to a delay queue carries the x-death records that name the
// work queue in HeaderDeaths, merged with those set aside before; x-death
// keeps the others, and stays an array.
func TestDelayHeadersSetAsideWorkQueueDeaths(t *testing.T) {
	t1, t2, t3 := time.Unix(100, 0), time.Unix(200, 0), time.Unix(300, 0)
	malformed := []any{"legacy"}
	tests := []struct {
		name              string
		headers           amqp.Table
		xDeath, deaths    any // want; nil: absent
		malformedXDeath   any
		firstDeathQueue   any
		untouchedFirstDie bool
	}{
		{
			name:    "no records of the work queue",
			headers: amqp.Table{"x-death": []any{death("q.delay.1s", "expired", 2, t1)}, HeaderDeaths: malformed},
			xDeath:  []any{death("q.delay.1s", "expired", 2, t1)},
			deaths:  malformed,
		},
		{
			name: "the record of an expiry in the work queue, alone",
			headers: amqp.Table{"x-death": []any{death("q", "expired", 1, t1)},
				"x-first-death-queue": "q", "x-first-death-reason": "expired", "x-first-death-exchange": ""},
			xDeath:          []any{},
			deaths:          []any{death("q", "expired", 1, t1)},
			firstDeathQueue: "q",
		},
		{
			name: "every reason, among other queues' records, in order",
			headers: amqp.Table{"x-death": []any{
				death("q.delay.1s", "expired", 1, t3), death("q", "delivery_limit", 1, t2), death("elsewhere", "rejected", 1, t1),
				death("q", "rejected", 2, t1), death("q", "maxlen", 1, t1),
			}},
			xDeath: []any{death("q.delay.1s", "expired", 1, t3), death("elsewhere", "rejected", 1, t1)},
			deaths: []any{death("q", "delivery_limit", 1, t2), death("q", "rejected", 2, t1), death("q", "maxlen", 1, t1)},
		},
		{
			name: "merged into those set aside on earlier hops",
			headers: amqp.Table{
				"x-death":    []any{death("q.delay.1s", "expired", 1, t3), death("q", "delivery_limit", 2, t3)},
				HeaderDeaths: []any{death("q", "expired", 1, t1), death("q", "delivery_limit", 3, t2)},
			},
			xDeath: []any{death("q.delay.1s", "expired", 1, t3)},
			// The newer record's place, the older one's time, both counts.
			deaths: []any{death("q", "delivery_limit", 5, t2), death("q", "expired", 1, t1)},
		},
		{
			name:    "a record without a count counts one",
			headers: amqp.Table{"x-death": []any{amqp.Table{"queue": "q", "reason": "expired"}}, HeaderDeaths: []any{death("q", "expired", 1, t1)}},
			xDeath:  []any{},
			deaths:  []any{death("q", "expired", 2, t1)},
		},
		{
			name:            "over a HeaderDeaths not in x-death's form",
			headers:         amqp.Table{"x-death": []any{death("q", "expired", 1, t1)}, HeaderDeaths: malformed},
			xDeath:          []any{},
			deaths:          []any{death("q", "expired", 1, t1)},
			malformedXDeath: malformed,
		},
	}
	for _, tt := range tests {
		d := &amqp.Delivery{Headers: tt.headers}
		snapshot := rabbit.WireTable(tt.headers)
		h := delayHeaders(d, rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: time.Second}, "q", time.Time{})
		equal(t, tt.name+": x-death", h["x-death"], tt.xDeath)
		equal(t, tt.name+": "+HeaderDeaths, h[HeaderDeaths], tt.deaths)
		equal(t, tt.name+": "+HeaderMalformedXDeath, h[HeaderMalformedXDeath], tt.malformedXDeath)
		equal(t, tt.name+": x-first-death-queue", h["x-first-death-queue"], tt.firstDeathQueue)
		if !equalTables(d.Headers, snapshot) {
			t.Errorf("%s: the delivery's headers were modified: %#v", tt.name, d.Headers)
		}
	}
}

// The dead-lettered copy has the records of HeaderDeaths back in x-death,
// merged, and no HeaderDeaths; unless either is not in x-death's form.
func TestFaultHeadersRestoreDeaths(t *testing.T) {
	t1, t2 := time.Unix(100, 0), time.Unix(200, 0)
	malformed := []any{"legacy"}
	tests := []struct {
		name           string
		headers        amqp.Table
		xDeath, deaths any // want; nil: absent
	}{
		{
			name:    "nothing set aside",
			headers: amqp.Table{"x-death": []any{death("q.delay.1s", "expired", 1, t2)}},
			xDeath:  []any{death("q.delay.1s", "expired", 1, t2)},
		},
		{
			name: "after the delay hop",
			headers: amqp.Table{
				"x-death":    []any{death("q.delay.1s", "expired", 2, t2)},
				HeaderDeaths: []any{death("q", "expired", 1, t1), death("q", "delivery_limit", 3, t1)},
			},
			xDeath: []any{death("q.delay.1s", "expired", 2, t2), death("q", "expired", 1, t1), death("q", "delivery_limit", 3, t1)},
		},
		{
			name: "the same queue and reason on both sides",
			headers: amqp.Table{
				"x-death":    []any{death("q", "delivery_limit", 1, t2), death("q.delay.1s", "expired", 1, t2)},
				HeaderDeaths: []any{death("q", "delivery_limit", 2, t1)},
			},
			xDeath: []any{death("q", "delivery_limit", 3, t1), death("q.delay.1s", "expired", 1, t2)},
		},
		{
			name:    "no x-death",
			headers: amqp.Table{HeaderDeaths: []any{death("q", "expired", 1, t1)}},
			xDeath:  []any{death("q", "expired", 1, t1)},
		},
		{
			name:    "a HeaderDeaths not in x-death's form",
			headers: amqp.Table{"x-death": []any{death("q.delay.1s", "expired", 1, t2)}, HeaderDeaths: malformed},
			xDeath:  []any{death("q.delay.1s", "expired", 1, t2)},
			deaths:  malformed,
		},
		{
			name:    "an x-death not in its form",
			headers: amqp.Table{"x-death": malformed, HeaderDeaths: []any{death("q", "expired", 1, t1)}},
			xDeath:  malformed,
			deaths:  []any{death("q", "expired", 1, t1)},
		},
	}
	for _, tt := range tests {
		d := &amqp.Delivery{Headers: tt.headers}
		snapshot := rabbit.WireTable(tt.headers)
		h := faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(errBoom)), "q", time.Now(), "h", "p")
		equal(t, tt.name+": x-death", h["x-death"], tt.xDeath)
		equal(t, tt.name+": "+HeaderDeaths, h[HeaderDeaths], tt.deaths)
		if !equalTables(d.Headers, snapshot) {
			t.Errorf("%s: the delivery's headers were modified: %#v", tt.name, d.Headers)
		}
	}
}

// FuzzDelayHop checks, for any x-death in RabbitMQ's form, that the copy
// sent to a delay queue comes back to the work queue (the memory server's
// model of RabbitMQ's cycle check keeps it, with the hop recorded), and
// that the dead-lettered copy then counts every dead-lettering of the
// history, per queue and reason, in x-death.
func FuzzDelayHop(f *testing.F) {
	f.Add([]byte{0})
	f.Add([]byte{1, 5, 9, 2})
	f.Add([]byte{4, 4, 4, 1, 0, 13, 7, 7})
	f.Fuzz(func(t *testing.T, seed []byte) {
		queues := []string{"q", "q.delay.1s", "q.dlq", "other"}
		reasons := []string{"expired", "rejected", "maxlen", "delivery_limit"}
		want := map[string]int64{}
		deaths := []any{}
		var aside []any
		seen := map[string]bool{} // one record per queue and reason in each, as RabbitMQ writes them
		for i, b := range seed {
			queue, reason := queues[b%4], reasons[b/4%4]
			r := death(queue, reason, int64(b/16%3+1), time.Unix(int64(i), 0))
			earlier := b >= 192 && queue == "q" // set aside on an earlier hop
			key := fmt.Sprint(earlier, queue, reason)
			if seen[key] {
				continue
			}
			seen[key] = true
			if earlier {
				aside = append(aside, r)
			} else {
				deaths = append(deaths, r)
			}
			want[queue+" "+reason] += r["count"].(int64)
		}
		h := amqp.Table{"x-death": deaths}
		if aside != nil {
			h[HeaderDeaths] = aside
		}
		d := &amqp.Delivery{Headers: h}
		copyHeaders := delayHeaders(d, rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: time.Second}, "q", time.Time{})
		back := rabbit.AddDeath(rabbit.WireTable(copyHeaders), "q.delay.1s", "expired", "", "q.delay.1s", "", time.Unix(1000, 0))
		if rabbit.DeadLetterCycle(back["x-death"], "q") {
			t.Fatalf("the delay copy with x-death %v is dropped as a cycle", back["x-death"])
		}
		want["q.delay.1s expired"]++
		dead := faultHeaders(&amqp.Delivery{Headers: back}, rabbitmw.Decide(rabbitmw.Permanent(errBoom)), "q", time.Now(), "h", "p")
		if v, ok := dead[HeaderDeaths]; ok {
			t.Fatalf("%s = %v on the dead-lettered copy; want it in x-death", HeaderDeaths, v)
		}
		got := map[string]int64{}
		for _, r := range dead["x-death"].([]any) {
			r := r.(amqp.Table)
			got[fmt.Sprint(r["queue"], " ", r["reason"])] += r["count"].(int64)
		}
		equal(t, "dead-letterings per queue and reason", got, want)
	})
}
