package middleware_test

import (
	"context"
	"errors"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

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
				if !ok {
					t.Fatal("ClaimFrom(handler's context) found no claim")
				}
				got = c
				if tt.markedDone {
					// What a transactional handler does in its commit.
					if err := s.Store.Complete(ctx, c.Key(), c.Token(), c.Retention()); err != nil {
						t.Fatalf("Complete by the handler: %v", err)
					}
					c.MarkedDone()
				}
				return tt.result
			}))
			d, _ := deliverytest.New("m1", "body")
			err := h.Handle(ctx, d)
			if tt.wantIs == nil && err != nil || tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Fatalf("Handle = %v; want %v", err, tt.wantIs)
			}
			if got.Key() != "ns:m1" || got.Token() == "" || got.Retention() != 42*time.Minute {
				t.Errorf("Claim = key %q, token %q, retention %v; want ns:m1, a token, 42m", got.Key(), got.Token(), got.Retention())
			}
			if n := s.Calls("complete"); n != tt.wantComplete {
				t.Errorf("Dedup called Complete %d times; want %d", n, tt.wantComplete)
			}
			if st, err := s.Claim(ctx, "ns:m1", "stranger", time.Minute); err != nil || st != store.Done {
				t.Errorf("Claim afterwards = %v, %v; want done", st, err)
			}
		})
	}
}

func TestClaimFromWithoutDedup(t *testing.T) {
	if c, ok := middleware.ClaimFrom(context.Background()); ok || c != nil {
		t.Errorf("ClaimFrom(context.Background()) = %v, %v; want nil, false", c, ok)
	}
}
