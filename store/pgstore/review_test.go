package pgstore_test

import (
	"context"
	"testing"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/pgstore"
)

// ErrNoClaim says a handler without Dedup over the same Store in front is
// a chain built wrong, and dead-letters the message. A Dedup over another
// store (Redis, kept from before the inbox, or a Memory in a test) is as
// wrong, but it gives the handler a claim: the done mark's UPDATE then
// never finds the claim's row, every attempt is rolled back as a lost
// lease (ErrLeaseLost, which Retry does not count), and the message is
// delayed forever, never acknowledged nor dead-lettered.
func TestReviewHandlerUnderDedupOfAnotherStore(t *testing.T) {
	ctx := context.Background()
	f := newInbox(t, newPool(t))
	other := store.NewMemory()
	h := rabbitmw.Chain(
		middleware.Retry(other, middleware.RetryOptions{MaxAttempts: 3}),
		middleware.Recover(),
		middleware.Dedup(other, middleware.DedupOptions{}),
	)(pgstore.Handler(f.st, f.insert, pgstore.HandlerOptions{}))
	var last rabbitmw.Decision
	for attempt := 1; attempt <= 10; attempt++ {
		d := delivery("m1")
		d.Redelivered = attempt > 1
		last = rabbitmw.Decide(h.Handle(ctx, d))
		if last.Outcome == rabbitmw.Ack || last.Outcome == rabbitmw.DeadLetter {
			break
		}
	}
	if last.Outcome != rabbitmw.DeadLetter {
		t.Errorf("after 10 deliveries under a Dedup of another store: %v after %v, attempts %d (%v); want dead-lettered, the chain being built wrong",
			last.Outcome, last.Delay, last.Attempts, last.Err)
	}
	if n := f.count(t, "m1"); n != 0 {
		t.Errorf("%d effects committed; want 0", n)
	}
}
