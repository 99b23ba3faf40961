package redisstore

import (
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/store"
)

// ErrWrongType is returned, wrapped, by a call of a [Store] that meets one
// of its keys holding in Redis a value of another type than a string (a
// hash, a list, a set...), which no call of the store writes: something
// else that shares the Redis wrote it under the store's key. Redis answers
// every command that reads the key WRONGTYPE, and will answer it until the
// key is deleted or renamed, so it is no outage: the error also wraps
// store.ErrKeyRejected (its type, for rabbitmw.ErrorType, is
// "key_rejected"), the call changed nothing, and its text names the Redis
// key. So middleware.Dedup dead-letters a message whose claim key is such
// a key, with that reason, rather than take the refusal for an unreachable
// store and try the message again for ever; middleware.Retry counts the
// failures of a message whose failure key is such a key by the attempts
// header alone, the refusal beside each failure.
var ErrWrongType = errors.New("redisstore: key holds a value of another type")

// A wrongTypeError is Redis's WRONGTYPE, err, answered to op on key, in
// Redis key k.
type wrongTypeError struct {
	op, key, k string
	err        error
}

// Error leaves out Redis's own text, which a script's call makes long
// (its traceback, or its SHA1 and line) and says no more.
func (e *wrongTypeError) Error() string {
	return fmt.Sprintf("redisstore: %s %q: Redis key %q holds a value of another type, not a string: %v", e.op, e.key, e.k, store.ErrKeyRejected)
}

func (e *wrongTypeError) Unwrap() []error { return []error{ErrWrongType, store.ErrKeyRejected, e.err} }

// isWrongType reports whether err is Redis's answer to a command on a key
// that holds a value of another type: WRONGTYPE, from a command or, in a
// script, from a call, which Redis before 7.0 (and miniredis) report
// within a script error.
func isWrongType(err error) bool {
	var re redis.Error
	if !errors.As(err, &re) {
		return false
	}
	s := re.Error()
	return strings.HasPrefix(s, "WRONGTYPE ") || strings.Contains(s, ": WRONGTYPE ")
}
