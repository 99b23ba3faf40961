package e2e_test

// A consumer stopped gracefully cancels its handlers' context at its
// shutdown deadline. A handler that returns then leaves its layers to
// record its result (Dedup's done mark), which may take the store longer
// than usual (a Redis failing over, a PostgreSQL commit waiting on its
// disk). The process exits once Consume returns: whatever was still being
// recorded then is lost as if the process had been killed, and the
// message's effect repeats.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/broker/brokertest"
	"github.com/rabbitmw/rabbitmw/store"
)

// slowCompleteStore is a process's view of the shared store whose done
// marks are slow to be written: a call that the process has not finished
// writing when it dies never reaches the store.
type slowCompleteStore struct {
	*mortalStore
	slow time.Duration
}

func (s *slowCompleteStore) Complete(ctx context.Context, key, token string, retention time.Duration) error {
	select {
	case <-time.After(s.slow):
	case <-ctx.Done():
		return ctx.Err()
	}
	return s.mortalStore.Complete(ctx, key, token, retention)
}

// A handler that returns at the shutdown deadline, with a store that takes
// longer than a second to write its done mark: Consume must not return
// (and let the process exit) before the mark is written, well within the
// lease that bounds it, or the next consumer finds the claim abandoned and
// runs the handler again.
func TestGracefulStopWaitsForTheDoneMark(t *testing.T) {
	const (
		lease = 4 * time.Second
		slow  = 1500 * time.Millisecond // longer than Consume's grace after the deadline
	)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	srv := brokertest.NewServer()
	t.Cleanup(srv.Close)
	b := broker.New(srv.URL(), broker.Options{})
	t.Cleanup(func() { b.Close() })
	top := broker.Topology{Delays: []time.Duration{50 * time.Millisecond}}
	queue := fmt.Sprintf("rabbitmw-graceful-mark-%d", time.Now().UnixNano())
	require.NoError(t, b.Declare(ctx, queue, top))
	require.NoError(t, b.Publish(ctx, "", queue, amqp.Publishing{MessageId: "m1", Body: []byte("x")}))

	shared := store.NewMemory()
	var effects atomic.Int64

	// The first process: its handler has the effect, and returns when its
	// context is cancelled at the shutdown deadline.
	first := &slowCompleteStore{mortalStore: &mortalStore{Store: shared}, slow: slow}
	started := make(chan struct{})
	var chains sync.WaitGroup // the first process's handler, which Consume may leave running
	h1 := deathStack(first, lease)(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
		effects.Add(1)
		close(started)
		<-ctx.Done()
		return nil
	}))
	pctx, stop := context.WithCancel(ctx)
	consumed := make(chan error, 1)
	go func() {
		consumed <- b.Consume(pctx, queue, rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			chains.Add(1)
			defer chains.Done()
			return h1.Handle(ctx, d)
		}), broker.ConsumeOptions{Topology: top, Workers: 1, ShutdownTimeout: 50 * time.Millisecond})
	}()
	select {
	case <-started:
	case <-ctx.Done():
		t.Fatal("the first consumer never ran its handler")
	}
	stop() // SIGTERM
	stopErr := <-consumed
	first.kill() // Consume has returned: the process exits
	t.Logf("the first consumer returned %v", stopErr)
	chains.Wait()

	// The next process takes the queue over, if the message is still
	// there (its connection gone, the server requeued it).
	names, err := top.Queues(queue)
	require.NoError(t, err)
	left := 0
	for _, q := range append([]string{names.Work}, names.Delays...) {
		n, err := b.Len(ctx, q)
		require.NoError(t, err)
		left += n
	}
	if left == 0 {
		assert.Equal(t, int64(1), effects.Load(), "effects of m1")
		return
	}
	settled := make(chan rabbitmw.Outcome, 16)
	h2 := deathStack(shared, lease)(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error {
		effects.Add(1)
		return nil
	}))
	nctx, stopNext := context.WithCancel(ctx)
	next := make(chan error, 1)
	go func() {
		next <- b.Consume(nctx, queue, h2, broker.ConsumeOptions{Topology: top, Workers: 1,
			OnSettle: func(_ *amqp.Delivery, o rabbitmw.Outcome, _ error) { settled <- o }})
	}()
	defer func() {
		stopNext()
		assert.NoError(t, <-next)
	}()
	for done := false; !done; {
		select {
		case o := <-settled:
			done = o == rabbitmw.Ack || o == rabbitmw.Duplicate || o == rabbitmw.DeadLetter
		case <-ctx.Done():
			t.Fatal("the message never left the queue")
		}
	}
	assert.Equal(t, int64(1), effects.Load(), "effects of m1: its done mark was lost when the stopped consumer's process exited")
}
