package main

import (
	"context"
	"fmt"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/rabbitmw/rabbitmw/middleware"
)

func (e *env) key(ctx context.Context, args []string) error {
	fs := e.newFlags("key")
	var sf storeFlags
	sf.register(fs)
	asJSON := fs.Bool("json", false, "print JSON instead of a table")
	pos, err := fs.parse(args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("key: name one message key (its message id, or the MD5 of a body without one)")
	}
	st, closeStore, err := sf.open(ctx, e.timeout)
	if err != nil {
		return err
	}
	defer closeStore()
	k := sf.key(pos[0])
	s, err := st.Inspect(ctx, k)
	if err != nil {
		return err
	}
	host, pid, _ := middleware.TokenOwner(s.Token)
	if *asJSON {
		return writeJSON(e.stdout, struct {
			Key         string  `json:"key"`
			State       string  `json:"state"`
			Token       string  `json:"token,omitempty"`
			Host        string  `json:"host,omitempty"`
			PID         int     `json:"pid,omitempty"`
			TTL         float64 `json:"ttl_seconds,omitempty"`
			Failures    int64   `json:"failures"`
			FailuresTTL float64 `json:"failures_ttl_seconds,omitempty"`
		}{k, s.State(), s.Token, host, pid, s.TTL.Seconds(), s.Failures, s.FailuresTTL.Seconds()})
	}
	w := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "key\t%s\n", k)
	fmt.Fprintf(w, "state\t%s\n", s.State())
	switch s.State() {
	case "claimed", "abandoned":
		owner := "unknown (token not Dedup's)"
		if pid != 0 {
			owner = "host " + host + ", pid " + strconv.Itoa(pid)
		}
		fmt.Fprintf(w, "owner\t%s\n", owner)
		fmt.Fprintf(w, "token\t%s\n", s.Token)
		if s.State() == "claimed" {
			fmt.Fprintf(w, "lease left\t%s\n", ttl(s.TTL))
		} else {
			fmt.Fprintf(w, "note\tits lease ended without a result: the owner died or lost the store; the next claim counts a failed attempt\n")
			fmt.Fprintf(w, "forgotten in\t%s\n", ttl(s.TTL))
		}
	case "done":
		fmt.Fprintf(w, "retention left\t%s\n", ttl(s.TTL))
	}
	fmt.Fprintf(w, "failures\t%d\n", s.Failures)
	if s.Failures > 0 {
		fmt.Fprintf(w, "failures expire in\t%s\n", ttl(s.FailuresTTL))
	}
	return w.Flush()
}

func ttl(d time.Duration) string {
	if d < 0 {
		return "never (no expiry)"
	}
	return d.Round(time.Millisecond).String()
}
