package broker

import (
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker/internal/rabbit"
)

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
	assert.Equal(t, int64(2), h[rabbitmw.HeaderAttempts], "attempts kept when the Decision has none")
	assert.Equal(t, int64(1234567), h[HeaderNotBefore], "not-before")
	assert.Equal(t, "ex", h[HeaderOriginalExchange], "original exchange")
	h = delayHeaders(d, rabbitmw.Decision{Outcome: rabbitmw.Delay, Delay: time.Second, Attempts: 3}, "q", time.Time{})
	assert.Equal(t, int64(3), h[rabbitmw.HeaderAttempts], "attempts from the Decision")
	if _, ok := h[HeaderNotBefore]; ok {
		t.Error("stale not-before kept; want it removed when the tier covers the delay")
	}
	p := republishing(d, h)
	assert.Equal(t, snapshot, d.Headers, "d.Headers after the copies")
	assert.Equal(t, "", p.UserId, "UserId of the copy")
	assert.Equal(t, "alice", p.Headers[HeaderUserID], "user id header")
	assert.Equal(t, uint8(amqp.Persistent), p.DeliveryMode, "DeliveryMode of the copy")
	assert.Equal(t, []any{"m", "app", "application/json", uint8(3), "b"},
		[]any{p.MessageId, p.AppId, p.ContentType, p.Priority, string(p.Body)}, "properties kept")
	assert.Empty(t, p.Expiration, "Expiration of the copy")
	assert.Equal(t, "60000", p.Headers[HeaderOriginalExpiration])
	assert.Equal(t, int64(amqp.Transient), p.Headers[HeaderOriginalDeliveryMode])
	nb, ok := notBefore(amqp.Table{HeaderNotBefore: int64(1234567)})
	assert.Equal(t, []any{int64(1234567), true}, []any{nb.UnixMilli(), ok}, "notBefore")
	_, ok = notBefore(amqp.Table{HeaderNotBefore: "soon"})
	assert.False(t, ok, "notBefore of a string")
}

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
		assert.Equal(t, tt.xDeath, h["x-death"], tt.name+": x-death")
		assert.Equal(t, tt.deaths, h[HeaderDeaths], tt.name+": "+HeaderDeaths)
		assert.Equal(t, tt.malformedXDeath, h[HeaderMalformedXDeath], tt.name+": "+HeaderMalformedXDeath)
		assert.Equal(t, tt.firstDeathQueue, h["x-first-death-queue"], tt.name+": x-first-death-queue")
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
		back := rabbit.AddDeath(rabbit.WireTable(copyHeaders), "q.delay.1s", "expired", "", []string{"q.delay.1s"}, "", time.Unix(1000, 0))
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
		assert.Equal(t, want, got, "dead-letterings per queue and reason")
	})
}

// The first failure a delay copy records is the first counted one: a
// later hop keeps it, and a failure that is not counted (busy, the store
// unavailable) or no error records nothing. Its text is cut to
// maxFirstErrorText bytes; its time is UTC, in whole seconds.
func TestNoteFirstFailure(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 678, time.FixedZone("X", 3600))
	earlier := amqp.Table{HeaderFirstError: "earlier", HeaderFirstFailedAt: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	for _, c := range []struct {
		name string
		h    amqp.Table
		err  error
		want amqp.Table
	}{
		{"the first failure", amqp.Table{}, errBoom,
			amqp.Table{HeaderFirstError: "boom", HeaderFirstFailedAt: time.Date(2026, 1, 2, 2, 4, 5, 0, time.UTC)}},
		{"a later failure", maps.Clone(earlier), errBoom, earlier},
		{"a failure not counted", amqp.Table{}, rabbitmw.NotCounted(errBoom), amqp.Table{}},
		{"a failure that wraps one not counted", amqp.Table{}, fmt.Errorf("busy: %w", rabbitmw.NotCounted(errBoom)), amqp.Table{}},
		{"no error", amqp.Table{}, nil, amqp.Table{}},
	} {
		t.Run(c.name, func(t *testing.T) {
			noteFirstFailure(c.h, c.err, at)
			assert.Equal(t, c.want, c.h)
		})
	}

	h := amqp.Table{}
	noteFirstFailure(h, errors.New(strings.Repeat("e", 4*maxFirstErrorText)), at)
	first, _ := h[HeaderFirstError].(string)
	assert.LessOrEqual(t, len(first), maxFirstErrorText, "bytes of a long first error")
	assert.True(t, strings.HasPrefix(first, "eee"), "a long first error cut: %q", first)
}
