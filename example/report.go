package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// A report gathers what happened to every message, as the consumers saw it.
type report struct {
	cfg   config
	queue string
	start time.Time

	mu        sync.Mutex
	copies    int                  // published
	ended     int                  // deliveries that left the queue: acked, duplicate or dead-lettered
	msgs      map[string]*msgStats // by key
	dead      []amqp.Delivery      // the dead-letter queue, read before the replay
	replayed  int                  // messages replayed from it
	elapsed   time.Duration
	consumers []string
	spans     *spanTree // the run's spans, with -trace
}

type msgStats struct {
	deliveries map[string]int // by consumer
	effects    int
	outcomes   map[rabbitmw.Outcome]int
	busy       int // delays because another consumer held the claim
	renewals   int
	lastErr    error // of the last delivery that failed
}

func newReport(cfg config, queue string) *report {
	return &report{cfg: cfg, queue: queue, start: time.Now(), msgs: map[string]*msgStats{}, consumers: []string{"A", "B"}}
}

// stats returns the record of key. r.mu must be held.
func (r *report) stats(key string) *msgStats {
	m := r.msgs[key]
	if m == nil {
		m = &msgStats{deliveries: map[string]int{}, outcomes: map[rabbitmw.Outcome]int{}}
		r.msgs[key] = m
	}
	return m
}

func (r *report) published(n int) {
	r.mu.Lock()
	r.copies += n
	r.mu.Unlock()
}

func (r *report) effect(key string) {
	r.mu.Lock()
	r.stats(key).effects++
	r.mu.Unlock()
}

func (r *report) renewed(key string) {
	r.mu.Lock()
	r.stats(key).renewals++
	r.mu.Unlock()
}

// observe returns the outermost layer of consumer's stack: it records each
// delivery and what its result asks the broker to do.
func (r *report) observe(consumer string) rabbitmw.Middleware {
	return func(next rabbitmw.Handler) rabbitmw.Handler {
		return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			err := next.Handle(ctx, d)
			key, _ := middleware.Key(d)
			dec := rabbitmw.Decide(err)
			r.mu.Lock()
			defer r.mu.Unlock()
			m := r.stats(key)
			m.deliveries[consumer]++
			m.outcomes[dec.Outcome]++
			if errors.Is(err, middleware.ErrBusy) {
				m.busy++
			} else if err != nil && dec.Outcome != rabbitmw.Duplicate {
				m.lastErr = err
			}
			switch dec.Outcome {
			case rabbitmw.Ack, rabbitmw.Duplicate, rabbitmw.DeadLetter:
				r.ended++
			}
			return err
		})
	}
}

// waitSettled waits until every published copy has left the work queue
// (acked, a duplicate, or dead-lettered) and the queue is empty, or a
// consumer fails, or ctx ends.
func (r *report) waitSettled(ctx context.Context, b *broker.Broker, queue string, consumerErrs <-chan error) error {
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			r.mu.Lock()
			defer r.mu.Unlock()
			return fmt.Errorf("the scenarios did not finish in time: %d of %d copies settled: %w", r.ended, r.copies, ctx.Err())
		case err := <-consumerErrs:
			return fmt.Errorf("a consumer stopped: %w", err)
		case <-tick.C:
		}
		r.mu.Lock()
		done := r.ended >= r.copies
		r.mu.Unlock()
		if !done {
			continue
		}
		if n, err := b.Len(ctx, queue); err == nil && n == 0 {
			r.mu.Lock()
			r.elapsed = time.Since(r.start)
			r.mu.Unlock()
			return nil
		}
	}
}

// A check is one line of the verdict.
type check struct {
	ok   bool
	text string
}

// checks returns what must hold for the run to pass.
func (r *report) checks() []check {
	r.mu.Lock()
	defer r.mu.Unlock()
	var cs []check
	for _, s := range scenarios {
		m := r.stats(s.key())
		want := s.wantEffects()
		cs = append(cs, check{m.effects == want, fmt.Sprintf("%s: business effect %d time(s), want %d", s.name(), m.effects, want)})
	}
	slow := r.stats("slow-1")
	cs = append(cs, check{slow.renewals > 0, fmt.Sprintf("slow-1: lease renewed %d time(s) while its handler ran, want at least 1", slow.renewals)})
	lost := r.stats(lostAckKey)
	cs = append(cs, check{lost.outcomes[rabbitmw.Duplicate] == 1, fmt.Sprintf("%s: redelivered after its ack was lost, and recognised as a duplicate %d time(s), want 1", lostAckKey, lost.outcomes[rabbitmw.Duplicate])})

	var fail *amqp.Delivery
	for i := range r.dead {
		if r.dead[i].MessageId == "fail-1" {
			fail = &r.dead[i]
		}
	}
	cs = append(cs, check{len(r.dead) == 1, fmt.Sprintf("dead-letter queue holds %d message(s), want 1", len(r.dead))})
	cs = append(cs, check{r.replayed == 1, fmt.Sprintf("%d message(s) replayed from the dead-letter queue, want 1", r.replayed)})
	if fail == nil {
		cs = append(cs, check{false, "fail-1 is not in the dead-letter queue"})
		return cs
	}
	reason, _ := fail.Headers[broker.HeaderError].(string)
	cs = append(cs,
		check{strings.Contains(reason, errDeclined.Error()), fmt.Sprintf("fail-1 dead-lettered with reason %q, want the handler's error", reason)},
		check{rabbitmw.PriorAttempts(fail) == attempts, fmt.Sprintf("fail-1 dead-lettered after %d attempts, want %d", rabbitmw.PriorAttempts(fail), attempts)},
		check{fail.Headers[broker.HeaderOriginalQueue] == r.queue, fmt.Sprintf("fail-1 fault header %s = %v, want %s", broker.HeaderOriginalQueue, fail.Headers[broker.HeaderOriginalQueue], r.queue)},
	)
	for _, h := range []string{broker.HeaderErrorType, broker.HeaderFailedAt, broker.HeaderHost, broker.HeaderProcess} {
		_, ok := fail.Headers[h]
		cs = append(cs, check{ok, fmt.Sprintf("fail-1 carries fault header %s", h)})
	}
	return cs
}

// ok reports whether every check passed.
func (r *report) ok() bool {
	for _, c := range r.checks() {
		if !c.ok {
			return false
		}
	}
	return true
}

// print writes the table and the verdict.
func (r *report) print(w io.Writer) {
	r.cfg.describe(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "MESSAGE\tSCENARIO\tDELIVERIES (A+B)\tEFFECTS\tOUTCOME")
	deliveries := 0
	for _, s := range scenarios {
		r.mu.Lock()
		m := r.stats(s.key())
		a, b := m.deliveries["A"], m.deliveries["B"]
		deliveries += a + b
		fmt.Fprintf(tw, "%s\t%s\t%d (%d+%d)\t%d\t%s\n", s.name(), s.what, a+b, a, b, m.effects, r.outcome(s, m))
		r.mu.Unlock()
	}
	tw.Flush()
	fmt.Fprintln(w)

	cs := r.checks()
	var failed []string
	for _, c := range cs {
		if !c.ok {
			failed = append(failed, c.text)
		}
	}
	r.mu.Lock()
	elapsed := r.elapsed.Round(time.Millisecond)
	r.mu.Unlock()
	if len(failed) == 0 {
		fmt.Fprintf(w, "verdict: OK. %d messages, %d deliveries in %v: every business effect happened exactly once; fail-1 reached the dead-letter queue with its fault headers and, replayed with its cause fixed, succeeded.\n",
			len(scenarios), deliveries, elapsed)
		return
	}
	fmt.Fprintf(w, "verdict: FAILED. %d of %d checks failed:\n", len(failed), len(cs))
	for _, f := range failed {
		fmt.Fprintln(w, "  -", f)
	}
}

// outcome describes what became of the message. r.mu must be held.
func (r *report) outcome(s scenario, m *msgStats) string {
	if m.outcomes[rabbitmw.DeadLetter] > 0 {
		for _, d := range r.dead {
			if d.MessageId == s.id {
				reason, _ := d.Headers[broker.HeaderError].(string)
				out := fmt.Sprintf("dead-lettered after %d attempts: %s", rabbitmw.PriorAttempts(&d), reason)
				if m.effects > 0 {
					out += "; replayed with the cause fixed: done"
				}
				return out
			}
		}
		return "dead-lettered, but NOT FOUND in the dead-letter queue"
	}
	if m.outcomes[rabbitmw.Ack]+m.outcomes[rabbitmw.Duplicate] == 0 {
		return "NOT DONE"
	}
	var notes []string
	var pe *rabbitmw.PanicError
	if errors.As(m.lastErr, &pe) {
		notes = append(notes, fmt.Sprintf("panicked (%v), then succeeded on retry", pe.Value))
	}
	if errors.Is(m.lastErr, errAckLost) {
		notes = append(notes, "ack lost, redelivery acked as a duplicate")
	} else if n := m.outcomes[rabbitmw.Duplicate]; n > 0 {
		notes = append(notes, fmt.Sprintf("%d duplicate(s) acked", n))
	}
	if m.busy > 0 {
		notes = append(notes, fmt.Sprintf("%d delayed while another consumer held it", m.busy))
	}
	if m.renewals > 0 {
		notes = append(notes, fmt.Sprintf("lease renewed %d times while it ran", m.renewals))
	}
	if len(notes) == 0 {
		return "done"
	}
	return "done: " + strings.Join(notes, "; ")
}
