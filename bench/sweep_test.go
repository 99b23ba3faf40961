package main

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParsePrefetch(t *testing.T) {
	for _, tc := range []struct {
		in      string
		want    prefetchSpec
		workers int
		at      int
	}{
		{"32", prefetchSpec{n: 32}, 16, 32},
		{" 2x", prefetchSpec{n: 2, perWorker: true}, 16, 32},
		{"4x", prefetchSpec{n: 4, perWorker: true}, 20000, 65535},
	} {
		got, err := parsePrefetch(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("parsePrefetch(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
			continue
		}
		if at := got.at(tc.workers); at != tc.at {
			t.Errorf("%q.at(%d) = %d; want %d", tc.in, tc.workers, at, tc.at)
		}
		if back, _ := parsePrefetch(got.String()); back != got {
			t.Errorf("parsePrefetch(%q.String()) = %+v; want %+v", tc.in, back, got)
		}
	}
	for _, in := range []string{"0", "x", "2y", "-1", "65536", ""} {
		if got, err := parsePrefetch(in); err == nil {
			t.Errorf("parsePrefetch(%q) = %+v, nil; want an error", in, got)
		}
	}
}

// sweepFixture is a 3 × 3 grid with raw and rabbitmw-redis, one cell of
// rabbitmw-redis missing and one CPU figure unknown.
func sweepFixture() *sweepResult {
	r := &sweepResult{
		runHeader: runHeader{RunID: "rmwbench-test", Settings: settings{Messages: 5000, Size: 256, Rounds: 3, Persistent: true}},
		Defaults:  [2]int{32, 16},
		Workers:   []int{4, 16, 64},
		Prefetch:  []prefetchSpec{{n: 8}, {n: 32}, {n: 4, perWorker: true}},
	}
	for i, w := range r.Workers {
		for j, spec := range r.Prefetch {
			cell := sweepCell{Prefetch: spec.at(w), Workers: w, Spec: spec}
			raw := summary{figures: figures{Contender: plainName, CPU: cpuUsage{Self: 30, Redis: 0, Rabbit: 40, Postgres: -1}}, Median: float64(10000 + 1000*i + 100*j)}
			cell.Summary = append(cell.Summary, raw)
			if i != 1 || j != 2 {
				cpu := cpuUsage{Self: 80, Redis: 30, Rabbit: 50, Postgres: -1}
				if i == 2 && j == 0 {
					cpu.Rabbit = -1
				}
				cell.Summary = append(cell.Summary, summary{figures: figures{Contender: redisName, CPU: cpu}, Median: float64(5000 + 500*i + 50*j)})
			}
			cell.Summary.relateToRaw()
			r.Cells = append(r.Cells, cell)
		}
	}
	return r
}

// The plot is well-formed XML, with a panel per contender and figure, and
// in each panel one series per prefetch of the grid, drawn the same way
// every time.
func TestSweepChartSVG(t *testing.T) {
	r := sweepFixture()
	var a, b bytes.Buffer
	require.NoError(t, r.chart().writeSVG(&a))
	require.NoError(t, r.chart().writeSVG(&b))
	if !bytes.Equal(a.Bytes(), b.Bytes()) {
		t.Error("two writes of the same chart differ")
	}

	var (
		panels   []string       // data-title of each panel
		series   map[string]int // data-series → count, in the current panel
		perPanel []map[string]int
		legend   int
		inLegend bool
	)
	d := xml.NewDecoder(bytes.NewReader(a.Bytes()))
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "the SVG is not well-formed XML:\n%s", a.String())
		se, ok := tok.(xml.StartElement)
		if !ok {
			if ee, ok := tok.(xml.EndElement); ok && ee.Name.Local == "g" && inLegend {
				inLegend = false
			}
			continue
		}
		attr := func(name string) string {
			for _, a := range se.Attr {
				if a.Name.Local == name {
					return a.Value
				}
			}
			return ""
		}
		switch {
		case se.Name.Local == "svg" && se.Name.Space != "http://www.w3.org/2000/svg":
			t.Errorf("root element in namespace %q; want SVG's", se.Name.Space)
		case se.Name.Local == "g" && attr("class") == "legend":
			inLegend = true
		case se.Name.Local == "text" && inLegend:
			legend++
		case se.Name.Local == "g" && attr("class") == "panel":
			panels = append(panels, attr("data-title"))
			series = make(map[string]int)
			perPanel = append(perPanel, series)
		case se.Name.Local == "g" && attr("class") == "series":
			series[attr("data-series")]++
		}
	}
	if want := []string{"plain: msgs/s", "plain: consumer CPU", "plain: total CPU", "rabbitmw-redis: msgs/s", "rabbitmw-redis: consumer CPU", "rabbitmw-redis: total CPU"}; strings.Join(panels, "|") != strings.Join(want, "|") {
		t.Errorf("panels %q; want %q", panels, want)
	}
	if legend != len(r.Prefetch) {
		t.Errorf("%d legend entries; want %d", legend, len(r.Prefetch))
	}
	for i, s := range perPanel {
		if len(s) != len(r.Prefetch) {
			t.Errorf("panel %q: series %v; want one per prefetch (%d)", panels[i], s, len(r.Prefetch))
		}
		for _, spec := range r.Prefetch {
			if s[spec.label()] != 1 {
				t.Errorf("panel %q: %d series %q; want 1", panels[i], s[spec.label()], spec.label())
			}
		}
	}
}

// The tables mark the defaults, leave a missing cell blank and give an
// unknown CPU figure as a dash.
func TestSweepMarkdown(t *testing.T) {
	var b strings.Builder
	sweepFixture().markdown(&b)
	out := b.String()
	for _, want := range []string{
		"| 16 | 11,000 / 70 | \\*11,100 / 70 | 11,200 / 70 |",     // raw, defaults marked
		"| 16 | 5,500 (0.50) / 160 | \\*5,550 (0.50) / 160 | – |", // the missing cell
		"| 64 | 6,000 (0.50) / – |",                               // an unknown CPU figure
	} {
		if !strings.Contains(out, want) {
			t.Errorf("markdown lacks %q:\n%s", want, out)
		}
	}
}
