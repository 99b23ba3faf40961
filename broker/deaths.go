package broker

import (
	"maps"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// mergeDeaths returns the x-death records of newer, then those of older
// with a queue and reason that none of newer's has. A record of newer with
// the queue and reason of one of older is replaced by that older one, its
// count the sum of both (a record without a count counts 1): RabbitMQ
// keeps the first record of a queue and reason, time and all, and counts
// the later dead-letterings in it. Both must be in RabbitMQ's form of
// x-death; neither is modified.
func mergeDeaths(newer, older []any) []any {
	out := make([]any, 0, len(newer)+len(older))
	merged := make([]bool, len(older))
	for _, d := range newer {
		r := d.(amqp.Table)
		for i, o := range older {
			e := o.(amqp.Table)
			if !merged[i] && e["queue"] == r["queue"] && e["reason"] == r["reason"] {
				merged[i] = true
				c := maps.Clone(e)
				c["count"] = deathCount(e) + deathCount(r)
				d = c
				break
			}
		}
		out = append(out, d)
	}
	for i, o := range older {
		if !merged[i] {
			out = append(out, o)
		}
	}
	return out
}

// deathCount returns the count of x-death record r, in RabbitMQ's form: 1
// if it has none.
func deathCount(r amqp.Table) int64 {
	if n, ok := r["count"].(int64); ok {
		return n
	}
	return 1
}

// wellFormedXDeath reports whether v has the form RabbitMQ gives x-death,
// which it relies on when it dead-letters the message again: an array of
// tables, each with a long (int64) count, strings for queue, reason and
// exchange, a timestamp for time, and an array of strings for
// routing-keys, where present.
func wellFormedXDeath(v any) bool {
	entries, ok := v.([]any)
	if !ok {
		return false
	}
	for _, e := range entries {
		t, ok := e.(amqp.Table)
		if !ok {
			return false
		}
		if c, ok := t["count"]; ok {
			if n, ok := c.(int64); !ok || n < 0 {
				return false
			}
		}
		for _, k := range []string{"queue", "reason", "exchange"} {
			if x, ok := t[k]; ok {
				if _, ok := x.(string); !ok {
					return false
				}
			}
		}
		if x, ok := t["time"]; ok {
			if _, ok := x.(time.Time); !ok {
				return false
			}
		}
		if x, ok := t["routing-keys"]; ok {
			keys, ok := x.([]any)
			if !ok {
				return false
			}
			for _, k := range keys {
				if _, ok := k.(string); !ok {
					return false
				}
			}
		}
	}
	return true
}
