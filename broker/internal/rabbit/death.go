package rabbit

import (
	"maps"
	"reflect"
	"slices"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/internal/header"
)

// DeadLetterCycle reports whether deaths, the x-death header of a message
// being dead-lettered for a reason other than rejected, with this
// dead-lettering already recorded, closes a cycle through queue target
// that no client took part in: the records, most recent first, reach one
// that names target with no record of a reject on the way (that one
// included), and nothing but records. RabbitMQ 3.10 drops such a message
// rather than let it circle forever.
func DeadLetterCycle(deaths any, target string) bool {
	records, _ := deaths.([]any)
	for _, d := range records {
		r, ok := d.(amqp.Table)
		if !ok {
			return false // put there by a client: not a cycle of the server's making
		}
		if r["queue"] == target {
			return r["reason"] != "rejected"
		}
		if r["reason"] == "rejected" {
			return false
		}
	}
	return false
}

// AddDeath records in h a dead-lettering out of queue for reason, as
// RabbitMQ 3.10 does, and returns h:
//
//   - with no x-death, it sets x-death to the one new record, and
//     x-first-death-reason, -queue and -exchange, over any set before;
//   - with an x-death that is not an array, it sets x-death to the new
//     record alone;
//   - otherwise it groups the records by queue and reason, one record for
//     each, which reverses their order when there are two or more (the
//     server does so); the record of this queue and reason, if any, counts
//     one more and keeps its time, exchange and routing keys; it goes
//     first, or a new record with a count of 1 does.
//
// A record has count, reason, queue, time, exchange (the one the message
// was published to) and routing-keys (keys: the message's routing key and
// those of its CC header), and original-expiration when the message had an
// Expiration.
func AddDeath(h amqp.Table, queue, reason, exchange string, keys []string, expiration string, at time.Time) amqp.Table {
	if h == nil {
		h = amqp.Table{}
	}
	entry := amqp.Table{
		"count":        int64(1),
		"reason":       reason,
		"queue":        queue,
		"time":         time.Unix(at.Unix(), 0),
		"exchange":     exchange,
		"routing-keys": routingKeys(keys),
	}
	if expiration != "" {
		entry["original-expiration"] = expiration
	}
	v, present := h["x-death"]
	deaths, isArray := v.([]any)
	switch {
	case !present:
		h["x-first-death-reason"] = reason
		h["x-first-death-queue"] = queue
		h["x-first-death-exchange"] = exchange
		h["x-death"] = []any{entry}
		return h
	case !isArray:
		h["x-death"] = []any{entry}
		return h
	}
	others := make([]any, 0, len(deaths))
	for _, d := range GroupDeaths(deaths) {
		if r, ok := d.(amqp.Table); ok && r["queue"] == queue && r["reason"] == reason {
			entry = WireTable(r)
			n, ok := header.Integer(r["count"])
			if !ok {
				n = 0 // RabbitMQ counts a record without a count as none
			}
			entry["count"] = n + 1
			continue
		}
		others = append(others, d)
	}
	h["x-death"] = append([]any{entry}, others...)
	return h
}

// GroupDeaths returns the x-death records of deaths as RabbitMQ 3.10
// regroups them before it adds one: one or none as they are; of several,
// the first record of each queue and reason, given the number of such
// records as its count if it has none, in the reverse order. (An element
// that is not a table, which crashes the server's queue process, is kept as
// a record of its own.)
func GroupDeaths(deaths []any) []any {
	if len(deaths) <= 1 {
		return deaths
	}
	same := func(a, b amqp.Table) bool {
		return reflect.DeepEqual(a["queue"], b["queue"]) && reflect.DeepEqual(a["reason"], b["reason"])
	}
	var grouped []any
	for i, d := range deaths {
		r, ok := d.(amqp.Table)
		if !ok {
			grouped = append(grouped, d)
			continue
		}
		seen, n := false, 0
		for j, e := range deaths {
			if o, ok := e.(amqp.Table); ok && same(r, o) {
				seen = seen || j < i
				n++
			}
		}
		if seen {
			continue
		}
		if _, ok := r["count"]; !ok {
			r = maps.Clone(r)
			r["count"] = int64(n)
		}
		grouped = append(grouped, r)
	}
	slices.Reverse(grouped)
	return grouped
}

func routingKeys(keys []string) []any {
	out := make([]any, len(keys))
	for i, k := range keys {
		out[i] = k
	}
	return out
}
