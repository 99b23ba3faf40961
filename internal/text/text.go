// Package text shortens what a message or its key puts into an error's
// text, so that a long value neither floods a log line nor crowds out
// the rest of a fault header.
package text

import (
	"strconv"
	"unicode/utf8"
)

// Truncate cuts s to at most n bytes, at a rune boundary, ending it with
// an ellipsis if it was cut.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "…"
	cut := n - len(mark)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

// keyShown is how many bytes of a key QuoteKey shows.
const keyShown = 100

// QuoteKey quotes a message's key for an error's text: whole if it is
// short, else its first bytes followed by its length, as in
// "3f0a…" (3006 bytes).
func QuoteKey(key string) string {
	if len(key) <= keyShown {
		return strconv.Quote(key)
	}
	return strconv.Quote(Truncate(key, keyShown)) + " (" + strconv.Itoa(len(key)) + " bytes)"
}
