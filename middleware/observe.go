package middleware

import (
	"context"
	"strconv"
)

// A DedupEventKind is one kind of [DedupEvent].
type DedupEventKind int

// The kinds of Dedup's events. Claimed, Duplicate, Busy, Unavailable,
// Abandoned and Rejected are its answer for a delivery, one per delivery
// (but none for one whose context ended while a [ClaimingHandler] waited
// to claim it); LeaseRenewed and LeaseLost happen to a claim while its
// handler runs.
const (
	// DedupClaimed: the claim was won and the handler runs.
	DedupClaimed DedupEventKind = iota + 1
	// DedupDuplicate: the key is marked done; the handler does not run.
	DedupDuplicate
	// DedupBusy: another consumer holds the claim; the handler does not
	// run.
	DedupBusy
	// DedupUnavailable: the store could not be reached for the claim. The
	// handler does not run, unless DedupOptions.FailOpen.
	DedupUnavailable
	// DedupAbandoned: the message's last attempt never finished (see
	// [ErrAbandoned]); the handler does not run.
	DedupAbandoned
	// DedupLeaseRenewed: a renewal extended the claim while the handler
	// ran.
	DedupLeaseRenewed
	// DedupLeaseLost: the claim was taken over or deleted before the
	// handler's success was recorded, so it was not (see [ErrLeaseLost]).
	DedupLeaseLost
	// DedupRejected: the store refused the key itself
	// (store.ErrKeyRejected: too long for its index, say); the message is
	// dead-lettered. The handler does not run, unless the refusal came
	// after it had succeeded, to its done mark.
	DedupRejected
)

// String returns the kind as metrics and traces name it: "claimed",
// "duplicate", "busy", "unavailable", "abandoned", "lease_renewed",
// "lease_lost" or "rejected".
func (k DedupEventKind) String() string {
	switch k {
	case DedupClaimed:
		return "claimed"
	case DedupDuplicate:
		return "duplicate"
	case DedupBusy:
		return "busy"
	case DedupUnavailable:
		return "unavailable"
	case DedupAbandoned:
		return "abandoned"
	case DedupLeaseRenewed:
		return "lease_renewed"
	case DedupLeaseLost:
		return "lease_lost"
	case DedupRejected:
		return "rejected"
	}
	return "DedupEventKind(" + strconv.Itoa(int(k)) + ")"
}

// A DedupEvent is something [Dedup] found or did for one delivery. It is
// given to DedupOptions.Observe.
type DedupEvent struct {
	Kind DedupEventKind
	// Key is the message's key in the store, namespace included.
	Key string
	// Err is, for DedupUnavailable and DedupRejected, the store's error,
	// and for DedupLeaseLost, how the claim was lost; nil otherwise.
	Err error
}

// notify calls the observer, if there is one, with an event of a
// delivery whose context is ctx.
func notify(f func(context.Context, DedupEvent), ctx context.Context, kind DedupEventKind, key string, err error) {
	if f != nil {
		f(ctx, DedupEvent{Kind: kind, Key: key, Err: err})
	}
}
