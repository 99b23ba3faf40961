package middleware_test

import (
	"context"
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

// sleepOrCancel is a handler that works for as long as its message's
// Type says (a duration), or until its context ends, with its cause.
func sleepOrCancel(ctx context.Context, d *amqp.Delivery) error {
	work, err := time.ParseDuration(d.Type)
	if err != nil {
		return err
	}
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-time.After(work):
		return nil
	}
}

// delivery returns a delivery of message id whose handler (sleepOrCancel)
// works for work.
func delivery(t *testing.T, id string, work time.Duration) *amqp.Delivery {
	t.Helper()
	d, _ := deliverytest.New(id, "")
	d.Type = work.String()
	return d
}

// One Dedup serves deliveries in one testing/synctest bubble after
// another, as a stack built once serves a package's tests: each bubble
// renews the leases and ends the handlers at their deadline on its own
// fake clock, though the timer a bubble armed last never fires once the
// bubble has ended, and a timer of a bubble must not be touched from
// outside it.
func TestDedupTimersAcrossBubbles(t *testing.T) {
	const lease, timeout = time.Minute, 10 * time.Second
	st := &faultyStore{Store: store.NewMemory()}
	renewed := rabbitmw.Chain(middleware.Dedup(st, middleware.DedupOptions{Lease: lease}))(
		rabbitmw.HandlerFunc(sleepOrCancel))
	timed := rabbitmw.Chain(middleware.Dedup(st, middleware.DedupOptions{Lease: lease}), middleware.Timeout(timeout))(
		rabbitmw.HandlerFunc(sleepOrCancel))
	for i := range 3 {
		synctest.Test(t, func(t *testing.T) {
			// A renewal is due a third of the lease after the claim;
			// the first bubble leaves it armed.
			extends := st.Calls("extend")
			err := renewed.Handle(context.Background(), delivery(t, "renew-"+string(rune('a'+i)), 3*lease))
			require.NoError(t, err, "a handler that works 3 leases, renewed")
			assert.GreaterOrEqual(t, st.Calls("extend")-extends, int64(8), "renewals in 3 leases")

			// The deadline of the first bubble's second delivery is
			// armed when the bubble ends.
			err = timed.Handle(context.Background(), delivery(t, "time-"+string(rune('a'+i)), 2*timeout))
			assert.ErrorIs(t, err, middleware.ErrTimeout, "a handler that works past its deadline")
			require.NoError(t, timed.Handle(context.Background(), delivery(t, "quick-"+string(rune('a'+i)), time.Second)))
		})
	}
	// And on the real clock, outside any bubble.
	err := timed.Handle(context.Background(), delivery(t, "real", 0))
	require.NoError(t, err, "a delivery outside the bubbles")
}
