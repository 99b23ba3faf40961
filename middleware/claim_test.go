package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// A handler that marks its key done itself (in its own transaction) tells
// Dedup through the Claim, and Dedup writes no second done mark.
func TestClaimMarkedDone(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name         string
		markedDone   bool
		result       error
		wantComplete int64
		wantIs       error
	}{
		{name: "Dedup marks done", markedDone: false, wantComplete: 1},
		{name: "handler marked done itself", markedDone: true, wantComplete: 0},
		{name: "handler marked done, then failed", markedDone: true, result: errBoom, wantComplete: 0, wantIs: errBoom},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := &faultyStore{Store: store.NewMemory()}
			opts := middleware.DedupOptions{Retention: 42 * time.Minute}
			var got *middleware.Claim
			h := rabbitmw.Chain(middleware.Keys(middleware.Keying{Namespace: "ns"}), middleware.Dedup(s, opts))(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
				c, ok := middleware.ClaimFrom(ctx)
				require.True(t, ok, "ClaimFrom(handler's context) found no claim")
				got = c
				if tt.markedDone {
					// What a transactional handler does in its commit.
					require.NoError(t, s.Store.Complete(ctx, c.Key(), c.Token(), c.Retention()), "Complete by the handler")
					c.MarkedDone()
				}
				return tt.result
			}))
			d, _ := deliverytest.New("m1", "body")
			err := h.Handle(ctx, d)
			if tt.wantIs == nil {
				require.NoError(t, err)
			} else {
				require.ErrorIs(t, err, tt.wantIs)
			}
			assert.Equal(t, "ns:m1", got.Key())
			assert.NotEmpty(t, got.Token())
			assert.Equal(t, 42*time.Minute, got.Retention())
			assert.Equal(t, tt.wantComplete, s.Calls("complete"), "Dedup's Complete calls")
			st, err := s.Claim(ctx, "ns:m1", "stranger", time.Minute)
			require.NoError(t, err)
			assert.Equal(t, store.Done, st, "Claim afterwards")
		})
	}
}

func TestClaimFromWithoutDedup(t *testing.T) {
	c, ok := middleware.ClaimFrom(context.Background())
	assert.False(t, ok)
	assert.Nil(t, c)
}

// A handler that Dedup runs without a claim, with FailOpen while its
// store is out of reach, finds the store's error in its context; one
// under a claim, or beneath no Dedup, finds none.
func TestFailOpenCause(t *testing.T) {
	down := errors.New("the store is down")
	tests := []struct {
		name      string
		dedup     bool
		claimErr  error
		wantClaim bool
		wantCause []error // each in the cause's tree; none: no cause
	}{
		{name: "beneath no Dedup"},
		{name: "under a claim", dedup: true, wantClaim: true},
		{name: "store out of reach", dedup: true, claimErr: down, wantCause: []error{middleware.ErrStoreUnavailable, down}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var (
				calls    int
				hasClaim bool
				cause    error
			)
			var h rabbitmw.Handler = rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
				calls++
				_, hasClaim = middleware.ClaimFrom(ctx)
				cause = middleware.FailOpenCause(ctx)
				return nil
			})
			if tt.dedup {
				s := &faultyStore{Store: store.NewMemory()}
				set(&s.claim, tt.claimErr)
				h = middleware.Dedup(s, middleware.DedupOptions{FailOpen: true})(h)
			}
			d, _ := deliverytest.New("m1", "")
			require.NoError(t, h.Handle(context.Background(), d))
			require.Equal(t, 1, calls, "handler calls")
			assert.Equal(t, tt.wantClaim, hasClaim, "ClaimFrom found a claim")
			if len(tt.wantCause) == 0 {
				assert.NoError(t, cause, "FailOpenCause")
			}
			for _, want := range tt.wantCause {
				assert.ErrorIs(t, cause, want, "FailOpenCause")
			}
		})
	}
}

// claimingHandler is a middleware.ClaimingHandler that answers as told,
// and records how it was called.
type claimingHandler struct {
	ran    bool
	err    error // HandleClaiming's
	result error // Handle's

	claims, handles int
	store           store.Store
	key             string
	lease           time.Duration
	retention       time.Duration
	hadClaim        bool // HandleClaiming's context carried a Claim
	hadDeadline     bool
	handleClaim     bool // Handle's context carried a Claim
	// waits: HandleClaiming waits for its context to end, then answers
	// ran false and the context's cause, as a handler that waited to
	// claim, for a transaction it shares, does; or, if silent, no error,
	// as one that declines because it could not try.
	waits, silent bool
}

func (h *claimingHandler) Handle(ctx context.Context, d *amqp.Delivery) error {
	h.handles++
	_, h.handleClaim = middleware.ClaimFrom(ctx)
	return h.result
}

func (h *claimingHandler) HandleClaiming(ctx context.Context, d *amqp.Delivery, s store.Store, key string, lease, retention time.Duration) (bool, error) {
	h.claims++
	h.store, h.key, h.lease, h.retention = s, key, lease, retention
	_, h.hadClaim = middleware.ClaimFrom(ctx)
	_, h.hadDeadline = ctx.Deadline()
	if h.waits {
		<-ctx.Done()
		if h.silent {
			return false, nil
		}
		return false, fmt.Errorf("waited to claim: %w", context.Cause(ctx))
	}
	return h.ran, h.err
}

// Dedup offers a delivery to a ClaimingHandler directly beneath it, or
// beneath its Timeout, before it claims; and claims as usual when the
// handler declines, says busy, or is hidden by a layer in between.
func TestDedupClaimingHandler(t *testing.T) {
	ctx := context.Background()
	boom := errors.New("boom")
	busy := fmt.Errorf("held: %w", middleware.ErrBusy)
	tests := []struct {
		name      string
		ran       bool
		err       error
		wrap      func(rabbitmw.Handler) rabbitmw.Handler
		timeout   bool
		wantClaim int // HandleClaiming calls
		wantRuns  int // Handle calls
		wantIs    error
		wantOut   rabbitmw.Outcome
		wantState store.Status // in the store afterwards
	}{
		{name: "ran", ran: true, wantClaim: 1, wantOut: rabbitmw.Ack},
		{name: "ran beneath Timeout", ran: true, timeout: true, wantClaim: 1, wantOut: rabbitmw.Ack},
		{name: "ran and failed", ran: true, err: boom, wantClaim: 1, wantIs: boom, wantOut: rabbitmw.Requeue},
		{name: "declined", wantClaim: 1, wantRuns: 1, wantOut: rabbitmw.Ack, wantState: store.Done},
		{name: "declined with an error", err: boom, wantClaim: 1, wantRuns: 1, wantOut: rabbitmw.Ack, wantState: store.Done},
		{name: "busy", err: busy, wantClaim: 1, wantIs: middleware.ErrBusy, wantOut: rabbitmw.Delay},
		{name: "hidden by a layer", ran: true, wrap: func(h rabbitmw.Handler) rabbitmw.Handler { return rabbitmw.HandlerFunc(h.Handle) },
			wantRuns: 1, wantOut: rabbitmw.Ack, wantState: store.Done},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := store.NewMemory()
			ch := &claimingHandler{ran: tt.ran, err: tt.err}
			var h rabbitmw.Handler = ch
			if tt.wrap != nil {
				h = tt.wrap(h)
			}
			if tt.timeout {
				h = middleware.Timeout(time.Minute)(h)
			}
			h = middleware.Dedup(s, middleware.DedupOptions{Lease: 2 * time.Minute, Retention: time.Hour, BusyDelay: 3 * time.Second})(h)
			d, _ := deliverytest.New("m1", "")
			err := h.Handle(ctx, d)
			if tt.wantIs != nil {
				assert.ErrorIs(t, err, tt.wantIs)
			} else {
				assert.NoError(t, err)
			}
			dec := rabbitmw.Decide(err)
			assert.Equal(t, tt.wantOut, dec.Outcome, "Decide(%v)", err)
			if tt.wantOut == rabbitmw.Delay {
				assert.Equal(t, 3*time.Second, dec.Delay, "the busy delay")
			}
			assert.Equal(t, tt.wantClaim, ch.claims, "HandleClaiming calls")
			assert.Equal(t, tt.wantRuns, ch.handles, "Handle calls")
			if ch.claims > 0 {
				assert.Same(t, s, ch.store, "the store given to HandleClaiming")
				assert.Equal(t, "m1", ch.key)
				assert.Equal(t, 2*time.Minute, ch.lease)
				assert.Equal(t, time.Hour, ch.retention)
				assert.False(t, ch.hadClaim, "HandleClaiming's context carries a Claim")
				assert.Equal(t, tt.timeout, ch.hadDeadline, "HandleClaiming's context has a deadline")
			}
			if ch.handles > 0 {
				assert.True(t, ch.handleClaim, "Handle ran without a claim")
			}
			got, err := s.Inspect(ctx, "m1")
			require.NoError(t, err)
			assert.Equal(t, tt.wantState, got.Status, "the key in the store: %s", got.State())
		})
	}
}

// A delivery that a ClaimingHandler ran reports the events of a delivery
// run under Dedup's claim: claimed, and, if its claim ended before its
// success was recorded (its result wraps ErrLeaseLost), lease_lost with
// the handler's error, which otelmw counts as a lost lease.
func TestDedupClaimingHandlerEvents(t *testing.T) {
	ctx := context.Background()
	lost := fmt.Errorf("%w: the transaction that claimed it was ended", middleware.ErrLeaseLost)
	tests := []struct {
		name string
		ran  bool
		err  error
		want []middleware.DedupEvent
	}{
		{name: "ran", ran: true, want: []middleware.DedupEvent{{Kind: middleware.DedupClaimed, Key: "m1"}}},
		{name: "ran and failed", ran: true, err: errBoom, want: []middleware.DedupEvent{{Kind: middleware.DedupClaimed, Key: "m1"}}},
		{name: "ran and lost its claim", ran: true, err: lost, want: []middleware.DedupEvent{
			{Kind: middleware.DedupClaimed, Key: "m1"}, {Kind: middleware.DedupLeaseLost, Key: "m1", Err: lost},
		}},
		{name: "busy", err: fmt.Errorf("held: %w", middleware.ErrBusy), want: []middleware.DedupEvent{{Kind: middleware.DedupBusy, Key: "m1"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var got []middleware.DedupEvent
			h := middleware.Dedup(store.NewMemory(), middleware.DedupOptions{
				Observe: func(_ context.Context, e middleware.DedupEvent) { got = append(got, e) },
			})(&claimingHandler{ran: tt.ran, err: tt.err})
			d, _ := deliverytest.New("m1", "")
			h.Handle(ctx, d)
			assert.Equal(t, tt.want, got, "Dedup's events")
		})
	}
}

// A ClaimingHandler whose context ends while it waits to claim answers
// ran false with the context's cause: Dedup returns that (with ErrTimeout
// if the Timeout's deadline ended it), neither claims nor runs the
// handler, and reports no event: the delivery got no answer. So it does
// if the handler declines, with no error, once its context ended: a claim
// of Dedup's would run the handler with a new deadline, for longer than
// the Timeout allows; and the delivery, which never ran, is not counted.
func TestDedupClaimingHandlerContextEnded(t *testing.T) {
	tests := []struct {
		name       string
		timeout    bool // the Timeout's deadline ends the wait, not the delivery's context
		silent     bool // the handler declines with no error
		wantIs     error
		notCounted bool
	}{
		{name: "cancelled", wantIs: context.Canceled},
		{name: "Timeout's deadline", timeout: true, wantIs: middleware.ErrTimeout},
		{name: "cancelled, declined", silent: true, wantIs: context.Canceled, notCounted: true},
		{name: "Timeout's deadline, declined", timeout: true, silent: true, wantIs: middleware.ErrTimeout, notCounted: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				s := store.NewMemory()
				ch := &claimingHandler{waits: true, silent: tt.silent}
				var h rabbitmw.Handler = ch
				if tt.timeout {
					h = middleware.Timeout(time.Minute)(h)
				}
				var got []middleware.DedupEvent
				h = middleware.Dedup(s, middleware.DedupOptions{
					Observe: func(_ context.Context, e middleware.DedupEvent) { got = append(got, e) },
				})(h)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				if !tt.timeout {
					time.AfterFunc(time.Second, cancel)
				}
				d, _ := deliverytest.New("m1", "")
				err := h.Handle(ctx, d)
				assert.ErrorIs(t, err, tt.wantIs)
				if tt.notCounted {
					assert.True(t, rabbitmw.IsNotCounted(err), "counted: %v", err)
				}
				assert.Empty(t, got, "Dedup's events")
				assert.Equal(t, 1, ch.claims, "HandleClaiming calls")
				assert.Zero(t, ch.handles, "Handle calls")
				st, err := s.Inspect(context.Background(), "m1")
				require.NoError(t, err)
				assert.Zero(t, st.Status, "the key in the store: %s", st.State())
			})
		})
	}
}
