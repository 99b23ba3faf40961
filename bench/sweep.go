package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"slices"
	"text/tabwriter"

	"github.com/rabbitmw/rabbitmw/broker"
)

// sweepResult is the output of -sweep: for each cell of the prefetch ×
// workers grid, a summary of each contender over the rounds.
type sweepResult struct {
	runHeader
	Defaults [2]int      `json:"defaults"` // the broker's prefetch and workers
	Workers  []int       `json:"grid_workers"`
	Factors  []int       `json:"grid_prefetch_per_worker"`
	Cells    []sweepCell `json:"cells"`
}

type sweepCell struct {
	Prefetch int       `json:"prefetch"`
	Workers  int       `json:"workers"`
	Factor   int       `json:"prefetch_per_worker"`
	Summary  summaries `json:"summary"`
}

// runSweep runs the contenders (by default raw, rabbitmw-redis and
// hand-written) in every cell of the grid: workers in cfg.sweepWorkers,
// prefetch = workers × each of cfg.sweepPrefetch.
func runSweep(ctx context.Context, e *env, cfg config, defPrefetch, defWorkers int) (*sweepResult, error) {
	names := cfg.only
	if len(names) == 0 {
		names = []string{rawName, redisName, handName}
	}
	if slices.Contains(names, handP1Name) {
		return nil, fmt.Errorf("-sweep: %s has fixed settings; it is hand-written at workers 1, prefetch 1", handP1Name)
	}
	res := &sweepResult{
		runHeader: runHeader{
			RabbitIdle: e.rabbitIdle,
			RunID:      e.runID,
			Settings:   settings{Messages: cfg.n, Size: cfg.size, Dup: cfg.dup, Rounds: cfg.rounds, Persistent: cfg.persistent},
		},
		Defaults: [2]int{defPrefetch, defWorkers},
		Workers:  cfg.sweepWorkers,
		Factors:  cfg.sweepPrefetch,
	}
	fmt.Fprintf(os.Stdout, "run %s: sweep of %v over workers %v × prefetch per worker %v; %d messages of %d bytes per run, %d rounds\n\n",
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
		for _, k := range cfg.sweepPrefetch {
			p := min(k*w, 65535)
			opts := broker.ConsumeOptions{Prefetch: p, Workers: w}
			res.Cells = append(res.Cells, sweepCell{Prefetch: p, Workers: w, Factor: k})
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

func (r *sweepResult) cell(w, k int) *sweepCell {
	for i := range r.Cells {
		if r.Cells[i].Workers == w && r.Cells[i].Factor == k {
			return &r.Cells[i]
		}
	}
	return nil
}

func (r *sweepResult) print(w io.Writer) {
	fmt.Fprintf(w, "load average at end: %s\n\n", r.Machine.LoadEnd)
	// The grid: one table per contender but raw, each cell msgs/s and its
	// ratio to raw in the same cell.
	for _, name := range contenderNames {
		if name == rawName || r.Cells[0].Summary.find(name) == nil {
			continue
		}
		fmt.Fprintf(w, "%s, msgs/s median (× raw at the same setting); * = the broker's defaults (prefetch %d, workers %d)\n", name, r.Defaults[0], r.Defaults[1])
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprint(tw, "workers\t")
		for _, k := range r.Factors {
			fmt.Fprintf(tw, "prefetch %d×W\t", k)
		}
		fmt.Fprintln(tw)
		for _, wk := range r.Workers {
			fmt.Fprintf(tw, "%d\t", wk)
			for _, k := range r.Factors {
				c := r.cell(wk, k)
				s := c.Summary.find(name)
				mark := ""
				if c.Prefetch == r.Defaults[0] && c.Workers == r.Defaults[1] {
					mark = "*"
				}
				if s.RatioToRaw > 0 {
					fmt.Fprintf(tw, "%s%s (%.2f)\t", mark, thousands(s.Median), s.RatioToRaw)
				} else {
					fmt.Fprintf(tw, "%s%s\t", mark, thousands(s.Median))
				}
			}
			fmt.Fprintln(tw)
		}
		tw.Flush()
		fmt.Fprintln(w)
	}

	// Every cell in full.
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "prefetch\tworkers\tcontender\tmsgs/s median\tmin–max\t× raw\tp50\tp99\tRedis RTT/msg\t")
	for _, c := range r.Cells {
		for _, s := range c.Summary {
			ratio := "–"
			if s.RatioToRaw > 0 {
				ratio = fmt.Sprintf("%.2f", s.RatioToRaw)
			}
			fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s–%s\t%s\t%s\t%s\t%.2f\t\n", c.Prefetch, c.Workers, s.Contender,
				thousands(s.Median), thousands(s.Min), thousands(s.Max), ratio,
				fmtMicros(s.P50Micros), fmtMicros(s.P99Micros), s.RoundTripsPerMsg)
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
			for _, d := range s.Disturbed {
				fmt.Fprintf(w, "NOTE: %s at prefetch %d, workers %d: %s\n", s.Contender, c.Prefetch, c.Workers, d)
			}
		}
	}
	if problems == 0 {
		fmt.Fprintln(w, "every message's effect exactly once, nothing left behind, in every run")
	}
}
