// Package store holds the idempotency state of messages: who is processing
// a message (a claim with a lease), which messages are done, and how many
// times each message has failed.
//
// [Store] is the interface that backends implement. [Memory] ships with
// this package; the backends that need a client library live in packages
// of their own, so that only a program that uses one links its client:
// [github.com/rabbitmw/rabbitmw/store/redisstore] (Redis, over go-redis) and
// [github.com/rabbitmw/rabbitmw/store/pgstore] (PostgreSQL, over pgx).
// Package storetest checks any implementation against the contract written
// on Store.
package store

import (
	"context"
	"errors"
	"time"
)

// ErrLostClaim is returned by Extend, Complete and Release when the caller's
// token no longer owns the key: its lease ended, another owner claimed it,
// it was completed, or it was deleted.
var ErrLostClaim = errors.New("store: lost claim")

// ErrKeyRejected is returned, wrapped, by a Store that cannot hold a key
// for what the key is, such as a key longer than its index takes, or a key
// under which a backend shared with other programs holds something of
// theirs (in Redis, a value of another type): the store answered, took no
// effect, and would refuse the key again. The
// fault is the key's, not the backend's, so middleware.Dedup
// dead-letters the message with this reason rather than retry it. Its
// type, for rabbitmw.ErrorType, is "key_rejected".
var ErrKeyRejected error = keyRejected{}

type keyRejected struct{}

func (keyRejected) Error() string     { return "store: key rejected" }
func (keyRejected) ErrorType() string { return "key_rejected" }

// Status is what Claim found for a key.
type Status int

// The claim statuses. The zero Status is not valid.
const (
	// Claimed: the key was free and the caller now owns it, under its token,
	// until the lease ends.
	Claimed Status = iota + 1
	// Processing: another owner holds an unexpired claim on the key.
	Processing
	// Done: the key was completed and its done mark has not expired.
	Done
	// Abandoned: the key held a claim whose lease ended without Complete
	// or Release, so its attempt never finished: the owner died, or could
	// not reach the store for the rest of its lease. Claim removed that
	// claim and took nothing: the caller owns nothing, and the next Claim
	// of the key can take it.
	Abandoned
)

// String returns "claimed", "processing", "done" or "abandoned".
// Valid reports whether s is one of the statuses above. Backends whose
// claim returns a status's number (as the Redis and PostgreSQL scripts do)
// convert it with Status(n) and check it with Valid.
func (s Status) Valid() bool { return s >= Claimed && s <= Abandoned }

func (s Status) String() string {
	switch s {
	case Claimed:
		return "claimed"
	case Processing:
		return "processing"
	case Done:
		return "done"
	case Abandoned:
		return "abandoned"
	}
	return "invalid"
}

// DefaultAbandonedRetention is how long [Memory] and
// [github.com/rabbitmw/rabbitmw/store/redisstore.Store] remember an
// abandoned claim after its lease ended, unless told otherwise.
const DefaultAbandonedRetention = 24 * time.Hour

// A Store holds the state of message keys. A key is in one of four states:
//
//   - absent;
//   - processing: claimed by one owner, identified by a token, until its
//     lease ends. The token owns the key while it is processing, and only
//     then;
//   - abandoned: its lease ended without Complete or Release. The store
//     remembers an abandoned claim for a while after its lease ended (its
//     abandoned retention: at least a minute; [DefaultAbandonedRetention]
//     for Memory and Redis), so that the next Claim can report that an
//     attempt never finished; then the key is absent. Nobody owns an
//     abandoned claim, not even the token that took it;
//   - done: until its retention ends.
//
// Separately, a key has a failure counter.
//
// Every method is atomic with respect to the others for the same key, and a
// Store is safe for concurrent use by many goroutines and, for a shared
// backend such as Redis, by many processes. Keys are opaque non-empty
// strings; tokens are opaque non-empty strings that never equal a done mark.
// Durations are positive. Expiry is measured by the backend's own clock;
// an expired entry behaves exactly as an absent one.
//
// Errors: a method returns ErrLostClaim (possibly wrapped) only where its
// documentation says so, and ErrKeyRejected (wrapped) for a key it cannot
// hold, having changed nothing. Any other non-nil error means the backend
// could not be reached or did not answer: the state of the key is then unknown, and the
// caller must assume the operation may or may not have taken effect. A
// context that is done makes a method return promptly with an error.
// Backends translate their own errors (redis.Nil, for instance) into these.
type Store interface {
	// Claim takes key for token with the given lease, if key is absent.
	// It returns Claimed if it did so, Processing if another owner holds
	// the key, and Done if the key is done. If key is abandoned, Claim
	// makes it absent and returns Abandoned, taking nothing. Only Claimed
	// and Abandoned change anything. Claim is a single atomic operation:
	// of many concurrent claims of an absent key, exactly one returns
	// Claimed; of an abandoned key, exactly one returns Abandoned.
	Claim(ctx context.Context, key, token string, lease time.Duration) (Status, error)

	// Extend sets the lease of key to lease from now, if token owns it;
	// otherwise it changes nothing and returns ErrLostClaim.
	Extend(ctx context.Context, key, token string, lease time.Duration) error

	// Complete marks key done, to be remembered for retention, if token
	// owns it; otherwise it changes nothing and returns ErrLostClaim.
	Complete(ctx context.Context, key, token string, retention time.Duration) error

	// Release makes key absent, if token owns it, so that it can be claimed
	// again at once; otherwise it changes nothing and returns ErrLostClaim.
	Release(ctx context.Context, key, token string) error

	// Fail adds one to the failure counter of key, creating it at 1, sets
	// the counter to expire after ttl, and returns the new count.
	Fail(ctx context.Context, key string, ttl time.Duration) (int64, error)

	// ResetFailures deletes the failure counter of key. Deleting an absent
	// counter is not an error.
	ResetFailures(ctx context.Context, key string) error
}
