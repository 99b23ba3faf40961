package store

import (
	"context"
	"time"
)

// An Inspector tells what a store holds for a message key, for operators
// and tools. It is an optional interface: [Memory],
// [github.com/rabbitmw/rabbitmw/store/redisstore.Store] and
// [github.com/rabbitmw/rabbitmw/store/pgstore.Store] implement it; test for
// it with a type assertion.
//
// Inspect reads and changes nothing: an expired entry reads as absent, as
// for every method of [Store]. It is not atomic across the claim and the
// failure counter of a key, which may be read a moment apart. Errors are
// as for the methods of Store.
type Inspector interface {
	Inspect(ctx context.Context, key string) (KeyState, error)
}

// KeyState is what a store holds for a key.
type KeyState struct {
	// Status is Processing when the key is claimed, Abandoned when its
	// claim's lease ended without Complete or Release (its owner died, or
	// lost the store), Done when it is done, and 0 when it is absent.
	Status Status
	// Token is the claim's owner token, when Status is Processing or
	// Abandoned. The tokens of middleware.Dedup name their host and
	// process (see middleware.TokenOwner); hand-written consumers write
	// "processing".
	Token string
	// TTL is the time left before the claim's lease ends (Processing),
	// before the abandoned claim or the done mark is forgotten (Abandoned,
	// Done); -1 if the entry has no expiry.
	TTL time.Duration
	// Failures is the failure counter, 0 when absent, and FailuresTTL the
	// time left before it expires (-1: no expiry).
	Failures    int64
	FailuresTTL time.Duration
}

// State returns "absent", "claimed", "abandoned" or "done".
func (k KeyState) State() string {
	switch k.Status {
	case Processing:
		return "claimed"
	case Abandoned:
		return "abandoned"
	case Done:
		return "done"
	}
	return "absent"
}
