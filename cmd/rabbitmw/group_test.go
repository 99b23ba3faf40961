package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw/broker/deadletter"
)

func TestMaskText(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"card 4242 declined for order 17", "card <n> declined for order <n>"},
		{`user "ann" not found`, `user "…" not found`},
		{"order 3f2a9c1e-0b4d-4e5f-8a6b-7c8d9e0f1a2b  failed", "order <uuid> failed"},
		{"tx 0xdeadbeef01 reverted", "tx <hex> reverted"},
		{"feedface is a word, 1.5s passed", "feedface is a word, <n>s passed"},
		{"invalid character 'x' looking for beginning of value", "invalid character '…' looking for beginning of value"},
	} {
		if got := maskText(c.in); got != c.want {
			t.Errorf("maskText(%q) = %q; want %q", c.in, got, c.want)
		}
	}
}

func TestGroupFailures(t *testing.T) {
	at := func(m int) time.Time { return time.Date(2026, 1, 1, 0, m, 0, 0, time.UTC) }
	msgs := []*deadletter.Message{
		{ID: "a", ErrorType: "*E", Error: "card 1 declined", FirstFailure: at(5), LastFailure: at(6)},
		{ID: "b", ErrorType: "*F", Error: "card 2 declined", FirstFailure: at(1), LastFailure: at(1)},
		{ID: "c", ErrorType: "*E", Error: "card 3 declined", FirstFailure: at(2), LastFailure: at(9)},
		{ErrorType: "", Reason: "expired", LastFailure: at(3)},
	}
	groups := groupFailures(msgs)
	assert.Len(t, groups, 3, "same text, another type: another group")
	g := groups[0]
	assert.Equal(t, "*E", g.ErrorType)
	assert.Equal(t, "card <n> declined", g.Pattern)
	assert.Equal(t, 2, g.Count)
	assert.Equal(t, at(2), g.First)
	assert.Equal(t, at(9), g.Last)
	assert.Equal(t, []string{"a", "c"}, g.IDs)
	assert.Equal(t, "a", g.Sample.ID)
	assert.Equal(t, "dead-lettered by the server: expired", groups[2].Pattern)
	assert.Empty(t, groups[2].IDs)
}
