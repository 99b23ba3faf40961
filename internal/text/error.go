package text

import (
	"fmt"
	"reflect"
)

// Error returns err's text, as err.Error() does, but never panics, so that
// code that reads a handler's error outside the handler (a log record, a
// span, a fault header, written where no Recover catches a panic) can
// always report it. An Error method that panics gives a text that names
// err's type instead: "*pkg.T returned as a nil pointer" for a nil pointer
// (a handler's "var err *T; return err", where T's Error reads its
// fields), else "Error method of pkg.T panicked: " and the panic's value
// (or its type, if printing the value panics too).
// Error(nil) is "".
func Error(err error) (s string) {
	if err == nil {
		return ""
	}
	defer func() {
		if v := recover(); v != nil {
			if r := reflect.ValueOf(err); r.Kind() == reflect.Pointer && r.IsNil() {
				s = fmt.Sprintf("%T returned as a nil pointer", err)
			} else {
				s = fmt.Sprintf("Error method of %T panicked: %s", err, panicValue(v))
			}
		}
	}()
	return err.Error()
}

// MaxError is the most bytes of a handler's error text that the library
// writes into one place: a fault header, a log record's attribute, a
// span's attribute or status. An error that wraps a whole response body
// would otherwise make every delivery's record as big.
const MaxError = 4 << 10

// Capped returns Error(err) cut by Truncate to at most MaxError bytes.
func Capped(err error) string {
	return Truncate(Error(err), MaxError)
}

// panicValue returns v as %v prints it, or its type if printing it panics
// (an error whose Error method panics, raised by the Error method of its
// own type).
func panicValue(v any) (s string) {
	defer func() {
		if recover() != nil {
			s = fmt.Sprintf("%T", v)
		}
	}()
	return fmt.Sprint(v)
}
