package main

import (
	"bytes"
	"strconv"
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

// printable leaves printable text as it is and quotes the rest, escaped.
func TestPrintable(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"orders.paid", "orders.paid"},
		{"café über", "café über"},
		{"", ""},
		{"a\x1b[2Jb", `"a\x1b[2Jb"`},
		{"line\nbreak", `"line\nbreak"`},
		{"cr\r", `"cr\r"`},
		{"tab\there", `"tab\there"`},
		{"csi\u009b", `"csi\u009b"`},
		{"rtl\u202eoverride", `"rtl\u202eoverride"`},
		{"bytes\xff", `"bytes\xff"`},
		{`"quoted"`, strconv.Quote(`"quoted"`)},
	} {
		if got := printable(tc.in); got != tc.want {
			t.Errorf("printable(%q) = %s; want %s", tc.in, got, tc.want)
		}
	}
}
