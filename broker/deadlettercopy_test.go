package broker

import (
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
	"github.com/rabbitmw/rabbitmw/internal/errtest"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// The fault headers of a failure whose Error method panics (a nil pointer,
// or any value) carry a text that names its type: they are written while
// the message is settled, where a panic would end the process. So is the
// first-failure header of a delay copy.
func TestFaultHeadersOfAnErrorWhoseTextPanics(t *testing.T) {
	for _, c := range errtest.Cases() {
		t.Run(c.Type, func(t *testing.T) {
			d := &amqp.Delivery{RoutingKey: "q"}
			var h amqp.Table
			require.NotPanics(t, func() {
				h = faultHeaders(d, rabbitmw.Decision{Outcome: rabbitmw.DeadLetter, Err: c.Err}, "q", time.Now(), "host", "proc")
			})
			assert.Equal(t, c.Text, h[HeaderError])
			assert.Equal(t, c.Type, h[HeaderErrorType])

			h = amqp.Table{}
			require.NotPanics(t, func() { noteFirstFailure(h, c.Err, time.Now()) })
			assert.Equal(t, c.Text, h[HeaderFirstError])
		})
	}
}

func TestFaultHeaders(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 678, time.FixedZone("X", 3600))
	orig := amqp.Table{"x-death": []any{amqp.Table{"count": int64(2)}}, "keep": []byte("b")}
	d := &amqp.Delivery{Exchange: "ex", RoutingKey: "rk", Headers: orig}
	snapshot := maps.Clone(orig)

	h := faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(fmt.Errorf("wrap: %w", errBoom))), "q", at, "host", "proc[1]")
	assert.Equal(t, snapshot, d.Headers, "d.Headers after faultHeaders")
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
	assert.Equal(t, want, h, "faultHeaders")

	// The route and properties are d's, as its handler saw them: given
	// back by asPublished from an earlier hop's headers, or d's own when
	// an exchange routed it, whatever its headers say. The attempt count
	// of an earlier hop is kept; Decision's count wins when set.
	earlier := amqp.Table{HeaderOriginalExchange: "first", HeaderOriginalRoutingKey: "first-rk", rabbitmw.HeaderAttempts: int32(4),
		HeaderUserID: "alice", HeaderOriginalExpiration: "60000", HeaderOriginalDeliveryMode: int64(amqp.Transient)}
	for _, c := range []struct {
		name   string
		d      amqp.Delivery
		ex, rk string
		kept   amqp.Table // the copy's headers of the properties asCopy keeps
	}{
		{"back from a delay queue", amqp.Delivery{Exchange: "", RoutingKey: "q", DeliveryMode: amqp.Persistent}, "first", "first-rk",
			amqp.Table{HeaderUserID: "alice", HeaderOriginalExpiration: "60000", HeaderOriginalDeliveryMode: int64(amqp.Transient)}},
		{"routed by an exchange", amqp.Delivery{Exchange: "ex", RoutingKey: "rk", UserId: "bob", DeliveryMode: amqp.Persistent}, "ex", "rk",
			amqp.Table{HeaderUserID: "bob"}},
	} {
		d := c.d
		d.Headers = maps.Clone(earlier)
		asPublished(&d, "q")
		h = faultHeaders(&d, rabbitmw.Decide(rabbitmw.Permanent(errBoom)), "q", at, "h", "p")
		assert.Equal(t, c.ex, h[HeaderOriginalExchange], c.name+": original exchange")
		assert.Equal(t, c.rk, h[HeaderOriginalRoutingKey], c.name+": original routing key")
		assert.Equal(t, int64(5), h[rabbitmw.HeaderAttempts], c.name+": attempts from the header, plus this one")
		p := republishing(&d, h)
		got := amqp.Table{}
		for _, k := range []string{HeaderUserID, HeaderOriginalExpiration, HeaderOriginalDeliveryMode} {
			if v, ok := p.Headers[k]; ok {
				got[k] = v
			}
		}
		assert.Equal(t, c.kept, got, c.name+": the headers of the properties of the copy")
	}
	d.Headers = amqp.Table{rabbitmw.HeaderAttempts: int32(4)}
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(rabbitmw.WithAttempts(errBoom, 9))), "q", at, "h", "p")
	assert.Equal(t, int64(9), h[rabbitmw.HeaderAttempts], "attempts from the Decision")

	// A long error is cut to 4 KiB, at a rune boundary.
	long := strings.Repeat("é", 5000)
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(errors.New(long))), "q", at, "h", "p")
	got := h[HeaderError].(string)
	if len(got) > text.MaxError || !utf8.ValidString(got) || !strings.HasPrefix(long, strings.TrimSuffix(got, "…")) {
		t.Errorf("error text of %d bytes cut to %d bytes (valid UTF-8: %t); want a prefix of at most %d", len(long), len(got), utf8.ValidString(got), text.MaxError)
	}
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(&rabbitmw.PanicError{Value: 42})), "q", at, "h", "p")
	assert.Equal(t, "panic", h[HeaderErrorType], "error type of a panic")
	var nilMap error
	func() {
		defer func() { nilMap = &rabbitmw.PanicError{Value: recover()} }()
		var m map[string]int
		m["x"]++
	}()
	h = faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(nilMap)), "q", at, "h", "p")
	assert.Equal(t, "panic", h[HeaderErrorType], "error type of a nil-map panic")
}

// FuzzFaultHeaders checks, for headers of every type and any error text,
// that the fault headers keep every header they do not own, never modify
// the delivery, and pass amqp.Table.Validate.
func FuzzFaultHeaders(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3}, "boom", 0, "ex", "rk")
	f.Add([]byte("nested tables and arrays"), strings.Repeat("x", 5000), 7, "", "")
	f.Add([]byte{255, 254, 9, 9, 9, 9, 9}, "\xff\xfe invalid utf-8", -3, "e", "k")
	f.Fuzz(func(t *testing.T, seed []byte, msg string, attempts int, exchange, key string) {
		headers := tableFromSeed(seed)
		require.NoError(t, headers.Validate(), "generated headers invalid")
		snapshot := rabbit.WireTable(headers)
		d := &amqp.Delivery{Exchange: exchange, RoutingKey: key, Headers: headers}
		err := errors.New(msg)
		if attempts != 0 {
			err = rabbitmw.WithAttempts(err, attempts)
		}
		h := faultHeaders(d, rabbitmw.Decide(rabbitmw.Permanent(err)), "q", time.Now(), "h", "p")
		require.NoError(t, h.Validate(), "faultHeaders(...).Validate()")
		if !equalTables(d.Headers, snapshot) {
			t.Fatal("faultHeaders modified the delivery's headers")
		}
		owned := map[string]bool{HeaderError: true, HeaderErrorType: true, rabbitmw.HeaderAttempts: true,
			HeaderOriginalQueue: true, HeaderFailedAt: true, HeaderHost: true, HeaderProcess: true,
			HeaderOriginalExchange: true, HeaderOriginalRoutingKey: true,
			HeaderUserID: true, HeaderOriginalExpiration: true, HeaderOriginalDeliveryMode: true, HeaderOriginalCC: true}
		if h[HeaderOriginalExchange] != exchange || h[HeaderOriginalRoutingKey] != key {
			t.Fatalf("original route = %q, %q; want the delivery's, %q, %q", h[HeaderOriginalExchange], h[HeaderOriginalRoutingKey], exchange, key)
		}
		for k, v := range headers {
			if owned[k] {
				continue
			}
			if !equalTables(amqp.Table{k: h[k]}, amqp.Table{k: v}) {
				t.Fatalf("header %q = %#v; want %#v kept", k, h[k], v)
			}
		}
		if s := h[HeaderError].(string); len(s) > text.MaxError || (utf8.ValidString(msg) && !utf8.ValidString(s)) {
			t.Fatalf("error text of %d bytes; want at most %d, valid UTF-8 if the input was", len(s), text.MaxError)
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
		assert.Equal(t, tt.xDeath, h["x-death"], tt.name+": x-death")
		assert.Equal(t, tt.deaths, h[HeaderDeaths], tt.name+": "+HeaderDeaths)
		if !equalTables(d.Headers, snapshot) {
			t.Errorf("%s: the delivery's headers were modified: %#v", tt.name, d.Headers)
		}
	}
}
