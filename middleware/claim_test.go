package middleware_test

import (
	"context"
	"testing"
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
