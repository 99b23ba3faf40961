package rabbitmw

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"unicode"
	"unicode/utf8"
)

// ErrorType returns the type of a failure: the one name by which the
// broker's fault headers, the rabbitmw command's filters and groups,
// middleware.Log and otelmw all know it. It is, for err:
//
//   - "" for nil;
//   - "panic" for a recovered panic (a [PanicError] anywhere in err's
//     tree), whatever was passed to panic: the value is in the text;
//   - the name an error gives itself with a method ErrorType() string,
//     the first one found in err's tree (unless that method panics, as a
//     nil pointer's may): the middleware's sentinels say
//     "busy", "lease_lost", "store_unavailable", "abandoned", "timeout",
//     "no_key" and "key_mismatch", and an application's error may name
//     itself the same way;
//   - "timeout" for context.DeadlineExceeded, "canceled" for
//     context.Canceled;
//   - the Go type of the innermost error of err's chain (following
//     Unwrap, and the first error of several) that has a type of its own,
//     as %T prints it, such as "*json.SyntaxError": errors made by
//     errors.New, fmt.Errorf and errors.Join, and this module's marks that
//     say how to settle ([Permanent], [RetryAfter], [WithAttempts],
//     [NotCounted], and the retry layer's "retries exhausted"), are not
//     types of a failure and are passed over;
//   - "error" when nothing in the chain has a type of its own.
//
// So the type names a class of failure, few in number; what varies from
// one failure to the next is in the error's text.
func ErrorType(err error) string {
	if err == nil {
		return ""
	}
	if _, ok := errors.AsType[*PanicError](err); ok {
		return "panic"
	}
	if n, ok := errors.AsType[interface {
		error
		ErrorType() string
	}](err); ok {
		if t := ownName(n); t != "" {
			return t
		}
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	typ := "error"
	for range 100 { // bound a cyclic chain
		if !anonymous(err) {
			typ = fmt.Sprintf("%T", err)
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			if errs := u.Unwrap(); len(errs) > 0 {
				err = errs[0]
			} else {
				err = nil
			}
		default:
			err = nil
		}
		if err == nil {
			break
		}
	}
	return typ
}

// ownName returns the name n gives itself, or "" if its ErrorType method
// panics (a nil pointer's, whose method reads its fields or has a value
// receiver): its Go type names it then.
func ownName(n interface{ ErrorType() string }) (name string) {
	defer func() {
		if recover() != nil {
			name = ""
		}
	}()
	return n.ErrorType()
}

// anonymous reports whether err's type is no type of a failure: one of
// packages errors and fmt, or an unexported wrapper of this module.
func anonymous(err error) bool {
	t := reflect.TypeOf(err)
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	pkg := t.PkgPath()
	switch {
	case pkg == "errors", pkg == "fmt":
		return true
	case pkg == modulePath || strings.HasPrefix(pkg, modulePath+"/"):
		_, wraps := err.(interface{ Unwrap() error })
		first, _ := utf8.DecodeRuneInString(t.Name())
		return wraps && !unicode.IsUpper(first)
	}
	return false
}

const modulePath = "github.com/rabbitmw/rabbitmw"
