package main

import (
	"context"
	"fmt"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
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
	meaning, unknown := keyMeaning(s)
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
			Meaning     string  `json:"meaning"`
			Unknown     string  `json:"unknown,omitempty"`
		}{k, s.State(), s.Token, host, pid, s.TTL.Seconds(), s.Failures, s.FailuresTTL.Seconds(), meaning, unknown})
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
	fmt.Fprintf(w, "meaning\t%s\n", meaning)
	if unknown != "" {
		fmt.Fprintf(w, "the store cannot tell\t%s\n", unknown)
	}
	return w.Flush()
}

// keyMeaning says what a key's state means for its message, and what the
// store cannot know of it.
func keyMeaning(s store.KeyState) (meaning, unknown string) {
	switch s.Status {
	case store.Processing:
		return "a consumer is handling the message now (or died, and its lease has not ended yet)", ""
	case store.Abandoned:
		return "an attempt never finished; the next delivery counts it as a failed attempt", ""
	case store.Done:
		return "the message was handled; a copy delivered before the retention ends is acked as a duplicate, unhandled", ""
	}
	if s.Failures > 0 {
		return fmt.Sprintf("between attempts: %d failed attempt(s) counted; the message waits in a delay queue or its work queue for the next", s.Failures),
			"whether the message is still on its way: it may also have been dead-lettered by a consumer that could not reset the count"
	}
	return "nothing is held for this key: no consumer handles it, no success is remembered, no failure is counted",
		"whether the message was never handled under this key, was dead-lettered (Retry resets the count and Dedup releases the claim when they dead-letter it), " +
			"or was handled longer ago than the retention; the dead-letter queue knows the second: rabbitmw dlq show -q QUEUE KEY"
}

func ttl(d time.Duration) string {
	if d < 0 {
		return "never (no expiry)"
	}
	return d.Round(time.Millisecond).String()
}
