package main

import (
	"bufio"
	"fmt"
	"html"
	"io"
	"math"
	"strconv"
)

// A lineChart is a grid of panels that share one categorical x axis and
// one legend: each panel draws the same series (by index) as lines over
// the x categories, in the same colours. writeSVG draws it with the
// standard library alone, and deterministically: the same chart gives the
// same bytes.
type lineChart struct {
	Title   string
	Caption []string // lines under the title
	XLabel  string   // under every panel's x axis
	X       []string // the categories, left to right
	Series  []string // the legend: one name per series
	Columns int      // panels per row; 0 means 1
	Panels  []chartPanel
}

// A chartPanel is one plot of a lineChart.
type chartPanel struct {
	Title  string
	YLabel string
	// Y holds, per series of the chart, a value per category; NaN where
	// there is none. The panels of one column share their y scale.
	Y [][]float64
}

// The geometry of a chart, in SVG user units (pixels).
const (
	panelW, panelH       = 380, 240
	plotLeft, plotRight  = 62, 14
	plotTop, plotBottom  = 28, 44
	titleRow, legendRow  = 16, 18
	chartMargin          = 12
	chartFont            = "font-family=\"sans-serif\""
	yTicks               = 5
	pointR               = 3
	gridStroke, axisGrey = "#e4e4e4", "#444"
)

// seriesColours are distinguishable in colour and in grey (Okabe–Ito).
var seriesColours = []string{"#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#000000"}

// writeSVG writes c as an SVG document.
func (c lineChart) writeSVG(w io.Writer) error {
	cols := max(c.Columns, 1)
	rows := (len(c.Panels) + cols - 1) / cols
	legendRows := (len(c.Series) + 3) / 4
	legendTop := 40 + len(c.Caption)*titleRow
	top := legendTop + legendRows*legendRow
	width := chartMargin*2 + cols*panelW
	height := top + rows*panelH + chartMargin

	// One y scale per column.
	ymax := make([]float64, cols)
	for i, p := range c.Panels {
		for _, ys := range p.Y {
			for _, y := range ys {
				if !math.IsNaN(y) && y > ymax[i%cols] {
					ymax[i%cols] = y
				}
			}
		}
	}
	for i := range ymax {
		ymax[i] = niceCeil(ymax[i])
	}

	b := bufio.NewWriter(w)
	pf := func(format string, args ...any) { fmt.Fprintf(b, format, args...) }
	pf("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n")
	pf("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" %s font-size=\"12\">\n", width, height, width, height, chartFont)
	pf("<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", width, height)
	pf("<text x=\"%d\" y=\"22\" font-size=\"16\" font-weight=\"bold\">%s</text>\n", chartMargin, esc(c.Title))
	for i, line := range c.Caption {
		pf("<text x=\"%d\" y=\"%d\" fill=\"%s\">%s</text>\n", chartMargin, 40+i*titleRow, axisGrey, esc(line))
	}
	pf("<g class=\"legend\">\n")
	for i, name := range c.Series {
		x := chartMargin + (i%4)*170
		y := legendTop + (i/4)*legendRow
		pf("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"%s\" stroke-width=\"2\"/>", x, y, x+24, y, colour(i))
		pf("<circle cx=\"%d\" cy=\"%d\" r=\"%d\" fill=\"%s\"/>", x+12, y, pointR, colour(i))
		pf("<text x=\"%d\" y=\"%d\" dominant-baseline=\"middle\">%s</text>\n", x+30, y, esc(name))
	}
	pf("</g>\n")

	for i, p := range c.Panels {
		ox := chartMargin + (i%cols)*panelW
		oy := top + (i/cols)*panelH
		c.writePanel(pf, p, ox, oy, ymax[i%cols])
	}
	pf("</svg>\n")
	return b.Flush()
}

// writePanel draws p with its top left corner at (ox, oy), y from 0 to
// ymax.
func (c lineChart) writePanel(pf func(string, ...any), p chartPanel, ox, oy int, ymax float64) {
	x0, x1 := float64(ox+plotLeft), float64(ox+panelW-plotRight)
	y0, y1 := float64(oy+panelH-plotBottom), float64(oy+plotTop) // bottom, top
	xAt := func(i int) float64 {
		if len(c.X) == 1 {
			return (x0 + x1) / 2
		}
		const pad = 24
		return x0 + pad + float64(i)*(x1-x0-2*pad)/float64(len(c.X)-1)
	}
	yAt := func(v float64) float64 {
		if ymax <= 0 {
			return y0
		}
		return y0 - v/ymax*(y0-y1)
	}
	pf("<g class=\"panel\" data-title=\"%s\">\n", esc(p.Title))
	pf("<text x=\"%s\" y=\"%d\" text-anchor=\"middle\" font-weight=\"bold\">%s</text>\n", num((x0+x1)/2), oy+16, esc(p.Title))
	// The y grid, its tick labels and the axis label.
	for t := 0; t <= yTicks; t++ {
		v := ymax * float64(t) / yTicks
		y := num(yAt(v))
		pf("<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\"/>", num(x0), y, num(x1), y, gridStroke)
		pf("<text x=\"%s\" y=\"%s\" text-anchor=\"end\" dominant-baseline=\"middle\" font-size=\"11\">%s</text>\n", num(x0-6), y, esc(tickLabel(v)))
	}
	pf("<text transform=\"translate(%d %s) rotate(-90)\" text-anchor=\"middle\" font-size=\"11\">%s</text>\n", ox+14, num((y0+y1)/2), esc(p.YLabel))
	// The axes, the x ticks and the x label.
	pf("<polyline points=\"%s,%s %s,%s %s,%s\" fill=\"none\" stroke=\"%s\"/>\n", num(x0), num(y1), num(x0), num(y0), num(x1), num(y0), axisGrey)
	for i, label := range c.X {
		x := num(xAt(i))
		pf("<line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" stroke=\"%s\"/>", x, num(y0), x, num(y0+4), axisGrey)
		pf("<text x=\"%s\" y=\"%s\" text-anchor=\"middle\" font-size=\"11\">%s</text>\n", x, num(y0+16), esc(label))
	}
	pf("<text x=\"%s\" y=\"%s\" text-anchor=\"middle\" font-size=\"11\">%s</text>\n", num((x0+x1)/2), num(y0+34), esc(c.XLabel))
	// The series: a line through the points that have a value.
	for s, ys := range p.Y {
		name := ""
		if s < len(c.Series) {
			name = c.Series[s]
		}
		pf("<g class=\"series\" data-series=\"%s\" stroke=\"%s\" fill=\"%s\">\n", esc(name), colour(s), colour(s))
		var pts []string
		for i, v := range ys {
			if i < len(c.X) && !math.IsNaN(v) {
				pts = append(pts, num(xAt(i))+","+num(yAt(v)))
			}
		}
		if len(pts) > 1 {
			pf("<polyline points=\"")
			for j, pt := range pts {
				if j > 0 {
					pf(" ")
				}
				pf("%s", pt)
			}
			pf("\" fill=\"none\" stroke-width=\"2\"/>\n")
		}
		for i, v := range ys {
			if i < len(c.X) && !math.IsNaN(v) {
				pf("<circle cx=\"%s\" cy=\"%s\" r=\"%d\"><title>%s, %s %s: %s</title></circle>\n",
					num(xAt(i)), num(yAt(v)), pointR, esc(name), esc(c.XLabel), esc(c.X[i]), esc(tickLabel(v)))
			}
		}
		pf("</g>\n")
	}
	pf("</g>\n")
}

func colour(i int) string { return seriesColours[i%len(seriesColours)] }

// esc escapes s for XML text and attribute values.
func esc(s string) string { return html.EscapeString(s) }

// num formats a coordinate with one decimal, the same on every platform.
func num(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

// niceCeil returns the least of 1, 2, 2.5, 5 times a power of ten that is
// at least v (1 for v <= 0), so that yTicks ticks fall on round numbers.
func niceCeil(v float64) float64 {
	if v <= 0 || math.IsNaN(v) || math.IsInf(v, 0) {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*p >= v*(1-1e-12) {
			return m * p
		}
	}
	return 10 * p
}

// tickLabel formats an axis value: thousands separated, at most one
// decimal below 10.
func tickLabel(v float64) string {
	if v != 0 && math.Abs(v) < 10 {
		return strconv.FormatFloat(math.Round(v*100)/100, 'f', -1, 64)
	}
	return thousands(v)
}
