package rabbitmw_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/errtest"
	"github.com/rabbitmw/rabbitmw/rabbitmwtest"
)

var errBoom = errors.New("boom")

func TestDecide(t *testing.T) {
	tests := []struct {
		name         string
		err          error
		wantOutcome  rabbitmw.Outcome
		wantDelay    time.Duration
		wantAttempts int
	}{
		{"nil acks", nil, rabbitmw.Ack, 0, 0},
		{"an ordinary error requeues", errBoom, rabbitmw.Requeue, 0, 0},
		{"a duplicate acks", fmt.Errorf("x: %w", rabbitmw.ErrDuplicate), rabbitmw.Duplicate, 0, 0},
		{"permanent dead-letters", rabbitmw.Permanent(errBoom), rabbitmw.DeadLetter, 0, 0},
		{"wrapped permanent dead-letters", fmt.Errorf("ctx: %w", rabbitmw.Permanent(errBoom)), rabbitmw.DeadLetter, 0, 0},
		{"retry after delays", rabbitmw.RetryAfter(errBoom, time.Second), rabbitmw.Delay, time.Second, 0},
		{"retry after zero requeues", rabbitmw.RetryAfter(errBoom, 0), rabbitmw.Requeue, 0, 0},
		{"retry after negative requeues", rabbitmw.RetryAfter(errBoom, -time.Second), rabbitmw.Requeue, 0, 0},
		{"outer permanent wins", rabbitmw.Permanent(rabbitmw.RetryAfter(errBoom, time.Second)), rabbitmw.DeadLetter, 0, 0},
		{"outer delay wins", rabbitmw.RetryAfter(rabbitmw.Permanent(errBoom), time.Second), rabbitmw.Delay, time.Second, 0},
		{"a marker beats a duplicate", rabbitmw.RetryAfter(rabbitmw.ErrDuplicate, time.Second), rabbitmw.Delay, time.Second, 0},
		{"attempts are read", rabbitmw.RetryAfter(rabbitmw.WithAttempts(errBoom, 3), time.Second), rabbitmw.Delay, time.Second, 3},
		{"attempts outside the marker", rabbitmw.WithAttempts(rabbitmw.Permanent(errBoom), 5), rabbitmw.DeadLetter, 0, 5},
		{"joined errors: the first marker", errors.Join(errBoom, rabbitmw.Permanent(errBoom)), rabbitmw.DeadLetter, 0, 0},
		{"a panic requeues", &rabbitmw.PanicError{Value: "x"}, rabbitmw.Requeue, 0, 0},
		{"a panic with a permanent value dead-letters", &rabbitmw.PanicError{Value: rabbitmw.Permanent(errBoom)}, rabbitmw.DeadLetter, 0, 0},
		{"a panic with a delay value delays", &rabbitmw.PanicError{Value: rabbitmw.RetryAfter(errBoom, time.Second)}, rabbitmw.Delay, time.Second, 0},
		{"a panic with a duplicate value is no duplicate", &rabbitmw.PanicError{Value: fmt.Errorf("x: %w", rabbitmw.ErrDuplicate)}, rabbitmw.Requeue, 0, 0},
		{"a duplicate beside a panic acks", errors.Join(&rabbitmw.PanicError{Value: "x"}, rabbitmw.ErrDuplicate), rabbitmw.Duplicate, 0, 0},
		{"not counted requeues", rabbitmw.NotCounted(errBoom), rabbitmw.Requeue, 0, 0},
		{"not counted in a delay delays", rabbitmw.RetryAfter(rabbitmw.NotCounted(errBoom), time.Second), rabbitmw.Delay, time.Second, 0},
		{"a delay not counted delays", rabbitmw.NotCounted(rabbitmw.RetryAfter(errBoom, time.Second)), rabbitmw.Delay, time.Second, 0},
		{"permanent not counted dead-letters", rabbitmw.NotCounted(rabbitmw.Permanent(errBoom)), rabbitmw.DeadLetter, 0, 0},
		{"a duplicate not counted acks", rabbitmw.NotCounted(rabbitmw.ErrDuplicate), rabbitmw.Duplicate, 0, 0},
	}
	for _, tt := range tests {
		got := rabbitmw.Decide(tt.err)
		if got.Outcome != tt.wantOutcome || got.Delay != tt.wantDelay || got.Attempts != tt.wantAttempts || got.Err != tt.err {
			t.Errorf("%s: Decide(%v) = %+v; want %v after %v, attempts %d", tt.name, tt.err, got, tt.wantOutcome, tt.wantDelay, tt.wantAttempts)
		}
	}
}

func TestMarkersKeepText(t *testing.T) {
	for _, err := range []error{rabbitmw.Permanent(errBoom), rabbitmw.RetryAfter(errBoom, time.Second), rabbitmw.WithAttempts(errBoom, 2), rabbitmw.NotCounted(errBoom)} {
		if err.Error() != "boom" || !errors.Is(err, errBoom) {
			t.Errorf("marker %#v: text %q, Is(errBoom) %v; want \"boom\", true", err, err.Error(), errors.Is(err, errBoom))
		}
	}
	for _, err := range []error{rabbitmw.Permanent(nil), rabbitmw.RetryAfter(nil, time.Second), rabbitmw.WithAttempts(nil, 1), rabbitmw.NotCounted(nil)} {
		assert.NoError(t, err, "a marker of nil")
	}
}

// The marks of an error whose Error method panics (a nil pointer, or any
// value) have a text all the same, naming its type: Log and the broker
// read it outside the handler, where a panic is no failed attempt.
func TestMarkersOfAnErrorWhoseTextPanics(t *testing.T) {
	for _, c := range errtest.Cases() {
		for _, err := range []error{rabbitmw.Permanent(c.Err), rabbitmw.RetryAfter(c.Err, time.Second), rabbitmw.WithAttempts(c.Err, 2), rabbitmw.NotCounted(c.Err)} {
			var got string
			require.NotPanics(t, func() { got = err.Error() }, "text of %T over %T", err, c.Err)
			assert.Equal(t, c.Text, got, "text of %T over %T", err, c.Err)
		}
	}
}

func TestIsNotCounted(t *testing.T) {
	limited := rabbitmw.NotCounted(errors.New("rate limited"))
	for _, tt := range []struct {
		err  error
		want bool
	}{
		{nil, false},
		{errBoom, false},
		{limited, true},
		{fmt.Errorf("ctx: %w", limited), true},
		{rabbitmw.RetryAfter(limited, time.Second), true},
		{rabbitmw.Permanent(rabbitmw.WithAttempts(limited, 2)), true},
		{errors.Join(errBoom, limited), true},
		{&rabbitmw.PanicError{Value: limited}, false},
		{errors.Join(&rabbitmw.PanicError{Value: limited}, limited), true},
		{rabbitmw.RetryAfter(errBoom, time.Second), false},
		{rabbitmw.Permanent(errBoom), false},
	} {
		if got := rabbitmw.IsNotCounted(tt.err); got != tt.want {
			t.Errorf("IsNotCounted(%v) = %v; want %v", tt.err, got, tt.want)
		}
	}
}

func TestOutcomeString(t *testing.T) {
	want := map[rabbitmw.Outcome]string{
		rabbitmw.Ack: "acked", rabbitmw.Duplicate: "duplicate", rabbitmw.Requeue: "requeued",
		rabbitmw.Delay: "delayed", rabbitmw.DeadLetter: "dead-lettered", 0: "Outcome(0)",
	}
	for o, s := range want {
		if o.String() != s {
			t.Errorf("Outcome(%d).String() = %q; want %q", int(o), o.String(), s)
		}
	}
}

func TestSettle(t *testing.T) {
	closed := errors.New("channel closed")
	tests := []struct {
		name     string
		err      error
		cancel   bool  // ctx done before Settle
		ackErr   error // the Acknowledger's error
		want     rabbitmwtest.Call
		wantWait time.Duration // Settle must take at least this long
		wantErr  error
	}{
		{name: "success acks", want: rabbitmwtest.Call{Method: "ack", Tag: 1}},
		{name: "duplicate acks", err: rabbitmw.ErrDuplicate, want: rabbitmwtest.Call{Method: "ack", Tag: 1}},
		{name: "error requeues", err: errBoom, want: rabbitmwtest.Call{Method: "nack", Tag: 1, Requeue: true}},
		{name: "permanent rejects without requeue", err: rabbitmw.Permanent(errBoom), want: rabbitmwtest.Call{Method: "reject", Tag: 1}},
		{
			name: "delay waits, then requeues", err: rabbitmw.RetryAfter(errBoom, 60*time.Millisecond),
			want: rabbitmwtest.Call{Method: "nack", Tag: 1, Requeue: true}, wantWait: 60 * time.Millisecond,
		},
		{
			name: "delay cut by ctx requeues at once", err: rabbitmw.RetryAfter(errBoom, time.Hour), cancel: true,
			want: rabbitmwtest.Call{Method: "nack", Tag: 1, Requeue: true}, wantErr: context.Canceled,
		},
		{name: "a settle error is returned", ackErr: closed, want: rabbitmwtest.Call{Method: "ack", Tag: 1}, wantErr: closed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := rabbitmwtest.NewRecorder()
			rec.Err = tt.ackErr
			d := rec.Deliver(amqp.Publishing{MessageId: "m1"})
			ctx, cancel := context.WithCancel(context.Background())
			if tt.cancel {
				cancel()
			}
			defer cancel()
			start := time.Now()
			err := rabbitmw.Settle(ctx, d, tt.err)
			if elapsed := time.Since(start); elapsed < tt.wantWait {
				t.Errorf("Settle returned after %v; want at least %v", elapsed, tt.wantWait)
			}
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil) != (err == nil) {
				t.Errorf("Settle = %v; want %v", err, tt.wantErr)
			}
			if calls := rec.Calls(); len(calls) != 1 || calls[0] != tt.want {
				t.Errorf("calls = %v; want exactly [%v]", calls, tt.want)
			}
		})
	}
}

func TestSettleNilDelivery(t *testing.T) {
	require.ErrorIs(t, rabbitmw.Settle(context.Background(), nil, nil), rabbitmw.ErrNoDelivery, "Settle(nil)")
}

func TestSettleNilContext(t *testing.T) {
	rec := rabbitmwtest.NewRecorder()
	d := rec.Deliver(amqp.Publishing{})
	var ctx context.Context // nil: bad input that Settle must survive
	require.NoError(t, rabbitmw.Settle(ctx, d, rabbitmw.RetryAfter(errBoom, time.Millisecond)))
	if got := rec.Settlement(1); got != "requeued" {
		t.Fatalf("settled %s; want requeued", got)
	}
}

func TestPriorAttempts(t *testing.T) {
	tests := []struct {
		value any
		want  int
	}{
		{int8(3), 3}, {int16(3), 3}, {int32(3), 3}, {int64(3), 3}, {int(3), 3},
		{uint8(3), 3}, {uint16(3), 3}, {uint32(3), 3}, {uint64(3), 3},
		{float32(3), 3}, {float64(3), 3}, {"3", 3}, {" 3 ", 3}, {[]byte("3"), 3},
		{int64(-2), 0}, {float64(2.5), 0}, {math.NaN(), 0}, {math.Inf(1), 1 << 30},
		{"three", 0}, {"", 0}, {true, 0}, {nil, 0}, {[]any{int32(3)}, 0}, {amqp.Table{"n": 3}, 0},
		{time.Now(), 0}, {amqp.Decimal{Scale: 0, Value: 3}, 0},
		{uint64(math.MaxUint64), 1 << 30}, {int64(math.MaxInt64), 1 << 30}, {"99999999999999999999", 0},
	}
	for _, tt := range tests {
		d := &amqp.Delivery{Headers: amqp.Table{rabbitmw.HeaderAttempts: tt.value}}
		if got := rabbitmw.PriorAttempts(d); got != tt.want {
			t.Errorf("PriorAttempts(%T %v) = %d; want %d", tt.value, tt.value, got, tt.want)
		}
	}
	if got := rabbitmw.PriorAttempts(&amqp.Delivery{}); got != 0 {
		t.Errorf("PriorAttempts without headers = %d; want 0", got)
	}
	if got := rabbitmw.PriorAttempts(nil); got != 0 {
		t.Errorf("PriorAttempts(nil) = %d; want 0", got)
	}
}

// The parser must never panic nor return a negative or huge count,
// whatever bytes a header holds.
func FuzzPriorAttempts(f *testing.F) {
	for _, seed := range []string{"0", "5", "-1", " 7", "1e3", "0x10", "9223372036854775808", "", "\x00"} {
		f.Add(seed, int64(0), 0.0)
	}
	f.Add("", int64(-1<<63), math.Inf(-1))
	f.Fuzz(func(t *testing.T, s string, i int64, x float64) {
		for _, v := range []any{s, []byte(s), i, int32(i), uint64(i), x, float32(x)} {
			n := rabbitmw.PriorAttempts(&amqp.Delivery{Headers: amqp.Table{rabbitmw.HeaderAttempts: v}})
			if n < 0 || n > 1<<30 {
				t.Fatalf("PriorAttempts(%T %v) = %d; want within [0, 2^30]", v, v, n)
			}
		}
	})
}
