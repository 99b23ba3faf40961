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
			handler := func(name string) rabbitmw.Handler {
				return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					i, err := strconv.Atoi(d.MessageId)
					require.NoError(t, err)
					mu.Lock()
					handled[name] = append(handled[name], i)
					order = append(order, name)
					mu.Unlock()
					time.Sleep(time.Millisecond) // a handler's work: the kill lands mid-stream
					return nil
				})
			}
			count := func(name string) int {
				mu.Lock()
				defer mu.Unlock()
				return len(handled[name])
			}
			first := f.consume(handler("first"), ConsumeOptions{Workers: 1})
			require.Eventually(t, func() bool { return count("first") > 0 }, 20*time.Second, time.Millisecond)

			// The second consumer, in a process of its own, waits.
			var r [4]byte
			_, _ = rand.Read(r[:])
			var url string
			if f.mem != nil {
				url = f.mem.URL()
			} else {
				url = testenv.RabbitMQURL(t)
			}
			b2 := New(url, Options{Process: "second-" + hex.EncodeToString(r[:]) + "[2]", ReconnectMax: 100 * time.Millisecond})
			defer b2.Close()
			ctx2, cancel2 := context.WithCancel(context.Background())
			done2 := make(chan error, 1)
			go func() { done2 <- b2.Consume(ctx2, f.q, handler("second"), ConsumeOptions{Workers: 1, Topology: f.top}) }()
			defer func() {
				cancel2()
				assert.NoError(t, <-done2)
			}()

			require.Eventually(t, func() bool { return count("first") >= n/3 }, 30*time.Second, time.Millisecond)
			assert.Zero(t, count("second"), "the second consumer got messages while the first lived")
			// Kill the first: it stops (a killed process does not come
			// back), and its connection is cut under it.
			first.cancel()
			f.be.drop(t, f.mem, f.process)
			require.NoError(t, first.wait(t, time.Minute))

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
