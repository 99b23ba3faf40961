//go:build reliability

package reliability_test

// Connection cuts while acks are pending: the consumers coalesce their
// acks (a multiple ack once every lower delivery tag is settled, acks
// held behind a slow handler for up to 10 ms), so at every cut some acks
// are not sent yet, some are held behind a slow order, and some
// deliveries were settled on their own (dead-letter copies). A TCP proxy
// between two consumer processes and RabbitMQ closes their connections
// a few tens of milliseconds after they consume again, 40 times, while
// messages keep coming. The acks pending at a cut are lost with its
// channel: the server redelivers them, and Dedup takes them for
// duplicates. Nothing is lost, no effect happens twice, and no channel is
// ever closed by the server for an unknown delivery tag (a multiple ack
// covering a tag settled already, or a tag of another channel): neither
// the consumers' logs nor RabbitMQ's log show one for their connections.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

func TestCutsWithAcksPending(t *testing.T) {
	const (
		backlog  = 400 // published before the first cut
		cuts     = 40
		perBatch = 64 // published before each cut
		tail     = 200
	)
	rng := rand.New(rand.NewPCG(seed(t), 14))
	r := newRun(t, "cutacks", 50*time.Millisecond)
	logStart := rabbitLogSize()
	px, amqpURL := r.brokerProxy()
	opts := cutOpts(amqpURL, 32)
	opts.hold = 150 * time.Millisecond // a slow order: acks held behind it
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()

	var (
		effectIDs, deadIDs, all []string
		n                       int
	)
	batch := func(size int) []amqp.Publishing {
		msgs := make([]amqp.Publishing, size)
		for i := range msgs {
			id := fmt.Sprintf("a-%05d", n)
			n++
			all = append(all, id)
			kind := "ok"
			switch k := rng.IntN(40); {
			case k == 0:
				kind = "slow"
			case k == 1:
				kind = "poison" // a dead-letter copy, then the ack of its own
			}
			if kind == "poison" {
				deadIDs = append(deadIDs, id)
			} else {
				effectIDs = append(effectIDs, id)
			}
			b, _ := json.Marshal(map[string]any{"kind": kind})
			msgs[i] = amqp.Publishing{MessageId: id, Body: b}
		}
		return msgs
	}

	// What the consumers send through the proxy: basic.ack methods, with
	// multiple or not (a method split between two reads is missed: the
	// counts are a report, not a check).
	var acks, multiples atomic.Int64
	c := startCuts(r, px, opts, func(b []byte) {
		for rest := b; ; {
			i := bytes.Index(rest, basicAck)
			if i < 0 {
				break
			}
			acks.Add(1)
			if flags := i + len(basicAck) + 8; flags < len(rest) && rest[flags]&1 != 0 {
				multiples.Add(1)
			}
			rest = rest[i+len(basicAck):]
		}
	}, "acks-A", "acks-B")
	c.publish(ctx, t, batch(backlog))
	for range cuts {
		done := r.publishAsync(ctx, batch(perBatch), 4) // going on across the cut
		c.cut(ctx, t, time.Duration(20+rng.IntN(40))*time.Millisecond)
		require.NoError(t, <-done)
	}
	tailMsgs := batch(tail)
	e, _, endedIn := c.finish(ctx, t, all, tailMsgs)
	v := e.v

	e.wantOrders(t, effectIDs, deadIDs)
	lostConns := c.lostConnections()
	// Settled by an ack, or meant to be: effects, duplicates, and the
	// originals of dead-letter copies, less the settlements that failed
	// (their session was gone).
	var duplicates, acked int64
	for i, p := range c.procs {
		for _, s := range []string{"unknown delivery tag", "PRECONDITION_FAILED"} {
			if n := p.logCount(s); n > 0 {
				t.Errorf("consumer %s logged %q %d times; want never", p.name, s, n)
			}
		}
		duplicates += e.stats[i].Duplicates
		acked += e.stats[i].Acked + e.stats[i].Duplicates + e.stats[i].DeadLettered - e.stats[i].SettleErrors
	}
	channelErrors, readable := rabbitChannelErrors(t, logStart, r.queue)
	switch {
	case !readable:
		t.Logf("RabbitMQ's log is not readable here: only the consumers' logs were checked for unknown delivery tags")
	case len(channelErrors) > 0:
		t.Errorf("RabbitMQ closed %d channels of the consumers (first: %s); want none", len(channelErrors), channelErrors[0])
	}
	c.report(t, e, lostConns, endedIn)
	t.Logf("basic.ack seen through the proxy: %d, %d of them multiple; about %d deliveries acked: %.2f per ack frame; %d duplicates (redeliveries of messages done, acks lost at the cuts among them)",
		acks.Load(), multiples.Load(), acked, float64(acked)/float64(max(1, acks.Load())), duplicates)
	record(t, v.counted(row{
		Scenario: "14 connection cuts with acks pending",
		Messages: len(all),
		Faults:   fmt.Sprintf("%d × proxy closes the consumers' connections, 20 to 60 ms after they consume", cuts),
		Note: fmt.Sprintf("2 consumers; lost connections logged %v; %d ack frames (%d multiple) for %d acks; %d duplicates; channels closed by RabbitMQ: %d",
			lostConns, acks.Load(), multiples.Load(), acked, duplicates, len(channelErrors)),
	}))
}

// basicAck is the class and method id of basic.ack, as a method frame
// carries them; the delivery tag (8 bytes) and the multiple bit follow.
var basicAck = []byte{0, 60, 0, 80}

// rabbitLog is the log of the RabbitMQ server of the suite, when it runs on
// this machine.
const rabbitLog = "/var/log/rabbitmq/rabbit@localhost.log"

// rabbitLogSize returns the size of RabbitMQ's log (0 if unreadable).
func rabbitLogSize() int64 {
	fi, err := os.Stat(rabbitLog)
	if err != nil {
		return 0
	}
	return fi.Size()
}

var (
	rabbitConnName  = regexp.MustCompile(`connection (<[0-9.]+>) \(.*\) has a client-provided name: (.*)$`)
	rabbitChanError = regexp.MustCompile(`Channel error on connection (<[0-9.]+>)`)
)

// rabbitChannelErrors returns the channel errors in RabbitMQ's log, from
// offset on, of the connections whose client-provided name contains
// marker, each with the line that says why; readable is false if the log
// cannot be read.
func rabbitChannelErrors(t *testing.T, offset int64, marker string) (errs []string, readable bool) {
	f, err := os.Open(rabbitLog)
	if err != nil {
		return nil, false
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		t.Errorf("seek in %s: %v", rabbitLog, err)
		return nil, false
	}
	ours := map[string]bool{}
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 1<<20), 1<<20)
	pending := ""
	for s.Scan() {
		line := s.Text()
		if pending != "" {
			errs = append(errs, pending+" "+line)
			pending = ""
			continue
		}
		if m := rabbitConnName.FindStringSubmatch(line); m != nil && strings.Contains(m[2], marker) {
			ours[m[1]] = true
		}
		if m := rabbitChanError.FindStringSubmatch(line); m != nil && ours[m[1]] {
			pending = line
		}
	}
	if pending != "" {
		errs = append(errs, pending)
	}
	return errs, true
}
