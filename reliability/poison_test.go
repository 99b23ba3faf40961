//go:build reliability

package reliability_test

// Scenario 6, poison and malformed messages: bodies the handler refuses
// (rabbitmw.Permanent), bodies it always fails on or panics on, random
// bytes, 16 MB bodies, a message with no id and no body, attempt headers
// of the wrong type, and headers of every AMQP type, nested tables and
// arrays and an x-death array among them. Each must end acknowledged (its
// effect applied once) or in the dead-letter queue with fault headers
// that say why; none may loop: the deliveries of each are counted.

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
)

const poisonAttempts = 3 // the consumer's Retry limit in this scenario

// A poisonCase is one message and what it must come to.
type poisonCase struct {
	name    string
	msg     amqp.Publishing
	dead    bool   // dead-lettered; else acknowledged with its effect
	reason  string // in the dead-letter's error header
	errType string // the error type header; "" to skip the check
	// attempts is the attempt count on the dead-letter; calls the handler
	// calls, deliveries the most deliveries the message may have.
	attempts   int64
	calls      int
	deliveries int
}

// key is the case's idempotency key: its message id, or its body's MD5.
func (c poisonCase) key() string {
	if c.msg.MessageId != "" {
		return c.msg.MessageId
	}
	if len(c.msg.Body) == 0 {
		return "(no key)"
	}
	sum := md5.Sum(c.msg.Body)
	return hex.EncodeToString(sum[:])
}

// everyType returns headers of every AMQP field type the client supports,
// nested tables and arrays, and an x-death array as RabbitMQ writes it.
func everyType() amqp.Table {
	return amqp.Table{
		"bool":    true,
		"int8":    int8(-8),
		"uint8":   uint8(200),
		"int16":   int16(-16000),
		"uint16":  uint16(60000),
		"int32":   int32(-1 << 30),
		"uint32":  uint32(4000000000),
		"int64":   int64(-1 << 60),
		"float32": float32(1.5),
		"float64": 2.25,
		"decimal": amqp.Decimal{Scale: 2, Value: 12345},
		"string":  "héllo, wörld",
		"bytes":   []byte{0, 1, 0xfe, 0xff},
		"time":    time.Unix(1700000000, 0),
		"void":    nil,
		"array":   []any{int32(1), "two", 3.0, []any{true, nil}, amqp.Table{"in": "array"}},
		"table": amqp.Table{
			"nested": amqp.Table{"deeper": amqp.Table{"deepest": []any{int64(1), amqp.Table{"x": []byte("y")}}}},
			"list":   []any{amqp.Decimal{Scale: 1, Value: 5}, time.Unix(1, 0)},
		},
		"x-death": []any{amqp.Table{
			"count": int64(2), "reason": "rejected", "queue": "orders-elsewhere",
			"exchange": "", "routing-keys": []any{"orders-elsewhere"}, "time": time.Unix(1700000000, 0),
		}},
		rabbitmw.HeaderAttempts + "-like": "not ours",
	}
}

func order(kind string, pad int) []byte {
	b, _ := json.Marshal(map[string]string{"kind": kind, "pad": strings.Repeat("p", pad)})
	return b
}

// malformed returns what the consumer makes of a body that is not an
// order: the error type of the JSON decoder.
func malformed(body []byte) (dead bool, errType string) {
	var o struct {
		Kind string `json:"kind"`
	}
	err := json.Unmarshal(body, &o)
	if err == nil {
		return o.Kind != "" && o.Kind != "ok", ""
	}
	return true, fmt.Sprintf("%T", err)
}

func poisonCases(rng *rand.Rand) []poisonCase {
	const big = 16 << 20
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		return b
	}
	withHeaders := func(h amqp.Table, name string) amqp.Table {
		if h == nil {
			h = amqp.Table{}
		}
		h["x-case"] = name
		return h
	}
	var cs []poisonCase
	add := func(c poisonCase) {
		c.msg.Headers = withHeaders(c.msg.Headers, c.name)
		if c.msg.MessageId == "" && c.name != "no-id-random" && c.name != "no-key" {
			c.msg.MessageId = "p-" + c.name
		}
		cs = append(cs, c)
	}
	add(poisonCase{name: "ok", msg: amqp.Publishing{Body: order("ok", 0)}, calls: 1, deliveries: 1})
	add(poisonCase{name: "ok-every-type", msg: amqp.Publishing{Body: order("ok", 0), Headers: everyType()}, calls: 1, deliveries: 1})
	add(poisonCase{name: "poison", msg: amqp.Publishing{Body: order("poison", 0)},
		dead: true, reason: "order refused: poison", errType: "error", attempts: 1, calls: 1, deliveries: 1})
	add(poisonCase{name: "poison-every-type", msg: amqp.Publishing{Body: order("poison", 0), Headers: everyType()},
		dead: true, reason: "order refused: poison", errType: "error", attempts: 1, calls: 1, deliveries: 1})
	add(poisonCase{name: "unknown-kind", msg: amqp.Publishing{Body: order("refund", 0)},
		dead: true, reason: `unknown order kind "refund"`, errType: "error", attempts: 1, calls: 1, deliveries: 1})
	add(poisonCase{name: "fail-every-type", msg: amqp.Publishing{Body: order("fail", 0), Headers: everyType()},
		dead: true, reason: "business: payment gateway failed (middleware: retries exhausted after 3 attempts)", attempts: poisonAttempts, calls: poisonAttempts, deliveries: poisonAttempts})
	add(poisonCase{name: "panic", msg: amqp.Publishing{Body: order("panic", 0)},
		dead: true, reason: "panic: business: order p-panic panicked", attempts: poisonAttempts, calls: poisonAttempts, deliveries: poisonAttempts})
	for _, n := range []int{1, 7, 4096, 1 << 20} {
		body := random(n)
		dead, typ := malformed(body)
		c := poisonCase{name: fmt.Sprintf("random-%d", n), msg: amqp.Publishing{Body: body, Headers: everyType()}, dead: dead, calls: 1, deliveries: 1}
		if dead {
			c.reason, c.errType, c.attempts = "malformed order", typ, 1
		}
		add(c)
	}
	body := random(512)
	dead, typ := malformed(body)
	add(poisonCase{name: "no-id-random", msg: amqp.Publishing{Body: body}, dead: dead, reason: "malformed order", errType: typ, attempts: 1, calls: 1, deliveries: 1})
	add(poisonCase{name: "no-key", msg: amqp.Publishing{}, dead: true, reason: "no idempotency key", errType: "no_key", attempts: 1, calls: 0, deliveries: 1})
	// The attempt header as a string: Retry reads it as a floor, so the
	// first failure is past the limit.
	add(poisonCase{name: "attempts-string", msg: amqp.Publishing{Body: order("fail", 0), Headers: amqp.Table{rabbitmw.HeaderAttempts: "999"}},
		dead: true, reason: "retries exhausted after 1000 attempts", attempts: 1000, calls: 1, deliveries: 1})
	// Headers the library owns, with types it does not expect.
	add(poisonCase{name: "owned-headers-odd-types", msg: amqp.Publishing{Body: order("ok", 0), Headers: amqp.Table{
		rabbitmw.HeaderAttempts: amqp.Decimal{Scale: 1, Value: 7}, broker.HeaderNotBefore: "soon", broker.HeaderError: []any{int32(1)},
	}}, calls: 1, deliveries: 1})
	// 16 MB bodies: an order, random bytes, and a failing order that goes
	// through the delay queues twice before the dead-letter queue.
	add(poisonCase{name: "16MB-ok", msg: amqp.Publishing{Body: order("ok", big)}, calls: 1, deliveries: 1})
	big16 := random(big)
	dead, typ = malformed(big16)
	add(poisonCase{name: "16MB-random", msg: amqp.Publishing{Body: big16}, dead: dead, reason: "malformed order", errType: typ, attempts: 1, calls: 1, deliveries: 1})
	add(poisonCase{name: "16MB-fail", msg: amqp.Publishing{Body: order("fail", big)},
		dead: true, reason: "retries exhausted after 3 attempts", attempts: poisonAttempts, calls: poisonAttempts, deliveries: poisonAttempts})
	return cs
}

func TestPoison(t *testing.T) {
	rng := rand.New(rand.NewPCG(seed(t), 6))
	r := newRun(t, "poison", 100*time.Millisecond, 500*time.Millisecond, 2*time.Second)
	cases := poisonCases(rng)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	began := time.Now()

	// A publisher that leaves an empty message id empty, so that two
	// cases are keyed by their body, or have no key at all.
	pub := broker.New(r.amqpURL, broker.Options{KeepEmptyMessageID: true})
	defer pub.Close()
	for _, c := range cases {
		require.NoError(t, pub.Publish(ctx, "", r.queue, c.msg), "publish %s", c.name)
	}
	p := r.startConsumer("poison-A", consumerOpts{
		workers:         4,
		mode:            "poison",
		maxAttempts:     poisonAttempts,
		backoffMin:      50 * time.Millisecond,
		backoffMax:      200 * time.Millisecond,
		lease:           10 * time.Second,
		busy:            200 * time.Millisecond,
		unavailable:     200 * time.Millisecond,
		countDeliveries: true,
	})
	require.NoError(t, r.awaitQuiet(ctx, len(cases), 3*time.Second))
	var keys []string
	for _, c := range cases {
		keys = append(keys, c.key())
	}
	e := r.end(ctx, keys, p)
	st, dead, effects := e.stats[0], e.dead, e.effects

	byCase := map[string][]*amqp.Delivery{}
	for _, d := range dead {
		name, _ := d.Headers["x-case"].(string)
		byCase[name] = append(byCase[name], d)
	}
	var acked, deadLettered, wrong int
	for _, c := range cases {
		calls := r.count(ctx, "attempts:"+c.key())
		deliveries := r.count(ctx, "deliveries:"+c.key())
		if int(calls) != c.calls {
			t.Errorf("%s: handler called %d times; want %d", c.name, calls, c.calls)
		}
		if deliveries < 1 || int(deliveries) > c.deliveries {
			t.Errorf("%s: delivered %d times; want 1 to %d (no loop)", c.name, deliveries, c.deliveries)
		}
		ds, n := byCase[c.name], len(effects[c.key()])
		switch {
		case !c.dead && n == 1 && len(ds) == 0:
			acked++
		case c.dead && n == 0 && len(ds) == 1:
			deadLettered++
			checkFaultHeaders(t, r, c, ds[0])
		default:
			wrong++
			t.Errorf("%s: %d effects, %d dead-letters; want %s", c.name, n, len(ds), map[bool]string{true: "none and one", false: "one and none"}[c.dead])
		}
	}
	t.Logf("%d cases: %d acked, %d dead-lettered, %d wrong; consumer %+v; took %v", len(cases), acked, deadLettered, wrong, st, time.Since(began).Round(time.Millisecond))
	record(t, row{
		Scenario:     "6 poison and malformed",
		Messages:     len(cases),
		Duplicates:   0,
		Faults:       "refused, failing, panicking, random, 16 MB, keyless bodies; every header type",
		Once:         acked,
		Twice:        0,
		Lost:         wrong, // ended otherwise than expected: lost, or in the wrong place
		DeadLettered: deadLettered,
		Note:         fmt.Sprintf("each where expected, with its reason; deliveries per message ≤ %d", poisonAttempts),
	})
}

// checkFaultHeaders checks the dead-letter d of case c: why, where, how
// many attempts, and every header the message had, kept.
func checkFaultHeaders(t *testing.T, r *run, c poisonCase, d *amqp.Delivery) {
	t.Helper()
	h := d.Headers
	if s, _ := h[broker.HeaderError].(string); !strings.Contains(s, c.reason) {
		t.Errorf("%s: %s = %q; want it to contain %q", c.name, broker.HeaderError, s, c.reason)
	}
	if typ, _ := h[broker.HeaderErrorType].(string); typ == "" || (c.errType != "" && typ != c.errType) {
		t.Errorf("%s: %s = %q; want %q", c.name, broker.HeaderErrorType, typ, c.errType)
	}
	if n, _ := h[rabbitmw.HeaderAttempts].(int64); n != c.attempts {
		t.Errorf("%s: %s = %v; want %d", c.name, rabbitmw.HeaderAttempts, h[rabbitmw.HeaderAttempts], c.attempts)
	}
	if q, _ := h[broker.HeaderOriginalQueue].(string); q != r.queue {
		t.Errorf("%s: %s = %q; want %q", c.name, broker.HeaderOriginalQueue, q, r.queue)
	}
	if p, _ := h[broker.HeaderProcess].(string); p != "poison-A" {
		t.Errorf("%s: %s = %q; want the consumer's name", c.name, broker.HeaderProcess, p)
	}
	if at, ok := h[broker.HeaderFailedAt].(time.Time); !ok || time.Since(at) > 5*time.Minute {
		t.Errorf("%s: %s = %v; want the time of the dead-letter", c.name, broker.HeaderFailedAt, h[broker.HeaderFailedAt])
	}
	if d.MessageId != c.msg.MessageId || len(d.Body) != len(c.msg.Body) || string(d.Body) != string(c.msg.Body) {
		t.Errorf("%s: dead-letter has message id %q and a body of %d bytes; want %q and the original %d bytes", c.name, d.MessageId, len(d.Body), c.msg.MessageId, len(c.msg.Body))
	}
	for k, v := range c.msg.Headers {
		if k == "x-death" || k == broker.HeaderError || k == rabbitmw.HeaderAttempts {
			continue // RabbitMQ's and the broker's own
		}
		if got, want := fmt.Sprintf("%#v", h[k]), fmt.Sprintf("%#v", v); got != want {
			t.Errorf("%s: header %q = %s; want %s, as published", c.name, k, got, want)
		}
	}
	if xd, ok := c.msg.Headers["x-death"].([]any); ok {
		got, _ := h["x-death"].([]any)
		if len(got) < len(xd) {
			t.Errorf("%s: x-death = %#v; want the published entries kept", c.name, h["x-death"])
		}
	}
}

// An x-death header that is an array with an element other than a table
// (a legacy or hand-made entry), on a message that fails and is retried.
// Were the header copied to the delay queue as it is, RabbitMQ 3.10 would
// crash that queue when the copy expires (it walks the array expecting
// tables only, to add its own entry): the copy would never come back, and
// a control message waiting in the same delay queue would be held up with
// it. This test found that bug; the broker now moves such a header aside
// (x-rabbitmw-x-death) on the delay hop.
func TestPoisonMalformedXDeath(t *testing.T) {
	r := newRun(t, "xdeath", 100*time.Millisecond, 500*time.Millisecond, 2*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cases := []poisonCase{
		{name: "x-death-with-a-string", msg: amqp.Publishing{MessageId: "x-string", Body: order("fail", 0),
			Headers: amqp.Table{"x-case": "x-death-with-a-string", "x-death": []any{"legacy entry", amqp.Table{"count": int64(1), "reason": "expired", "queue": "elsewhere"}}}}},
		{name: "control", msg: amqp.Publishing{MessageId: "x-control", Body: order("fail", 0), Headers: amqp.Table{"x-case": "control"}}},
	}
	for _, c := range cases {
		require.NoError(t, r.b.Publish(ctx, "", r.queue, c.msg))
	}
	p := r.startConsumer("xdeath-A", consumerOpts{
		workers: 2, mode: "poison", maxAttempts: poisonAttempts,
		backoffMin: 50 * time.Millisecond, backoffMax: 200 * time.Millisecond,
		lease: 10 * time.Second, countDeliveries: true,
	})
	// Both fail three times, 50 to 200 ms apart: they should be in the
	// dead-letter queue within seconds. Give them 20.
	wctx, wcancel := context.WithTimeout(ctx, 20*time.Second)
	err := r.awaitQuiet(wctx, len(cases), 3*time.Second)
	wcancel()
	assert.NoError(t, err)
	_, err = p.stop(30 * time.Second)
	assert.NoError(t, err)
	// Not r.finish: asking a crashed queue for its length waits for
	// RabbitMQ's internal timeouts. The dead-letter queue is intact.
	dctx, dcancel := context.WithTimeout(ctx, 10*time.Second)
	dead, ferr := r.drainDLQ(dctx)
	dcancel()
	assert.NoError(t, ferr)
	got := map[string]int{}
	for _, d := range dead {
		name, _ := d.Headers["x-case"].(string)
		got[name]++
	}
	t.Logf("dead-letters by case: %v", got)
	var lost int
	for _, c := range cases {
		calls, deliveries := r.count(ctx, "attempts:"+c.key()), r.count(ctx, "deliveries:"+c.key())
		if got[c.name] == 0 {
			lost++
			t.Errorf("%s: not in the dead-letter queue (handler called %d times, delivered %d times; want %d)",
				c.name, calls, deliveries, poisonAttempts)
		}
	}
	record(t, row{
		Scenario: "6 poison: x-death array with a non-table element",
		Messages: len(cases), Faults: "a failing message with x-death [\"legacy entry\", {...}], and a control",
		DeadLettered: len(got), Lost: lost,
		Note: "the malformed x-death moved to x-rabbitmw-x-death on the delay hop; both dead-lettered, the delay queue intact",
	})
}
