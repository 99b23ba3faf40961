package rabbitmw_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// typedErr is a user's error type; wrapper a user's wrapper around an
// untyped cause.
type typedErr struct{}

func (typedErr) Error() string { return "typed" }

type wrapper struct{ err error }

func (w *wrapper) Error() string { return "op: " + w.err.Error() }
func (w *wrapper) Unwrap() error { return w.err }

// selfNamed names itself.
type selfNamed struct{}

func (selfNamed) Error() string     { return "over quota" }
func (selfNamed) ErrorType() string { return "quota" }

// nilMapPanic is what Recover makes of a write to a nil map.
func nilMapPanic() (err error) {
	defer func() { err = &rabbitmw.PanicError{Value: recover()} }()
	var m map[string]int
	m["x"] = 1
	return nil
}

func TestErrorType(t *testing.T) {
	jsonErr := json.Unmarshal([]byte("{"), new(any))
	for _, c := range []struct {
		name string
		err  error
		want string
	}{
		{"nil", nil, ""},
		{"errors.New", errors.New("plain"), "error"},
		{"fmt.Errorf wrapping errors.New", fmt.Errorf("decode order 7: %w", errors.New("bad")), "error"},
		{"fmt.Errorf without %w", fmt.Errorf("decode order 7: %v", jsonErr), "error"},
		{"settlement marks are not a type", rabbitmw.Permanent(rabbitmw.WithAttempts(rabbitmw.RetryAfter(errors.New("x"), 1), 3)), "error"},
		{"typed, wrapped", rabbitmw.Permanent(fmt.Errorf("decode: %w", jsonErr)), "*json.SyntaxError"},
		{"a typed value", fmt.Errorf("x: %w", typedErr{}), "rabbitmw_test.typedErr"},
		{"a typed wrapper of an untyped cause", fmt.Errorf("x: %w", &wrapper{errors.New("y")}), "*rabbitmw_test.wrapper"},
		{"joined: the first", errors.Join(jsonErr, errors.New("a")), "*json.SyntaxError"},
		{"a panic", rabbitmw.Permanent(&rabbitmw.PanicError{Value: 1}), "panic"},
		{"a panic of a runtime error", nilMapPanic(), "panic"},
		{"a panic of a typed error", &rabbitmw.PanicError{Value: jsonErr}, "panic"},
		{"an error that names itself", fmt.Errorf("x: %w", selfNamed{}), "quota"},
		{"deadline", fmt.Errorf("call: %w", context.DeadlineExceeded), "timeout"},
		{"Timeout's error", fmt.Errorf("%w after 1s: %w", middleware.ErrTimeout, errors.New("slow")), "timeout"},
		{"canceled", context.Canceled, "canceled"},
		{"busy", rabbitmw.RetryAfter(fmt.Errorf("x: %w", middleware.ErrBusy), 1), "busy"},
		{"lease lost", middleware.ErrLeaseLost, "lease_lost"},
		{"store unavailable", rabbitmw.RetryAfter(middleware.ErrStoreUnavailable, 1), "store_unavailable"},
		{"abandoned", middleware.ErrAbandoned, "abandoned"},
		{"no key", middleware.ErrNoKey, "no_key"},
		{"key mismatch", middleware.ErrKeyMismatch, "key_mismatch"},
	} {
		assert.Equal(t, c.want, rabbitmw.ErrorType(c.err), "%s: ErrorType(%v)", c.name, c.err)
	}
}

// A handler's error whose ErrorType method panics, as a nil pointer's
// does (a "var err *selfNamed; return err": its methods have value
// receivers), has its Go type for a type: ErrorType is read outside the
// handler, by Log, otelmw and the broker's fault headers, where a panic is
// no failed attempt.
func TestErrorTypeOfANilPointer(t *testing.T) {
	var got string
	assert.NotPanics(t, func() { got = rabbitmw.ErrorType(rabbitmw.Permanent((*selfNamed)(nil))) })
	assert.Equal(t, "*rabbitmw_test.selfNamed", got)
}

// Retry's dead-letter at the limit has the type of its cause.
func TestErrorTypeOfExhaustedRetries(t *testing.T) {
	jsonErr := json.Unmarshal([]byte("{"), new(any))
	for cause, want := range map[error]string{jsonErr: "*json.SyntaxError", errors.New("boom"): "error", nilMapPanic(): "panic"} {
		h := middleware.Retry(nil, middleware.RetryOptions{MaxAttempts: 1, CountByHeader: true})(rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return cause }))
		err := h.Handle(context.Background(), &amqp.Delivery{MessageId: "m"})
		assert.ErrorIs(t, err, middleware.ErrRetriesExhausted)
		assert.Equal(t, want, rabbitmw.ErrorType(err), "ErrorType(%v)", err)
	}
}
