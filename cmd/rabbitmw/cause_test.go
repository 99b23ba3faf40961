package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// The ERROR column reads cause first, also for a message dead-lettered
// before Retry's reason did.
func TestCauseFirst(t *testing.T) {
	for in, want := range map[string]string{
		"middleware: retries exhausted after 3 attempts: decode order 7: unexpected EOF":  "decode order 7: unexpected EOF (middleware: retries exhausted after 3 attempts)",
		"decode order 7: unexpected EOF (middleware: retries exhausted after 3 attempts)": "decode order 7: unexpected EOF (middleware: retries exhausted after 3 attempts)",
		"middleware: retries exhausted after 1000 attempts":                               "middleware: retries exhausted after 1000 attempts",
		"card declined": "card declined",
	} {
		assert.Equal(t, want, causeFirst(in), "causeFirst(%q)", in)
	}
}
