package text_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw/internal/text"
)

// fieldError reads its receiver in Error, as most errors do.
type fieldError struct{ id string }

func (e *fieldError) Error() string { return "order " + e.id }

// nilSafeError has a text of its own for a nil receiver.
type nilSafeError struct{}

func (e *nilSafeError) Error() string {
	if e == nil {
		return "no error at all"
	}
	return "some error"
}

// brokenError panics in Error on any value.
type brokenError struct{}

func (brokenError) Error() string { panic("broken") }

// recursiveError panics in Error with itself, whose text panics too.
type recursiveError struct{}

func (recursiveError) Error() string { panic(recursiveError{}) }

func TestError(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{nil, ""},
		{errors.New("boom"), "boom"},
		{&fieldError{"1"}, "order 1"},
		{(*fieldError)(nil), "*text_test.fieldError returned as a nil pointer"},
		{(*nilSafeError)(nil), "no error at all"},
		{brokenError{}, "Error method of text_test.brokenError panicked: broken"},
		{recursiveError{}, "Error method of text_test.recursiveError panicked: text_test.recursiveError"},
	} {
		var got string
		assert.NotPanics(t, func() { got = text.Error(c.err) }, "%T", c.err)
		assert.Equal(t, c.want, got, "Error(%T)", c.err)
	}
}
