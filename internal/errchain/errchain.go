// Package errchain makes a handler's error safe to read, once, where it
// enters the module's code: errors.Is and errors.As, and this module's
// own walks of an error's tree, never return on a chain that leads back
// to itself, and panic on a nil pointer whose Unwrap, Is or As method
// reads its receiver.
package errchain

import (
	"fmt"

	"github.com/rabbitmw/rabbitmw/internal/text"
)

// The bounds of a walk: an error deeper than MaxDepth (which a cycle is)
// or with more than maxErrors errors in its tree (which errors joined to
// themselves, shared by several branches, may reach without a cycle) is
// malformed.
const (
	MaxDepth  = 100
	maxErrors = 10_000
)

// Safe returns err if its tree is well formed: at most MaxDepth deep, and
// its Unwrap, Is and As methods return without a panic. Else it returns,
// in err's place, a [*Cut] error with err's text, that wraps nothing, so
// that errors.Is and errors.As on it are safe. Safe(nil) is nil, at no
// cost, and an error with a short chain costs a short walk.
//
// Every layer calls Safe on the result of the handler beneath it before
// it reads the result, and so do the functions of package rabbitmw that
// read a handler's error.
func Safe(err error) error {
	if err == nil { // inlined: a nil result costs a comparison
		return nil
	}
	return safe(err)
}

// safe is Safe for an error that is not nil.
func safe(err error) error {
	if why := check(err); why != "" {
		return &Cut{text: text.Error(err), why: why}
	}
	return err
}

// check walks err's tree as errors.Is and errors.As do, and returns why
// it is malformed, or "" if it is not.
func check(err error) (why string) {
	w := walk{}
	defer func() {
		if v := recover(); v != nil {
			why = fmt.Sprintf("the %s method of %T panicked", w.method, w.err)
		}
	}()
	w.tree(err, 0)
	return w.why
}

// walk is the state of check: the error it is at, and the method of it
// that it calls, for the report of a panic.
type walk struct {
	err    error
	method string
	n      int // errors seen
	why    string
}

// tree walks err at depth, and what it wraps, until it finds a fault.
func (w *walk) tree(err error, depth int) {
	for ; err != nil && w.why == ""; depth++ {
		w.n++
		switch {
		case depth >= MaxDepth:
			w.why = fmt.Sprintf("a cycle, or over %d errors deep", MaxDepth)
			return
		case w.n > maxErrors:
			w.why = fmt.Sprintf("over %d errors in its tree", maxErrors)
			return
		}
		w.err = err
		if x, ok := err.(interface{ Is(error) bool }); ok {
			w.method = "Is"
			x.Is(errProbe)
		}
		if x, ok := err.(interface{ As(any) bool }); ok {
			w.method = "As"
			x.As(new(*Cut))
		}
		w.method = "Unwrap"
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, e := range u.Unwrap() {
				w.tree(e, depth+1)
			}
			return
		default:
			return
		}
	}
}

// errProbe is the target with which Safe calls an error's Is method.
var errProbe = &Cut{}

// A Cut error takes the place of a handler's error whose tree is
// malformed (see [Safe]). Its text is the error's, followed by why it
// was cut; it wraps nothing, and its type, for rabbitmw.ErrorType, is
// "malformed_chain".
type Cut struct{ text, why string }

func (e *Cut) Error() string {
	return e.text + " (rabbitmw: malformed error chain cut: " + e.why + ")"
}

// ErrorType names the type of a cut error for rabbitmw.ErrorType.
func (e *Cut) ErrorType() string { return "malformed_chain" }
