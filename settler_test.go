package rabbitmw_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
)

var (
	requeued = func(tag uint64) rabbitmwtest.Call {
		return rabbitmwtest.Call{Method: "nack", Tag: tag, Requeue: true}
	}
	acked = func(tag uint64) rabbitmwtest.Call { return rabbitmwtest.Call{Method: "ack", Tag: tag} }
)

// wantCalls fails t unless rec received exactly want, in that order.
func wantCalls(t *testing.T, when string, rec *rabbitmwtest.Recorder, want ...rabbitmwtest.Call) {
	t.Helper()
	if got := rec.Calls(); !slices.Equal(got, want) {
		t.Fatalf("%s: calls = %v; want %v", when, got, want)
	}
}

// settleAsync runs s.Settle in a goroutine and returns a channel that
// receives its result.
func settleAsync(ctx context.Context, s *rabbitmw.Settler, d *amqp.Delivery, err error) <-chan error {
	done := make(chan error, 1)
	go func() { done <- s.Settle(ctx, d, err) }()
	return done
}

// returned reports whether done has a result, and the result.
func returned(done <-chan error) (bool, error) {
	select {
	case err := <-done:
		return true, err
	default:
		return false, nil
	}
}

// The outcomes that need no waiting settle in the caller's goroutine, at
// once, as Settle does.
func TestSettlerSettlesAtOnce(t *testing.T) {
	closed := errors.New("channel closed")
	tests := []struct {
		name    string
		err     error
		ackErr  error
		want    rabbitmwtest.Call
		wantErr error
	}{
		{name: "success acks", want: acked(1)},
		{name: "duplicate acks", err: fmt.Errorf("seen: %w", rabbitmw.ErrDuplicate), want: acked(1)},
		{name: "error requeues", err: errBoom, want: requeued(1)},
		{name: "retry after zero requeues", err: rabbitmw.RetryAfter(errBoom, 0), want: requeued(1)},
		{name: "permanent dead-letters", err: rabbitmw.Permanent(errBoom), want: rabbitmwtest.Call{Method: "reject", Tag: 1}},
		{name: "a settle error is returned", ackErr: closed, want: acked(1), wantErr: closed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
				defer s.Close()
				rec := rabbitmwtest.NewRecorder()
				rec.Err = tt.ackErr
				d := rec.Deliver(amqp.Publishing{})
				start := time.Now()
				err := s.Settle(context.Background(), d, tt.err)
				if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
					t.Errorf("Settle = %v; want %v", err, tt.wantErr)
				}
				if d := time.Since(start); d != 0 {
					t.Errorf("Settle took %v; want no time", d)
				}
				wantCalls(t, "after Settle", rec, tt.want)
			})
		})
	}
}

// A serial loop is not held up by delayed deliveries: each is held off the
// loop for its delay, then requeued; the deliveries after it settle at once.
func TestSettlerHoldsDelaysOffTheLoop(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
		defer s.Close()
		rec := rabbitmwtest.NewRecorder()
		results := []error{
			rabbitmw.RetryAfter(errBoom, 5*time.Second), // busy
			nil,
			rabbitmw.RetryAfter(errBoom, time.Minute), // a backoff
			nil,
		}
		start := time.Now()
		for _, res := range results {
			d := rec.Deliver(amqp.Publishing{})
			require.NoError(t, s.Settle(context.Background(), d, res), "Settle(%d)", d.DeliveryTag)
		}
		if d := time.Since(start); d != 0 {
			t.Fatalf("the loop took %v; want no time", d)
		}
		wantCalls(t, "after the loop", rec, acked(2), acked(4))

		time.Sleep(5*time.Second - time.Nanosecond)
		synctest.Wait()
		wantCalls(t, "just before 5s", rec, acked(2), acked(4))
		time.Sleep(time.Nanosecond)
		synctest.Wait()
		wantCalls(t, "at 5s", rec, acked(2), acked(4), requeued(1))
		time.Sleep(time.Minute - 5*time.Second)
		synctest.Wait()
		wantCalls(t, "at 1m", rec, acked(2), acked(4), requeued(1), requeued(3))
	})
}

// At MaxHeld, Settle waits for room rather than requeue at once: a requeue
// at once would bring the message straight back, in a hot loop.
func TestSettlerBlocksAtMaxHeld(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{MaxHeld: 1})
		defer s.Close()
		rec := rabbitmwtest.NewRecorder()
		d1, d2 := rec.Deliver(amqp.Publishing{}), rec.Deliver(amqp.Publishing{})
		start := time.Now()
		require.NoError(t, s.Settle(context.Background(), d1, rabbitmw.RetryAfter(errBoom, 10*time.Second)))
		done := settleAsync(context.Background(), s, d2, rabbitmw.RetryAfter(errBoom, time.Second))
		synctest.Wait()
		if ok, _ := returned(done); ok {
			t.Fatal("Settle returned with MaxHeld deliveries held; want it to wait for room")
		}
		wantCalls(t, "while full", rec)

		time.Sleep(10 * time.Second)
		synctest.Wait()
		ok, err := returned(done)
		if !ok || err != nil {
			t.Fatalf("when d1 was requeued: Settle(d2) returned %v, %v; want true, nil", ok, err)
		}
		wantCalls(t, "at 10s", rec, requeued(1))
		time.Sleep(time.Second)
		synctest.Wait()
		wantCalls(t, "at 11s", rec, requeued(1), requeued(2))
		if d := time.Since(start); d != 11*time.Second {
			t.Errorf("done after %v; want 11s", d)
		}
	})
}

// ctx bounds the wait for room: when it is done first, the delivery is
// requeued at once and ctx's error returned.
func TestSettlerContextEndsTheWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{MaxHeld: 1})
		defer s.Close()
		rec := rabbitmwtest.NewRecorder()
		d1, d2 := rec.Deliver(amqp.Publishing{}), rec.Deliver(amqp.Publishing{})
		require.NoError(t, s.Settle(context.Background(), d1, rabbitmw.RetryAfter(errBoom, time.Minute)))
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		start := time.Now()
		err := s.Settle(ctx, d2, rabbitmw.RetryAfter(errBoom, time.Second))
		assert.ErrorIs(t, err, context.DeadlineExceeded, "Settle")
		if d := time.Since(start); d != 2*time.Second {
			t.Errorf("Settle returned after %v; want 2s, the deadline", d)
		}
		wantCalls(t, "at the deadline", rec, requeued(2))

		// A done ctx does not matter when there is room.
		d3 := rec.Deliver(amqp.Publishing{})
		s2 := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
		defer s2.Close()
		assert.NoError(t, s2.Settle(ctx, d3, rabbitmw.RetryAfter(errBoom, time.Second)), "Settle with room and a done ctx")
		wantCalls(t, "with room", rec, requeued(2))
		time.Sleep(time.Second)
		synctest.Wait()
		wantCalls(t, "a second later", rec, requeued(2), requeued(3))
	})
}

// Close requeues every held delivery at once, ends the wait of a Settle
// for room, and leaves nothing behind: no timer fires after it.
func TestSettlerClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{MaxHeld: 1})
		rec := rabbitmwtest.NewRecorder()
		d1, d2 := rec.Deliver(amqp.Publishing{}), rec.Deliver(amqp.Publishing{})
		require.NoError(t, s.Settle(context.Background(), d1, rabbitmw.RetryAfter(errBoom, time.Hour)))
		waiting := settleAsync(context.Background(), s, d2, rabbitmw.RetryAfter(errBoom, time.Hour))
		synctest.Wait()

		start := time.Now()
		s.Close()
		if d := time.Since(start); d != 0 {
			t.Errorf("Close took %v; want no time", d)
		}
		synctest.Wait()
		ok, err := returned(waiting)
		if !ok || !errors.Is(err, rabbitmw.ErrSettlerClosed) {
			t.Errorf("the waiting Settle returned %v, %v; want true, ErrSettlerClosed", ok, err)
		}
		got := rec.Calls()
		slices.SortFunc(got, func(a, b rabbitmwtest.Call) int { return int(a.Tag) - int(b.Tag) })
		if want := []rabbitmwtest.Call{requeued(1), requeued(2)}; !slices.Equal(got, want) {
			t.Fatalf("after Close: calls = %v; want %v", got, want)
		}

		// After Close, a delay is requeued at once; the rest settles as ever.
		d3, d4 := rec.Deliver(amqp.Publishing{}), rec.Deliver(amqp.Publishing{})
		assert.ErrorIs(t, s.Settle(context.Background(), d3, rabbitmw.RetryAfter(errBoom, time.Hour)), rabbitmw.ErrSettlerClosed, "Settle after Close")
		assert.NoError(t, s.Settle(context.Background(), d4, nil), "Settle(nil) after Close")
		s.Close() // a second Close is harmless
		time.Sleep(2 * time.Hour)
		synctest.Wait()
		if got := rec.Calls()[2:]; !slices.Equal(got, []rabbitmwtest.Call{requeued(3), acked(4)}) {
			t.Errorf("after Close and 2h: later calls = %v; want [%v %v]", got, requeued(3), acked(4))
		}
	})
}

// gate is a Recorder whose Nack waits until the gate opens.
type gate struct {
	*rabbitmwtest.Recorder
	open chan struct{}
}

func (g gate) Nack(tag uint64, multiple, requeue bool) error {
	<-g.open
	return g.Recorder.Nack(tag, multiple, requeue)
}

// Close returns only when the requeues in progress have returned.
func TestSettlerCloseWaitsForRequeues(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
		g := gate{rabbitmwtest.NewRecorder(), make(chan struct{})}
		d := g.Deliver(amqp.Publishing{})
		d.Acknowledger = g
		require.NoError(t, s.Settle(context.Background(), d, rabbitmw.RetryAfter(errBoom, time.Second)))
		time.Sleep(time.Second)
		synctest.Wait() // the requeue has started, and waits at the gate
		closed := make(chan struct{})
		go func() { s.Close(); close(closed) }()
		synctest.Wait()
		select {
		case <-closed:
			t.Fatal("Close returned while a requeue was in progress")
		default:
		}
		close(g.open)
		<-closed
		wantCalls(t, "after Close", g.Recorder, requeued(1))
	})
}

// A requeue that fails after Settle returned is reported to OnError, from
// a timer or from Close.
func TestSettlerOnError(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		closed := errors.New("channel closed")
		var mu sync.Mutex
		var reported []string
		s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{OnError: func(d *amqp.Delivery, err error) {
			mu.Lock()
			defer mu.Unlock()
			if !errors.Is(err, closed) {
				t.Errorf("OnError(%d, %v); want an error wrapping %v", d.DeliveryTag, err, closed)
			}
			reported = append(reported, fmt.Sprint(d.DeliveryTag, " ", err))
		}})
		rec := rabbitmwtest.NewRecorder()
		rec.Err = closed
		d1, d2 := rec.Deliver(amqp.Publishing{}), rec.Deliver(amqp.Publishing{})
		for _, d := range []*amqp.Delivery{d1, d2} {
			delay := time.Duration(d.DeliveryTag) * time.Minute
			if err := s.Settle(context.Background(), d, rabbitmw.RetryAfter(errBoom, delay)); err != nil {
				t.Fatalf("Settle(%d) = %v; want nil, the requeue is later", d.DeliveryTag, err)
			}
		}
		time.Sleep(time.Minute)
		synctest.Wait()
		s.Close()
		want := []string{
			"1 rabbitmw: settle delivery 1 as delayed: channel closed",
			"2 rabbitmw: settle delivery 2 as delayed: channel closed",
		}
		if !slices.Equal(reported, want) {
			t.Errorf("reported %q; want %q", reported, want)
		}
		wantCalls(t, "after Close", rec, requeued(1), requeued(2))
	})
}

// Many goroutines may share one Settler; each delivery is settled exactly
// once, and Close ends everything.
func TestSettlerConcurrent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{MaxHeld: 7})
		rec := rabbitmwtest.NewRecorder()
		const loops, each = 8, 50
		var wg sync.WaitGroup
		for l := range loops {
			wg.Go(func() {
				for i := range each {
					d := rec.Deliver(amqp.Publishing{})
					var err error
					switch (l + i) % 4 {
					case 1:
						err = errBoom
					case 2, 3:
						err = rabbitmw.RetryAfter(errBoom, time.Duration(1+(l*each+i)%13)*time.Second)
					}
					if serr := s.Settle(context.Background(), d, err); serr != nil {
						t.Errorf("Settle(%d) = %v", d.DeliveryTag, serr)
					}
				}
			})
		}
		wg.Wait()
		s.Close()
		for tag := uint64(1); tag <= loops*each; tag++ {
			if got := rec.Settlement(tag); got != "acked" && got != "requeued" {
				t.Errorf("delivery %d: %s; want settled once", tag, got)
			}
		}
	})
}

// Close ends every goroutine of a Settler, in real time too.
func TestSettlerCloseLeavesNoGoroutine(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{MaxHeld: 1})
	rec := rabbitmwtest.NewRecorder()
	require.NoError(t, s.Settle(context.Background(), rec.Deliver(amqp.Publishing{}), rabbitmw.RetryAfter(errBoom, time.Hour)))
	waiting := settleAsync(context.Background(), s, rec.Deliver(amqp.Publishing{}), rabbitmw.RetryAfter(errBoom, time.Hour))
	s.Close()
	assert.ErrorIs(t, <-waiting, rabbitmw.ErrSettlerClosed, "the waiting Settle")
	if rec.Settlement(1) != "requeued" || rec.Settlement(2) != "requeued" {
		t.Errorf("calls = %v; want both requeued", rec.Calls())
	}
}

func TestSettlerBadInput(t *testing.T) {
	s := rabbitmw.NewSettler(rabbitmw.SettlerOptions{})
	defer s.Close()
	assert.ErrorIs(t, s.Settle(context.Background(), nil, nil), rabbitmw.ErrNoDelivery, "Settle(nil)")
	rec := rabbitmwtest.NewRecorder()
	var ctx context.Context // nil: bad input that Settle must survive
	assert.NoError(t, s.Settle(ctx, rec.Deliver(amqp.Publishing{}), rabbitmw.RetryAfter(errBoom, time.Hour)), "Settle with a nil ctx")
	defer func() {
		if v, _ := recover().(string); !strings.HasPrefix(v, "rabbitmw: NewSettler") {
			t.Errorf("NewSettler with MaxHeld -1 recovered %q; want a rabbitmw: NewSettler panic", v)
		}
	}()
	rabbitmw.NewSettler(rabbitmw.SettlerOptions{MaxHeld: -1})
}
