package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"text/tabwriter"

	"github.com/rabbitmw/rabbitmw/broker"
)

// scaleContenders run under -scale when -only is not given.
var scaleContenders = []string{plainName, redisName}

// A scaleCase is one point of -scale: the messages, their bodies, the
// workers (the prefetch is the broker's default for them, 2 per worker)
// and the consumer processes, each on a queue of its own, of a run.
type scaleCase struct {
	Label   string `json:"label"`
	Size    int    `json:"size"`
	N       int    `json:"n"`
	Workers int    `json:"workers"`
	Procs   int    `json:"procs"`
}

// scaleCases are the points of -scale: the defaults (12 B, 16 workers,
// 20,000 messages, one process), then one thing changed at a time.
var scaleCases = []scaleCase{
	{"12 B", 12, 20000, 16, 1},
	{"1 KB", 1024, 20000, 16, 1},
	{"64 KB", 65536, 4000, 16, 1},
	{"64 workers", 12, 20000, 64, 1},
	{"256 workers", 12, 20000, 256, 1},
	{"100,000 msgs", 12, 100000, 16, 1},
	{"3 processes", 12, 21000, 16, 3},
}

// scaleResult is the output of -scale: each contender over the rounds, per
// case.
type scaleResult struct {
	runHeader
	Cases []scaleCell `json:"cases"`
}

type scaleCell struct {
	Case    scaleCase `json:"case"`
	Summary summaries `json:"summary"`
}

// runScale runs the contenders at every scale case, the runs of all cases
// in one order that reverses from round to round.
func runScale(ctx context.Context, e *env, cfg config) (*scaleResult, error) {
	names := cfg.only
	if len(names) == 0 {
		names = scaleContenders
	}
	res := &scaleResult{runHeader: runHeader{RunID: e.runID, RabbitIdle: e.rabbitIdle,
		Settings: settings{Rounds: cfg.rounds, Persistent: cfg.persistent}}}
	type job struct {
		c    contender
		cell int
	}
	var jobs []job
	for _, sc := range scaleCases {
		res.Cases = append(res.Cases, scaleCell{Case: sc})
		p := 2 * sc.Workers
		for _, name := range contenderNames {
			if slices.Contains(names, name) {
				c := newContender(name, p, sc.Workers, broker.ConsumeOptions{Prefetch: p, Workers: sc.Workers})
				c.procs = sc.Procs
				jobs = append(jobs, job{c, len(res.Cases) - 1})
			}
		}
	}
	fmt.Fprintf(os.Stdout, "run %s: scale of %v over %d cases, %d rounds, messages × %.2f\n\n", e.runID, names, len(scaleCases), cfg.rounds, float64(cfg.n)/20000)
	runs := make([]map[string][]runResult, len(res.Cases))
	for i := range runs {
		runs[i] = make(map[string][]runResult)
	}
	for round := 1; round <= cfg.rounds; round++ {
		for _, j := range inRoundOrder(jobs, round) {
			sc := res.Cases[j.cell].Case
			// -n scales every case's messages (20,000 by default).
			e.cfg.n, e.cfg.size = max(sc.Procs, sc.N*cfg.n/20000), sc.Size
			r, err := e.run(ctx, j.c, round, fmt.Sprintf("%s.s%d.r%d", j.c.name, j.cell, round))
			if err != nil {
				return nil, fmt.Errorf("%s at %s, round %d: %w", j.c.name, sc.Label, round, err)
			}
			progress(r)
			runs[j.cell][j.c.name] = append(runs[j.cell][j.c.name], r)
		}
	}
	for i := range res.Cases {
		cell := &res.Cases[i]
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

func (r *scaleResult) print(w io.Writer) {
	fmt.Fprintf(w, "load average at end: %s\n\n", r.Machine.LoadEnd)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "case\tcontender\tmsgs/s median\t× plain\tCPU: consumer\tRedis\tRabbitMQ\ttotal\tload\t")
	for _, c := range r.Cases {
		for _, s := range c.Summary {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", c.Case.Label, s.Contender, thousands(s.Median), fmtRatio(s.RatioToRaw),
				fmtCPU(s.CPU.Self), fmtCPU(s.CPU.Redis), fmtCPU(s.CPU.Rabbit), fmtCPU(s.CPU.total()), s.loads())
		}
	}
	tw.Flush()
	fmt.Fprintln(w)
	for _, c := range r.Cases {
		for _, s := range c.Summary {
			for _, p := range s.Problems {
				fmt.Fprintf(w, "PROBLEM: %s at %s: %s\n", s.Contender, c.Case.Label, p)
			}
		}
	}
}

// markdown writes the table of print in Markdown.
func (r *scaleResult) markdown(w io.Writer) {
	fmt.Fprintf(w, "Run %s (%s), %d rounds; load average %s at the start, %s at the end.\n\n",
		r.RunID, r.Machine.Date, r.Settings.Rounds, r.Machine.LoadStart, r.Machine.LoadEnd)
	fmt.Fprintln(w, "| case | contender | msgs/s median | × plain | CPU ms per 1,000: consumer | Redis | RabbitMQ | total | load |")
	fmt.Fprintln(w, "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
	for _, c := range r.Cases {
		for _, s := range c.Summary {
			fmt.Fprintf(w, "| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c.Case.Label, s.Contender, thousands(s.Median), fmtRatio(s.RatioToRaw),
				fmtCPU(s.CPU.Self), fmtCPU(s.CPU.Redis), fmtCPU(s.CPU.Rabbit), fmtCPU(s.CPU.total()), s.loads())
		}
	}
}

// chart plots the CPU per 1,000 messages of each contender over the
// cases: a panel per contender, a line per process (consumer, Redis,
// RabbitMQ, and their total).
func (r *scaleResult) chart() lineChart {
	c := lineChart{
		Title: "rabbitmw: CPU per message as things grow",
		Caption: []string{
			fmt.Sprintf("%s, %s: median of %d rounds; load average %s at the start, %s at the end",
				r.RunID, r.Machine.Date, r.Settings.Rounds, r.Machine.LoadStart, r.Machine.LoadEnd),
			"each case changes one thing from the first: body size, workers (prefetch 2 per worker), messages, consumer processes",
		},
		XLabel:  "case",
		Series:  []string{"consumer", "Redis", "RabbitMQ", "total"},
		Columns: 2,
	}
	for _, cs := range r.Cases {
		c.X = append(c.X, cs.Case.Label)
	}
	var names []string
	for _, name := range contenderNames {
		for _, cs := range r.Cases {
			if cs.Summary.find(name) != nil {
				names = append(names, name)
				break
			}
		}
	}
	for _, name := range names {
		p := chartPanel{Title: name + ": CPU per 1,000 messages", YLabel: "CPU ms per 1,000 messages"}
		p.Y = make([][]float64, len(c.Series))
		for _, cs := range r.Cases {
			vals := []float64{math.NaN(), math.NaN(), math.NaN(), math.NaN()}
			if s := cs.Summary.find(name); s != nil {
				for i, v := range []float64{s.CPU.Self, s.CPU.Redis, s.CPU.Rabbit, s.CPU.total()} {
					if v >= 0 {
						vals[i] = v
					}
				}
			}
			for i := range vals {
				p.Y[i] = append(p.Y[i], vals[i])
			}
		}
		c.Panels = append(c.Panels, p)
	}
	return c
}

// writeFiles writes, if svgPath is set, the plot to it and, beside it, the
// table (.md) and the results (.json).
func (r *scaleResult) writeFiles(svgPath string) error {
	return writePlot(svgPath, r.chart(), r.markdown, r)
}
