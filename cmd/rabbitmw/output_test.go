package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
)

// On a terminal, the progress shows its label from the start, before
// the operation reports anything; elsewhere it writes nothing.
func TestProgressFromTheStart(t *testing.T) {
	var buf bytes.Buffer
	p := &progress{w: &buf, label: "reading orders.dlq", on: true}
	p.start()
	assert.Equal(t, "\rreading orders.dlq…", buf.String())
	p.update(3, 3)
	assert.Contains(t, buf.String(), "3/3")
	p.done()
	assert.True(t, bytes.HasSuffix(buf.Bytes(), []byte("\n")))

	buf.Reset()
	off := newProgress(&buf, "reading")
	off.update(1, 2)
	off.done()
	assert.Empty(t, buf.String())
}
