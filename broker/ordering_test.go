package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// With a single active consumer, one worker and no failures, two
// consumers of one queue handle its messages in the order they were
// published: the first alone while it lives, then, once it is killed,
// the second, from where the first stopped (what the first handled and
// could not ack comes again, in order).
func TestSingleActiveConsumerKeepsOrder(t *testing.T) {
	const n = 300
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			f := setup(t, be, Topology{SingleActiveConsumer: true})
			for i := range n {
				f.publish(strconv.Itoa(i), nil, nil)
			}
			var (
				mu      sync.Mutex
				handled = map[string][]int{} // consumer -> message numbers, in the order handled
				order   []string             // consumer of each handling
			)
			// The first consumer's handler stops at its n/3-th message
			// until the test has killed it: the kill lands mid-stream.
			killed := make(chan struct{})
			handler := func(name string) rabbitmw.Handler {
				return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					i, err := strconv.Atoi(d.MessageId)
					require.NoError(t, err)
					mu.Lock()
					handled[name] = append(handled[name], i)
					order = append(order, name)
					hold := name == "first" && len(handled[name]) == n/3
					mu.Unlock()
					if hold {
						<-killed
					}
					return nil
				})
			}
			count := func(name string) int {
				mu.Lock()
				defer mu.Unlock()
				return len(handled[name])
			}
			var url string
			if f.mem != nil {
				url = f.mem.URL()
			} else {
				url = testenv.RabbitMQURL(t)
			}
			// consume starts a consumer in a process of its own (a Broker
			// with its own process name); the first one never reconnects
			// on its own within the test (its backoff is an hour), as a
			// killed process does not come back.
			consume := func(name string, reconnect time.Duration) (process string, stop func() error) {
				var r [4]byte
				_, _ = rand.Read(r[:])
				process = name + "-" + hex.EncodeToString(r[:]) + "[1]"
				b := New(url, Options{Process: process, ReconnectMin: reconnect, ReconnectMax: reconnect})
				ctx, cancel := context.WithCancel(context.Background())
				done := make(chan error, 1)
				go func() { done <- b.Consume(ctx, f.q, handler(name), ConsumeOptions{Workers: 1, Topology: f.top}) }()
				var once sync.Once
				var err error
				stop = func() error {
					once.Do(func() {
						cancel()
						err = <-done
						b.Close()
					})
					return err
				}
				t.Cleanup(func() { _ = stop() })
				return process, stop
			}
			first, stopFirst := consume("first", time.Hour)
			require.Eventually(t, func() bool { return count("first") > 0 }, 20*time.Second, time.Millisecond)
			_, stopSecond := consume("second", 50*time.Millisecond) // waits

			require.Eventually(t, func() bool { return count("first") >= n/3 }, 30*time.Second, time.Millisecond)
			assert.Zero(t, count("second"), "the second consumer got messages while the first lived")
			// Kill the first: its connection is cut under it, with a
			// handler running; on the memory server the second's is cut
			// too, and it reconnects.
			f.be.drop(t, f.mem, first)
			close(killed)

			require.Eventually(t, func() bool {
				mu.Lock()
				defer mu.Unlock()
				seen := map[int]bool{}
				for _, name := range []string{"first", "second"} {
					for _, i := range handled[name] {
						seen[i] = true
					}
				}
				return len(seen) == n
			}, 60*time.Second, 10*time.Millisecond, "every message handled")
			assert.NoError(t, stopFirst())
			assert.NoError(t, stopSecond())

			mu.Lock()
			defer mu.Unlock()
			for _, name := range []string{"first", "second"} {
				seq := handled[name]
				for k := 1; k < len(seq); k++ {
					if seq[k] <= seq[k-1] {
						t.Errorf("%s consumer handled %d after %d: out of publish order (%v)", name, seq[k], seq[k-1], window(seq, k))
						break
					}
				}
			}
			// One hand-over: every handling of the first before every
			// handling of the second.
			switched := false
			for k, name := range order {
				if name == "second" {
					switched = true
				} else if switched {
					t.Errorf("handling %d is the first consumer's, after the second took over", k)
					break
				}
			}
			firstSeq, secondSeq := handled["first"], handled["second"]
			require.NotEmpty(t, secondSeq, "the second consumer never took over")
			last := firstSeq[len(firstSeq)-1]
			assert.LessOrEqual(t, secondSeq[0], last+1, "the second consumer skipped messages: it started at %d, the first stopped at %d", secondSeq[0], last)
			t.Logf("first handled 0..%d; second took over at %d (%d handled twice)", last, secondSeq[0], last+1-secondSeq[0])
		})
	}
}

// window returns seq around k, for an error message.
func window(seq []int, k int) string {
	return fmt.Sprint(seq[max(0, k-3):min(len(seq), k+3)])
}
