package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/rabbitmw/rabbitmw/broker"
)

// sweepContenders run under -sweep when -only is not given.
var sweepContenders = []string{plainName, redisName, redisUnbatchedName}

// sweepMessages is -n under -sweep when -n is not given: a grid has many
// cells.
const sweepMessages = 5000

// A prefetchSpec is one prefetch of the sweep's grid: a count ("32"), or a
// multiple of the cell's workers ("2x").
type prefetchSpec struct {
	n         int
	perWorker bool
}

// parsePrefetch parses "8" or "2x".
func parsePrefetch(s string) (prefetchSpec, error) {
	s = strings.TrimSpace(s)
	num, per := strings.CutSuffix(s, "x")
	n, err := strconv.Atoi(num)
	if err != nil || n < 1 || n > 65535 {
		return prefetchSpec{}, fmt.Errorf("%q is neither a prefetch in [1, 65535] nor a multiple of the workers such as 2x", s)
	}
	return prefetchSpec{n: n, perWorker: per}, nil
}

// at returns the prefetch for a cell of the given workers.
func (p prefetchSpec) at(workers int) int {
	if p.perWorker {
		return min(p.n*workers, 65535)
	}
	return p.n
}

// String returns the spec as -sweep-prefetch takes it.
func (p prefetchSpec) String() string {
	if p.perWorker {
		return strconv.Itoa(p.n) + "x"
	}
	return strconv.Itoa(p.n)
}

// label names the spec in tables and plots.
func (p prefetchSpec) label() string {
	if p.perWorker {
		return "prefetch " + strconv.Itoa(p.n) + "×W"
	}
	return "prefetch " + strconv.Itoa(p.n)
}

func (p prefetchSpec) MarshalText() ([]byte, error) { return []byte(p.String()), nil }

func (p *prefetchSpec) UnmarshalText(b []byte) error {
	v, err := parsePrefetch(string(b))
	*p = v
	return err
}

// sweepResult is the output of -sweep: for each cell of the prefetch ×
// workers grid, a summary of each contender over the rounds.
type sweepResult struct {
	runHeader
	Defaults [2]int         `json:"defaults"` // the broker's prefetch and workers
	Workers  []int          `json:"grid_workers"`
	Prefetch []prefetchSpec `json:"grid_prefetch"`
	Cells    []sweepCell    `json:"cells"`
}

type sweepCell struct {
	Prefetch int          `json:"prefetch"`
	Workers  int          `json:"workers"`
	Spec     prefetchSpec `json:"prefetch_spec"`
	Summary  summaries    `json:"summary"`
}

// runSweep runs the contenders (by default sweepContenders) in every cell
// of the grid: workers in cfg.sweepWorkers × prefetch in cfg.sweepPrefetch.
func runSweep(ctx context.Context, e *env, cfg config, defPrefetch, defWorkers int) (*sweepResult, error) {
	names := cfg.only
	if len(names) == 0 {
		names = sweepContenders
	}
	res := &sweepResult{
		runHeader: runHeader{
			RabbitIdle: e.rabbitIdle,
			RunID:      e.runID,
			Settings:   settings{Messages: cfg.n, Size: cfg.size, Dup: cfg.dup, Rounds: cfg.rounds, Persistent: cfg.persistent},
		},
		Defaults: [2]int{defPrefetch, defWorkers},
		Workers:  cfg.sweepWorkers,
		Prefetch: cfg.sweepPrefetch,
	}
	fmt.Fprintf(os.Stdout, "run %s: sweep of %v over workers %v × prefetch %v; %d messages of %d bytes per run, %d rounds\n\n",
		e.runID, names, cfg.sweepWorkers, cfg.sweepPrefetch, cfg.n, cfg.size, cfg.rounds)
	// Every run of a contender at a setting is one job. A round runs every
	// job once, forwards in odd rounds and backwards in even ones, so that
	// a slow spell of the machine spreads over the grid rather than falling
	// on the rounds of one cell.
	type job struct {
		c    contender
		cell int
	}
	var jobs []job
	for _, w := range cfg.sweepWorkers {
		for _, spec := range cfg.sweepPrefetch {
			p := spec.at(w)
			opts := broker.ConsumeOptions{Prefetch: p, Workers: w}
			res.Cells = append(res.Cells, sweepCell{Prefetch: p, Workers: w, Spec: spec})
			for _, name := range contenderNames {
				if slices.Contains(names, name) {
					jobs = append(jobs, job{newContender(name, p, w, opts), len(res.Cells) - 1})
				}
			}
		}
	}
	runs := make([]map[string][]runResult, len(res.Cells))
	for i := range runs {
		runs[i] = make(map[string][]runResult)
	}
	for round := 1; round <= cfg.rounds; round++ {
		for _, j := range inRoundOrder(jobs, round) {
			c := j.c
			r, err := e.run(ctx, c, round, fmt.Sprintf("%s.p%dw%d.r%d", c.name, c.prefetch, c.workers, round))
			if err != nil {
				return nil, fmt.Errorf("%s at prefetch %d, workers %d, round %d: %w", c.name, c.prefetch, c.workers, round, err)
			}
			progress(r)
			runs[j.cell][c.name] = append(runs[j.cell][c.name], r)
		}
	}
	for i := range res.Cells {
		cell := &res.Cells[i]
		for _, name := range contenderNames {
			if rs, ok := runs[i][name]; ok {
				cell.Summary = append(cell.Summary, summarize(name, rs))
			}
		}
		cell.Summary.relateToRaw()
	}
	e.machine.LoadEnd = loadAverage()
	return res, nil
}

func (r *sweepResult) cell(w int, spec prefetchSpec) *sweepCell {
	for i := range r.Cells {
		if r.Cells[i].Workers == w && r.Cells[i].Spec == spec {
			return &r.Cells[i]
		}
	}
	return nil
}

func (r *sweepResult) print(w io.Writer) {
	fmt.Fprintf(w, "load average at end: %s\n\n", r.Machine.LoadEnd)
	// The grid: one table per contender but plain (see grid).
	for _, name := range contenderNames {
		if name == plainName || r.Cells[0].Summary.find(name) == nil {
			continue
		}
		fmt.Fprintf(w, "%s, msgs/s median (× plain at the same setting) / CPU ms per 1,000 messages; * = the broker's defaults (prefetch %d, workers %d)\n", name, r.Defaults[0], r.Defaults[1])
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		for _, row := range r.grid(name, "*") {
			fmt.Fprintln(tw, strings.Join(row, "\t")+"\t")
		}
		tw.Flush()
		fmt.Fprintln(w)
	}

	// Every cell in full.
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "prefetch\tworkers\tcontender\tmsgs/s median\tmin–max\t× plain\tRedis cmds/msg\tCPU ms/1,000\tload\t")
	for _, c := range r.Cells {
		for _, s := range c.Summary {
			ratio := fmtRatio(s.RatioToRaw)
			fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s–%s\t%s\t%.2f\t%s\t%s\t\n", c.Prefetch, c.Workers, s.Contender,
				thousands(s.Median), thousands(s.Min), thousands(s.Max), ratio,
				s.CommandsPerMsg, fmtCPU(s.CPU.total()), s.loads())
		}
	}
	tw.Flush()
	fmt.Fprintln(w)

	// rabbitmw-redis against hand-written, cell by cell.
	if r.Cells[0].Summary.find(redisName) != nil && r.Cells[0].Summary.find(handName) != nil {
		ahead, worst := 0, 0.0
		var worstCell sweepCell
		for _, c := range r.Cells {
			ratio := c.Summary.find(redisName).Median / c.Summary.find(handName).Median
			if ratio > 1 {
				ahead++
			}
			if worst == 0 || ratio < worst {
				worst, worstCell = ratio, c
			}
		}
		fmt.Fprintf(w, "%s  rabbitmw-redis ahead of hand-written at any prefetch: ahead in %d of %d cells; lowest ratio %.2f × at prefetch %d, workers %d\n",
			verdict(ahead == len(r.Cells)), ahead, len(r.Cells), worst, worstCell.Prefetch, worstCell.Workers)
	}
	var problems int
	for _, c := range r.Cells {
		for _, s := range c.Summary {
			for _, p := range s.Problems {
				problems++
				fmt.Fprintf(w, "PROBLEM: %s at prefetch %d, workers %d: %s\n", s.Contender, c.Prefetch, c.Workers, p)
			}
		}
	}
	if problems == 0 {
		fmt.Fprintln(w, "every message's effect exactly once, nothing left behind, in every run")
	}
}

// chart returns the plot of the sweep: a row of panels per contender,
// msgs/s, the consumer's CPU and the total CPU per 1,000 messages, with
// workers along x and a line per prefetch of the grid.
func (r *sweepResult) chart() lineChart {
	c := lineChart{
		Title: "rabbitmw: prefetch × workers",
		Caption: []string{
			fmt.Sprintf("%s, %s: %s %s messages of %d bytes per run, median of %d rounds",
				r.RunID, r.Machine.Date, thousands(float64(r.Settings.Messages)), r.Settings.mode(), r.Settings.Size, r.Settings.Rounds),
			fmt.Sprintf("load average %s at the start, %s at the end; the broker's defaults: prefetch %d, workers %d",
				r.Machine.LoadStart, r.Machine.LoadEnd, r.Defaults[0], r.Defaults[1]),
			"CPU: of the consumer's process alone, and of it, Redis and RabbitMQ together (RabbitMQ's idle CPU subtracted)",
		},
		XLabel:  "workers",
		Columns: 3,
	}
	for _, w := range r.Workers {
		c.X = append(c.X, strconv.Itoa(w))
	}
	for _, spec := range r.Prefetch {
		c.Series = append(c.Series, spec.label())
	}
	for _, name := range r.contenders() {
		rate := chartPanel{Title: name + ": msgs/s", YLabel: "msgs/s (median)"}
		self := chartPanel{Title: name + ": consumer CPU", YLabel: "CPU ms per 1,000 messages"}
		all := chartPanel{Title: name + ": total CPU", YLabel: "CPU ms per 1,000 messages"}
		for _, spec := range r.Prefetch {
			var ys, ss, as []float64
			for _, w := range r.Workers {
				y, sc, ac := math.NaN(), math.NaN(), math.NaN()
				if cell := r.cell(w, spec); cell != nil {
					if s := cell.Summary.find(name); s != nil {
						y = s.Median
						if s.CPU.Self >= 0 {
							sc = s.CPU.Self
						}
						if t := s.CPU.total(); t >= 0 {
							ac = t
						}
					}
				}
				ys, ss, as = append(ys, y), append(ss, sc), append(as, ac)
			}
			rate.Y, self.Y, all.Y = append(rate.Y, ys), append(self.Y, ss), append(all.Y, as)
		}
		c.Panels = append(c.Panels, rate, self, all)
	}
	return c
}

// contenders returns the contenders of the sweep, in table order.
func (r *sweepResult) contenders() []string {
	var names []string
	for _, name := range contenderNames {
		for _, c := range r.Cells {
			if c.Summary.find(name) != nil {
				names = append(names, name)
				break
			}
		}
	}
	return names
}

// grid returns the table of contender name over the grid: a header row,
// then a row per workers, a column per prefetch, each cell msgs/s (× plain
// in the same cell) / CPU ms per 1,000 messages, mark before the broker's
// defaults, "–" where name did not run.
func (r *sweepResult) grid(name, mark string) [][]string {
	rows := [][]string{{"workers"}}
	for _, spec := range r.Prefetch {
		rows[0] = append(rows[0], spec.label())
	}
	for _, wk := range r.Workers {
		row := []string{strconv.Itoa(wk)}
		for _, spec := range r.Prefetch {
			c := r.cell(wk, spec)
			s := c.Summary.find(name)
			if s == nil {
				row = append(row, "–")
				continue
			}
			v := thousands(s.Median)
			if c.Prefetch == r.Defaults[0] && c.Workers == r.Defaults[1] {
				v = mark + v
			}
			if s.RatioToRaw > 0 && name != plainName {
				v += fmt.Sprintf(" (%.2f)", s.RatioToRaw)
			}
			row = append(row, v+" / "+fmtCPU(s.CPU.total()))
		}
		rows = append(rows, row)
	}
	return rows
}

// markdown writes the sweep's tables in Markdown: per contender, msgs/s
// and total CPU per 1,000 messages for each cell; then every cell in full.
func (r *sweepResult) markdown(w io.Writer) {
	fmt.Fprintf(w, "Run %s (%s), %s %s messages of %d bytes per run, %d rounds; load average %s at the start, %s at the end. `*` marks the broker's defaults (prefetch %d, workers %d).\n\n",
		r.RunID, r.Machine.Date, thousands(float64(r.Settings.Messages)), r.Settings.mode(),
		r.Settings.Size, r.Settings.Rounds, r.Machine.LoadStart, r.Machine.LoadEnd, r.Defaults[0], r.Defaults[1])
	for _, name := range r.contenders() {
		fmt.Fprintf(w, "%s: msgs/s median (× plain in the same cell) / CPU ms per 1,000 messages, this process + Redis + RabbitMQ\n\n", name)
		for i, row := range r.grid(name, "\\*") {
			fmt.Fprintf(w, "| %s |\n", strings.Join(row, " | "))
			if i == 0 {
				fmt.Fprintf(w, "|%s\n", strings.Repeat(" ---: |", len(row)))
			}
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintln(w, "| prefetch | workers | contender | msgs/s median | min–max | × plain | CPU ms per 1,000: consumer | Redis | RabbitMQ | total | Redis cmds/msg | load |")
	fmt.Fprintln(w, "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
	for _, c := range r.Cells {
		for _, s := range c.Summary {
			ratio := fmtRatio(s.RatioToRaw)
			fmt.Fprintf(w, "| %d | %d | %s | %s | %s–%s | %s | %s | %s | %s | %s | %.2f | %s |\n",
				c.Prefetch, c.Workers, s.Contender, thousands(s.Median), thousands(s.Min), thousands(s.Max), ratio,
				fmtCPU(s.CPU.Self), fmtCPU(s.CPU.Redis), fmtCPU(s.CPU.Rabbit), fmtCPU(s.CPU.total()),
				s.CommandsPerMsg, s.loads())
		}
	}
}

// replot reads the results of an earlier sweep from jsonPath and writes
// its plot and tables again, as writeFiles does.
func replot(jsonPath, svgPath string) error {
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		return err
	}
	var r sweepResult
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("%s: %w", jsonPath, err)
	}
	if len(r.Cells) == 0 {
		return fmt.Errorf("%s holds no sweep", jsonPath)
	}
	base := strings.TrimSuffix(svgPath, ".svg")
	if err := writeFile(svgPath, r.chart().writeSVG); err != nil {
		return err
	}
	return writeFile(base+".md", func(w io.Writer) error { r.markdown(w); return nil })
}

// writeFile creates path and writes it with f.
func writeFile(path string, f func(io.Writer) error) error {
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f(out); err != nil {
		out.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return out.Close()
}

// writeFiles writes, if svgPath is set, the plot to it and, beside it, the
// tables (.md) and the results (.json).
func (r *sweepResult) writeFiles(svgPath string) error {
	return writePlot(svgPath, r.chart(), r.markdown, r)
}

// writePlot writes, if svgPath is set, chart to it and, beside it, the
// same name with .md (what markdown writes) and .json (v).
func writePlot(svgPath string, chart lineChart, markdown func(io.Writer), v any) error {
	if svgPath == "" {
		return nil
	}
	base := strings.TrimSuffix(svgPath, ".svg")
	if err := writeFile(svgPath, chart.writeSVG); err != nil {
		return err
	}
	if err := writeFile(base+".md", func(w io.Writer) error { markdown(w); return nil }); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "wrote %s, %s.md and %s.json\n", svgPath, base, base)
	return writeJSON(base+".json", v)
}
