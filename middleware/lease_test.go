package middleware

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// The renewer queues the deadline of a Timeout beneath Dedup with the
// claim's lease, and takes it out with it: the deadline still ends the
// handler's context, and once the deliveries have returned (at once,
// with their consumer's context ended, in a panic, past their deadline)
// nothing is left queued.
func TestRenewerQueuesTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = time.Second
		var mu sync.Mutex
		errs := map[string]error{}
		handler := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
			switch d.MessageId[0] {
			case 'w': // waits for its deadline
				// Bounded, so that a deadline never queued fails the
				// test rather than leave it waiting while the lease's
				// renewals move the bubble's clock for ever.
				cause := errors.New("the deadline did not end the context")
				select {
				case <-ctx.Done():
					cause = context.Cause(ctx)
				case <-time.After(10 * timeout):
				}
				mu.Lock()
				errs[d.MessageId] = cause
				mu.Unlock()
				return ctx.Err()
			case 'c': // its consumer stops meanwhile
				<-ctx.Done()
				return ctx.Err()
			case 'p':
				panic("boom")
			}
			return nil
		})
		h := Dedup(store.NewMemory(), DedupOptions{Lease: time.Minute})(Timeout(timeout)(handler)).(*dedup)
		deliver := func(kinds string) {
			var wg sync.WaitGroup
			for i := range 40 {
				id := fmt.Sprintf("%c%d", kinds[i%len(kinds)], i)
				wg.Go(func() {
					ctx, cancel := context.WithCancel(context.Background())
					defer cancel()
					if id[0] == 'c' {
						time.AfterFunc(timeout/2, cancel)
					}
					defer func() {
						if v := recover(); v != nil && id[0] != 'p' {
							t.Errorf("%s: panic %v", id, v)
						}
					}()
					err := h.Handle(ctx, &amqp.Delivery{MessageId: id})
					if id[0] == 'w' && !errors.Is(err, ErrTimeout) {
						t.Errorf("%s: %v; want ErrTimeout", id, err)
					}
				})
			}
			wg.Wait()
			h.renewer.mu.Lock()
			defer h.renewer.mu.Unlock()
			assert.Nil(t, h.renewer.deadlines.list.head, "%s: deadlines left queued", kinds)
			assert.Nil(t, h.renewer.claims.head, "%s: claims left queued", kinds)
		}
		// Before their deadlines, which would take them out of the queue.
		deliver("ncp")
		deliver("w")
		require.Len(t, errs, 40)
		for id, err := range errs {
			assert.Equal(t, context.DeadlineExceeded, err, "%s: the cause of its context's end", id)
		}
	})
}

// A delivery whose lease ends while its handler runs, so that its claim
// is no longer queued for renewal when it returns (the store said the
// claim was lost, or a renewal hung until the lease might end), still
// takes its Timeout's deadline out of the queue.
func TestRenewerTakesTheDeadlineOutAfterTheLease(t *testing.T) {
	for _, tc := range []struct {
		name   string
		extend func(ctx context.Context) error
		want   error // the cause of the handler's context's end
	}{
		{"lost", func(context.Context) error { return store.ErrLostClaim }, ErrLeaseLost},
		{"hanging", func(ctx context.Context) error { <-ctx.Done(); return ctx.Err() }, ErrStoreUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				var cause error
				handler := rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					<-ctx.Done()
					cause = context.Cause(ctx)
					return ctx.Err()
				})
				s := &extendAs{Store: store.NewMemory(), extend: tc.extend}
				h := Dedup(s, DedupOptions{Lease: 3 * time.Second})(Timeout(time.Minute)(handler)).(*dedup)
				err := h.Handle(context.Background(), &amqp.Delivery{MessageId: "m1"})
				assert.ErrorIs(t, cause, tc.want, "the cause of the handler's context's end")
				assert.ErrorIs(t, err, tc.want)
				h.renewer.mu.Lock()
				defer h.renewer.mu.Unlock()
				assert.Nil(t, h.renewer.deadlines.list.head, "the deadline left queued")
				assert.Nil(t, h.renewer.claims.head, "the claim left queued")
			})
		})
	}
}

// extendAs is a Store whose Extend answers as extend does.
type extendAs struct {
	store.Store
	extend func(ctx context.Context) error
}

func (s *extendAs) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	return s.extend(ctx)
}
