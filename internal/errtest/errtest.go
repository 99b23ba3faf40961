// Package errtest holds errors whose Error method panics, for the tests
// of the code that reads a handler's error outside the handler (a log
// record, a span, a fault header), where a panic is no failed attempt.
package errtest

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

// NilPointer's Error method reads its receiver, as most errors' do: a nil
// *NilPointer (a handler's "var err *NilPointer; return err") panics when
// asked for its text.
type NilPointer struct{ ID string }

func (e *NilPointer) Error() string { return "order " + e.ID + " rejected" }

// Broken's Error method panics, with "broken", on any value.
type Broken struct{}

func (Broken) Error() string { panic("broken") }

// A Case is an error whose Error method panics, with the text and the
// type (rabbitmw.ErrorType) that the code that reads it must give it.
type Case struct {
	Err        error
	Text, Type string
}

// Cases returns a nil *NilPointer and a Broken, each with its text and
// type.
func Cases() []Case {
	return []Case{
		{(*NilPointer)(nil), "*errtest.NilPointer returned as a nil pointer", "*errtest.NilPointer"},
		{Broken{}, "Error method of errtest.Broken panicked: broken", "errtest.Broken"},
	}
}

// Loop is an error whose Unwrap returns the error it holds, which may be
// the Loop itself, or another Loop that leads back to it: a chain with
// no end, on which errors.Is and errors.As never return.
type Loop struct{ Next error }

func (e *Loop) Error() string { return "loop" }
func (e *Loop) Unwrap() error { return e.Next }

// JoinLoop is an error whose Unwrap() []error includes itself.
type JoinLoop struct{ Errs []error }

func (e *JoinLoop) Error() string   { return "join loop" }
func (e *JoinLoop) Unwrap() []error { return e.Errs }

// NilIs is an error whose Is and As methods read their receiver: a nil
// *NilIs (a handler's "var err *NilIs; return err") panics in errors.Is
// and errors.As.
type NilIs struct{ Target error }

func (e *NilIs) Error() string        { return "nil is" }
func (e *NilIs) Is(target error) bool { return e.Target == target }
func (e *NilIs) As(target any) bool   { return e.Target != nil && target == nil }

// NilUnwrap is an error whose Unwrap method reads its receiver: a nil
// *NilUnwrap panics when its chain is walked.
type NilUnwrap struct{ Err error }

func (e *NilUnwrap) Error() string { return "nil unwrap" }
func (e *NilUnwrap) Unwrap() error { return e.Err }

// A Malformed is an error whose chain never ends, or whose methods panic
// as the chain is walked, with a name for the test that runs it.
type Malformed struct {
	Name string
	Err  error
}

// MalformedChains returns errors whose chain errors.Is and errors.As
// cannot walk: they never return, or they panic. Each call returns new
// values.
func MalformedChains() []Malformed {
	self := &Loop{}
	self.Next = self
	a, b := &Loop{}, &Loop{}
	a.Next, b.Next = b, a
	join := &JoinLoop{}
	join.Errs = []error{errors.New("first"), join}
	return []Malformed{
		{"Unwrap returns itself", self},
		{"a to b to a", a},
		{"wrapped cycle", fmt.Errorf("order 7: %w", a)},
		{"join includes itself", join},
		{"joined cycle", errors.Join(errors.New("other"), self)},
		{"nil pointer's Is and As", (*NilIs)(nil)},
		{"wrapped nil pointer's Is", fmt.Errorf("order 7: %w", (*NilIs)(nil))},
		{"nil pointer's Unwrap", (*NilUnwrap)(nil)},
	}
}

// Returns calls f in a goroutine of its own and fails t unless f returns,
// without a panic, within a second: a walk of a malformed chain hangs or
// panics. The goroutine of a call that hangs is left behind.
func Returns(t testing.TB, what string, f func()) {
	t.Helper()
	done := make(chan any, 1)
	go func() {
		defer func() { done <- recover() }()
		f()
	}()
	select {
	case v := <-done:
		if v != nil {
			t.Fatalf("%s panicked: %v", what, v)
		}
	case <-time.After(time.Second):
		t.Fatalf("%s did not return within a second", what)
	}
}
