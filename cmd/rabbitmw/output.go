package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// printable returns s as a table shows it: as it is if it is printable
// text (UTF-8 whose every rune strconv.IsPrint takes, the space
// included), else quoted and escaped as a Go string (strconv.Quote), so
// that a control character (an escape sequence, a newline, a carriage
// return, a tab) neither breaks the table's lines and columns nor reaches
// the operator's terminal. Text that begins with a quote is quoted too:
// a quoted cell is always an escaped one.
func printable(s string) string {
	if strings.HasPrefix(s, `"`) || !utf8.ValidString(s) || strings.IndexFunc(s, notPrint) >= 0 {
		return strconv.Quote(s)
	}
	return s
}

func notPrint(r rune) bool { return !strconv.IsPrint(r) }

// A progress draws a bar on a terminal, from the start of the operation
// (its label, before the first message is read) and then at most ten
// times a second; it draws nothing when w is not a terminal.
type progress struct {
	w     io.Writer
	label string
	on    bool
	drawn bool
	last  time.Time
}

func newProgress(w io.Writer, label string) *progress {
	f, ok := w.(*os.File)
	on := false
	if ok {
		if fi, err := f.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
			on = true
		}
	}
	p := &progress{w: w, label: label, on: on}
	p.start()
	return p
}

// start draws the label alone: connecting and the first read may take a
// while, and the operator sees at once what is under way.
func (p *progress) start() {
	if p.on {
		fmt.Fprintf(p.w, "\r%s…", p.label)
		p.drawn = true
		p.last = time.Now()
	}
}

// update draws done of total (total 0: unknown).
func (p *progress) update(done, total int) {
	if !p.on || (time.Since(p.last) < 100*time.Millisecond && done != total) {
		return
	}
	p.last = time.Now()
	p.drawn = true
	if total <= 0 {
		fmt.Fprintf(p.w, "\r%s %d", p.label, done)
		return
	}
	const width = 30
	n := done * width / total
	fmt.Fprintf(p.w, "\r%s [%s%s] %d/%d", p.label, strings.Repeat("=", n), strings.Repeat(" ", width-n), done, total)
}

// done ends the bar's line, if one was drawn.
func (p *progress) done() {
	if p.drawn {
		fmt.Fprintln(p.w)
		p.drawn = false
	}
}
