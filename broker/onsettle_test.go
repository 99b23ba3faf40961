package broker

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
)

// OnSettle hears of every settlement once, with what was done.
func TestOnSettle(t *testing.T) {
	f := setup(t, backends[0], Topology{})
	var (
		mu   sync.Mutex
		seen = map[string][]rabbitmw.Outcome{}
	)
	for _, id := range []string{"ok", "dead", "later"} {
		f.publish(id, []byte("x"), nil)
	}
	var laterOnce sync.Once
	h := rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		switch d.MessageId {
		case "dead":
			return rabbitmw.Permanent(errors.New("bad"))
		case "later":
			var err error
			laterOnce.Do(func() { err = rabbitmw.RetryAfter(errors.New("busy"), 50*time.Millisecond) })
			return err
		}
		return nil
	})
	f.consume(h, ConsumeOptions{OnSettle: func(d *amqp.Delivery, o rabbitmw.Outcome, err error) {
		assert.NoError(t, err, "OnSettle(%s, %v) with error", d.MessageId, o)
		mu.Lock()
		seen[d.MessageId] = append(seen[d.MessageId], o)
		mu.Unlock()
	}})
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen["ok"]) == 1 && len(seen["dead"]) == 1 && len(seen["later"]) == 2
	}, 10*time.Second, 10*time.Millisecond, "every message settled for good")
	mu.Lock()
	defer mu.Unlock()
	want := map[string][]rabbitmw.Outcome{
		"ok":    {rabbitmw.Ack},
		"dead":  {rabbitmw.DeadLetter},
		"later": {rabbitmw.Delay, rabbitmw.Ack},
	}
	for id, w := range want {
		assert.Equal(t, w, seen[id], "outcomes of "+id)
	}
}

// A not-before header far in the future is corrupt, not a delay: the
// message is dead-lettered with the reason instead of cycling through the
// delay queues for ever, and the handler never sees it.
func TestCorruptNotBeforeIsDeadLettered(t *testing.T) {
	f := setup(t, backends[0], Topology{})
	f.publish("far", []byte("x"), amqp.Table{HeaderNotBefore: time.Now().Add(30 * 24 * time.Hour).UnixMilli()})
	soon := time.Now().Add(100 * time.Millisecond)
	f.publish("soon", []byte("x"), amqp.Table{HeaderNotBefore: soon.UnixMilli()})
	var mu sync.Mutex
	handled := map[string]time.Time{}
	f.consume(rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
		mu.Lock()
		handled[d.MessageId] = time.Now()
		mu.Unlock()
		return nil
	}), ConsumeOptions{})
	require.Eventually(t, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return f.polledLength(f.q+".dlq") == 1 && !handled["soon"].IsZero()
	}, 10*time.Second, 10*time.Millisecond, "far not dead-lettered, soon not handled")
	mu.Lock()
	defer mu.Unlock()
	if _, ok := handled["far"]; ok {
		t.Error("the message with a corrupt not-before was handled; want it dead-lettered unhandled")
	}
	if at := handled["soon"]; at.Before(soon.Truncate(time.Millisecond)) {
		t.Errorf("soon handled %v before its not-before; want no sooner", soon.Sub(at))
	}
	dead := f.drain(f.q + ".dlq")
	if len(dead) != 1 || dead[0].MessageId != "far" {
		t.Fatalf("dead-letter queue = %v; want far alone", dead)
	}
	assert.Contains(t, dead[0].Headers[HeaderError].(string), "beyond the 168h0m0s a delay may last", "reason")
}
