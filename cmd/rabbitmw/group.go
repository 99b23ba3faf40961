package main

import (
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/rabbitmw/rabbitmw/broker/deadletter"
)

// A failureGroup is the dead letters that failed the same way: the same
// error type, and the same error text once its variable parts (numbers,
// ids, quoted values) are masked.
type failureGroup struct {
	Key       string // ErrorType, a NUL, Pattern
	ErrorType string
	Pattern   string // the error text, masked
	Count     int
	First     time.Time // the earliest FirstFailure
	Last      time.Time // the latest LastFailure
	Sample    *deadletter.Message
	IDs       []string // the ids of the messages that have one
}

// The variable parts of an error text, in the order they are masked.
var (
	quoted = regexp.MustCompile(`"[^"]*"|'[^']*'`)
	uuid   = regexp.MustCompile(`(?i)\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b`)
	hexID  = regexp.MustCompile(`(?i)\b(0x)?[0-9a-f]{8,}\b`)
	number = regexp.MustCompile(`\d+(\.\d+)?`)
)

// maskText returns s with its variable parts masked: quoted values,
// UUIDs, long hexadecimal ids and numbers.
func maskText(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	s = quoted.ReplaceAllStringFunc(s, func(q string) string { return q[:1] + "…" + q[:1] })
	s = uuid.ReplaceAllString(s, "<uuid>")
	s = hexID.ReplaceAllStringFunc(s, func(h string) string {
		if strings.ContainsAny(h, "0123456789") {
			return "<hex>"
		}
		return h // a word
	})
	return number.ReplaceAllString(s, "<n>")
}

// groupFailures groups msgs, the largest group first.
func groupFailures(msgs []*deadletter.Message) []*failureGroup {
	byKey := map[string]*failureGroup{}
	var groups []*failureGroup
	for _, m := range msgs {
		text := m.Error
		if text == "" && m.Reason != "" {
			text = "dead-lettered by the server: " + m.Reason
		}
		pattern := maskText(text)
		key := m.ErrorType + "\x00" + pattern
		g := byKey[key]
		if g == nil {
			g = &failureGroup{Key: key, ErrorType: m.ErrorType, Pattern: pattern, Sample: m}
			byKey[key] = g
			groups = append(groups, g)
		}
		g.Count++
		if !m.FirstFailure.IsZero() && (g.First.IsZero() || m.FirstFailure.Before(g.First)) {
			g.First = m.FirstFailure
		}
		if m.LastFailure.After(g.Last) {
			g.Last = m.LastFailure
		}
		if m.ID != "" {
			g.IDs = append(g.IDs, m.ID)
		}
	}
	slices.SortStableFunc(groups, func(a, b *failureGroup) int { return b.Count - a.Count })
	return groups
}
