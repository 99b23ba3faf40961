package middleware

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/store"
)

// heldExtends is a store whose first Extend returns at once and whose
// later ones wait for release.
type heldExtends struct {
	store.Store
	calls   int
	release chan struct{}
}

func (s *heldExtends) Extend(ctx context.Context, key, token string, lease time.Duration) error {
	s.calls++ // the test starts the renewals one after the other
	if s.calls > 1 {
		<-s.release
	}
	return nil
}

// A renewal that returns while stop waits for another renewal's call of
// Observe leaves the claim's state to stop, which reads it and recycles
// it once: the panic of that call is stop's result. Here a renewal whose
// Observe panics, and a later one whose store call is slow, both end just
// after the delivery; each order in which they and stop then take the
// lock is tried.
func TestRenewerStopWaitsAndARenewalReturns(t *testing.T) {
	for range 200 {
		synctest.Test(t, func(t *testing.T) {
			s := &heldExtends{Store: store.NewMemory(), release: make(chan struct{})}
			r, _ := newRenewer(s, time.Hour)
			observing, panicNow := make(chan struct{}), make(chan struct{})
			r.observe = func(context.Context, DedupEvent) {
				close(observing)
				<-panicNow
				panic("observer bug")
			}
			cc := newClaimContext(context.Background(), "k", "t", time.Hour, time.Time{}, nil)
			now := time.Now()
			l := r.start(now, now, cc)

			renewed := make(chan struct{}, 2)
			renew := func() { // as fire starts one
				r.mu.Lock()
				l.renewing = true
				r.mu.Unlock()
				go func() { r.renew(l); renewed <- struct{}{} }()
			}
			renew()     // extends the claim, and calls Observe
			<-observing // meanwhile the next renewal starts
			renew()     // and waits for the store
			type result struct{ panicked error }
			stopped := make(chan result)
			go func() { _, _, p := r.stop(l); stopped <- result{p} }()
			synctest.Wait() // stop waits for Observe

			close(panicNow)
			close(s.release)
			res := <-stopped
			<-renewed
			<-renewed
			var pe *rabbitmw.PanicError
			require.ErrorAs(t, res.panicked, &pe, "stop's result")
			require.Equal(t, "observer bug", pe.Value)
		})
	}
}
