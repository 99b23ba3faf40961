package text

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestTruncate(t *testing.T) {
	for _, c := range []struct {
		s    string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"exactly10!", 10, "exactly10!"},
		{"a longer text", 10, "a longe…"},
		{"ééééé", 8, "éé…"}, // not inside a rune
	} {
		assert.Equal(t, c.want, Truncate(c.s, c.n), "Truncate(%q, %d)", c.s, c.n)
	}
}

func TestQuoteKey(t *testing.T) {
	assert.Equal(t, `"order-17"`, QuoteKey("order-17"))
	long := strings.Repeat("k", 3006)
	got := QuoteKey(long)
	assert.True(t, strings.HasSuffix(got, `…" (3006 bytes)`), got)
	assert.Less(t, len(got), 130)
}
