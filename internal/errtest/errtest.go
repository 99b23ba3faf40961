// Package errtest holds errors whose Error method panics, for the tests
// of the code that reads a handler's error outside the handler (a log
// record, a span, a fault header), where a panic is no failed attempt.
package errtest

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
