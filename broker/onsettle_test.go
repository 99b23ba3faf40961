package broker

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

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
		if err != nil {
			t.Errorf("OnSettle(%s, %v) with error %v", d.MessageId, o, err)
		}
		mu.Lock()
		seen[d.MessageId] = append(seen[d.MessageId], o)
		mu.Unlock()
	}})
	eventually(t, 10*time.Second, "every message settled for good", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(seen["ok"]) == 1 && len(seen["dead"]) == 1 && len(seen["later"]) == 2
	})
	mu.Lock()
	defer mu.Unlock()
	want := map[string][]rabbitmw.Outcome{
		"ok":    {rabbitmw.Ack},
		"dead":  {rabbitmw.DeadLetter},
		"later": {rabbitmw.Delay, rabbitmw.Ack},
	}
	for id, w := range want {
		equal(t, "outcomes of "+id, seen[id], w)
	}
}
