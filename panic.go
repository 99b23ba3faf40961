package rabbitmw

import (
	"fmt"

	"github.com/rabbitmw/rabbitmw/internal/errchain"
)

// A PanicError is a panic recovered while handling a delivery, turned into
// an error: [middleware.Recover] returns one for a panic in the layers and
// handler beneath it, [middleware.Dedup] for a panic of its Observe on a
// lease renewal's goroutine, and the broker package for a panic that
// escaped the whole chain.
type PanicError struct {
	// Value is the value passed to panic.
	Value any
	// Stack is the goroutine's stack trace at the panic, as formatted by
	// runtime/debug.Stack.
	Stack []byte
}

// Error returns "panic: " followed by the panic value; the stack is not
// included, so the text stays one line fit for a log record or a header.
func (e *PanicError) Error() string {
	return fmt.Sprintf("panic: %v", e.Value)
}

// Unwrap returns the panic value if it is an error (as with
// panic(fmt.Errorf(...))), so errors.Is and errors.As see through the
// panic; otherwise nil. A Permanent or RetryAfter mark in the value
// settles the panic (see [Decide]); an ErrDuplicate or a NotCounted mark
// does not make it a duplicate, or not counted. A value whose tree is
// malformed is returned cut, as Decide cuts one.
func (e *PanicError) Unwrap() error {
	err, _ := e.Value.(error)
	return errchain.Safe(err)
}
