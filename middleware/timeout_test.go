package middleware_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

func TestTimeout(t *testing.T) {
	const limit = 50 * time.Millisecond
	tests := []struct {
		name        string
		parent      func() (context.Context, context.CancelFunc)
		handler     func(ctx context.Context) error
		wantNil     bool
		wantTimeout bool
		wantIs      error
	}{
		{
			name:    "a handler that returns in time is untouched",
			handler: func(context.Context) error { return nil },
			wantNil: true,
		},
		{
			name:    "an early error is untouched",
			handler: func(context.Context) error { return errBoom },
			wantIs:  errBoom,
		},
		{
			name: "a handler cut by the deadline fails with ErrTimeout",
			handler: func(ctx context.Context) error {
				if err := awaitEnd(ctx, 100*limit); err != nil {
					return err
				}
				return ctx.Err()
			},
			wantTimeout: true,
			wantIs:      context.DeadlineExceeded,
		},
		{
			name: "a late success stands",
			handler: func(ctx context.Context) error {
				return awaitEnd(ctx, 100*limit)
			},
			wantNil: true,
		},
		{
			name: "the parent's cancellation is not a timeout",
			parent: func() (context.Context, context.CancelFunc) {
				return context.WithTimeout(context.Background(), limit/5)
			},
			handler: func(ctx context.Context) error {
				if err := awaitEnd(ctx, 100*limit); err != nil {
					return err
				}
				return ctx.Err()
			},
			wantIs: context.DeadlineExceeded,
		},
	}
	// Beneath Dedup, Timeout's handler runs under Dedup's context, given
	// the deadline: the result must be the same.
	layouts := map[string]func(rabbitmw.Handler) rabbitmw.Handler{
		"alone": middleware.Timeout(limit),
		"beneath Dedup": func(h rabbitmw.Handler) rabbitmw.Handler {
			return middleware.Dedup(store.NewMemory(), middleware.DedupOptions{})(middleware.Timeout(limit)(h))
		},
	}
	for _, tt := range tests {
		for layout, wrap := range layouts {
			t.Run(tt.name+"/"+layout, func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) {
					ctx, cancel := context.Background(), context.CancelFunc(func() {})
					if tt.parent != nil {
						ctx, cancel = tt.parent()
					}
					defer cancel()
					var deadline, entry time.Time
					h := wrap(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
						entry = time.Now()
						deadline, _ = ctx.Deadline()
						return tt.handler(ctx)
					}))
					d, _ := deliverytest.New("m1", "")
					err := h.Handle(ctx, d)
					if deadline.IsZero() || deadline.Sub(entry) > limit {
						t.Errorf("handler deadline %v after it started; want at most %v", deadline.Sub(entry), limit)
					}
					if tt.wantNil != (err == nil) {
						t.Fatalf("Timeout result = %v; want nil: %v", err, tt.wantNil)
					}
					if got := errors.Is(err, middleware.ErrTimeout); got != tt.wantTimeout {
						t.Errorf("result %v wraps ErrTimeout: %v; want %v", err, got, tt.wantTimeout)
					}
					if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
						t.Errorf("result %v does not wrap %v", err, tt.wantIs)
					}
				})
			})
		}
	}
}

// awaitEnd waits for ctx to end, and returns nil; or an error if it has
// not ended within bound (on the bubble's clock), so that a deadline never
// armed fails the test at once, where the renewals of Dedup's lease would
// move the clock on for ever.
func awaitEnd(ctx context.Context, bound time.Duration) error {
	select {
	case <-ctx.Done():
		return nil
	case <-time.After(bound):
		return errors.New("the deadline did not end the context")
	}
}

// Beneath Dedup, the deadline counts from the handler's start, once the
// claim is won, however long the claim took, as it does when a layer in
// between gives Timeout a context of its own.
func TestTimeoutCountsFromTheHandlersStart(t *testing.T) {
	const limit, claiming = 10 * time.Second, 4 * time.Second
	layouts := map[string]func(rabbitmw.Handler) rabbitmw.Handler{
		"directly beneath Dedup": middleware.Timeout(limit),
		"beneath a layer beneath Dedup": func(h rabbitmw.Handler) rabbitmw.Handler {
			return rabbitmw.HandlerFunc(middleware.Timeout(limit)(h).Handle)
		},
	}
	for layout, wrap := range layouts {
		t.Run(layout, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var entry, deadline, ended time.Time
				h := middleware.Dedup(&slowClaim{Store: store.NewMemory(), wait: claiming}, middleware.DedupOptions{})(
					wrap(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
						entry = time.Now()
						deadline, _ = ctx.Deadline()
						if err := awaitEnd(ctx, 10*limit); err != nil {
							return err
						}
						ended = time.Now()
						return ctx.Err()
					})))
				d, _ := deliverytest.New("m1", "")
				err := h.Handle(context.Background(), d)
				if !errors.Is(err, middleware.ErrTimeout) {
					t.Errorf("result %v; want ErrTimeout", err)
				}
				if got := deadline.Sub(entry); got != limit {
					t.Errorf("deadline %v after the handler started; want %v", got, limit)
				}
				if got := ended.Sub(entry); got != limit {
					t.Errorf("context ended %v after the handler started; want %v", got, limit)
				}
			})
		})
	}
}

// slowClaim is a Store whose Claim takes wait.
type slowClaim struct {
	store.Store
	wait time.Duration
}

func (s *slowClaim) Claim(ctx context.Context, key, token string, lease time.Duration) (store.Status, error) {
	time.Sleep(s.wait)
	return s.Store.Claim(ctx, key, token, lease)
}

// A handler that fails at the instant of its deadline has failed once its
// deadline passed, as a context's Err says at that instant: its error is
// wrapped with ErrTimeout, whether the deadline's timer has run yet or
// not, the handler watched its context or not, and Dedup runs Timeout's
// handler itself or not.
func TestTimeoutAtTheDeadline(t *testing.T) {
	const limit = time.Second
	layouts := map[string]func(rabbitmw.Handler) rabbitmw.Handler{
		"alone":                         middleware.Timeout(limit),
		"directly beneath Dedup":        rabbitmw.Chain(middleware.Dedup(store.NewMemory(), middleware.DedupOptions{}), middleware.Timeout(limit)),
		"beneath a layer beneath Dedup": rabbitmw.Chain(middleware.Dedup(store.NewMemory(), middleware.DedupOptions{}), middleware.Recover(), middleware.Timeout(limit)),
	}
	for layout, wrap := range layouts {
		for _, watches := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/watches %v", layout, watches), func(t *testing.T) {
				h := wrap(rabbitmw.HandlerFunc(func(ctx context.Context, _ *amqp.Delivery) error {
					if watches {
						ctx.Done()
					}
					time.Sleep(limit)
					return errBoom
				}))
				// The deadline's timer and the handler wake at the same
				// instant, in either order: try both, many times.
				for i := range 50 {
					synctest.Test(t, func(t *testing.T) {
						d, _ := deliverytest.New(fmt.Sprint("m", i), "")
						if err := h.Handle(context.Background(), d); !errors.Is(err, middleware.ErrTimeout) {
							t.Errorf("try %d: result %v; want ErrTimeout", i, err)
						}
					})
				}
			})
		}
	}
}
