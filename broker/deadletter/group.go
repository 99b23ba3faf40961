package deadletter

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"slices"
	"strings"
	"time"
)

// A Group is the dead-lettered messages that failed the same way: the
// same error type, and the same error text once its variable parts are
// masked (see [Mask]).
type Group struct {
	// ID names the group (see [GroupID]); Filter.Group selects its
	// messages.
	ID string `json:"id"`
	// ErrorType is the messages' Message.ErrorType, Pattern their
	// Message.Error masked.
	ErrorType string `json:"error_type"`
	Pattern   string `json:"pattern"`
	// Count is the number of messages.
	Count int `json:"count"`
	// FirstSeen and LastSeen are the earliest and the latest
	// Message.LastFailure of the messages (zero if none has one).
	FirstSeen time.Time `json:"first_seen,omitzero"`
	LastSeen  time.Time `json:"last_seen,omitzero"`
	// Sample is the group's first message in queue order.
	Sample *Message `json:"sample"`
}

// Groups groups msgs by error type and masked error text, the largest
// group first (then by type and pattern).
func Groups(msgs []*Message) []*Group {
	byID := map[string]*Group{}
	var out []*Group
	for _, m := range msgs {
		id := GroupID(m)
		g := byID[id]
		if g == nil {
			g = &Group{ID: id, ErrorType: m.ErrorType, Pattern: Mask(m.Error), Sample: m}
			byID[id] = g
			out = append(out, g)
		}
		g.Count++
		if t := m.LastFailure; !t.IsZero() {
			if g.FirstSeen.IsZero() || t.Before(g.FirstSeen) {
				g.FirstSeen = t
			}
			if t.After(g.LastSeen) {
				g.LastSeen = t
			}
		}
	}
	slices.SortStableFunc(out, func(a, b *Group) int {
		return cmp.Or(b.Count-a.Count, strings.Compare(a.ErrorType, b.ErrorType), strings.Compare(a.Pattern, b.Pattern))
	})
	return out
}

// GroupID returns the ID of m's group: 12 hex digits of a hash of its
// error type and masked error text, the same from one run to the next.
func GroupID(m *Message) string {
	sum := sha256.Sum256([]byte(m.ErrorType + "\x00" + Mask(m.Error)))
	return hex.EncodeToString(sum[:6])
}

var (
	uuidRE  = regexp.MustCompile(`\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b`)
	timeRE  = regexp.MustCompile(`\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})?`)
	hexRE   = regexp.MustCompile(`\b(0x)?[0-9a-fA-F]{8,}\b`)
	digitRE = regexp.MustCompile(`[0-9]`)
	numRE   = regexp.MustCompile(`\b\d+\b`)
)

// Mask returns text with the parts that vary from one message to the next
// replaced: UUIDs by <uuid>, timestamps by <time>, hex strings of 8
// digits or more that hold a digit (hashes, ids) by <hex>, and numbers
// standing alone (not inside a word, as in "http2") by #, digit group by
// digit group (an address 10.0.0.7 is #.#.#.#). So
// "decode order 7: unexpected EOF" and "decode order 12: unexpected EOF"
// mask alike.
func Mask(text string) string {
	text = uuidRE.ReplaceAllString(text, "<uuid>")
	text = timeRE.ReplaceAllString(text, "<time>")
	text = hexRE.ReplaceAllStringFunc(text, func(s string) string {
		if !digitRE.MatchString(strings.TrimPrefix(s, "0x")) {
			return s
		}
		return "<hex>"
	})
	return numRE.ReplaceAllString(text, "#")
}
