package middleware

// A sentinel is an error of this package that names its type of failure
// (see [rabbitmw.ErrorType]).
type sentinel struct{ text, typ string }

func (e *sentinel) Error() string     { return e.text }
func (e *sentinel) ErrorType() string { return e.typ }
