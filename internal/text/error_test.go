package text_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw/internal/errtest"
	"github.com/rabbitmw/rabbitmw/internal/text"
)

// nilSafeError has a text of its own for a nil receiver.
type nilSafeError struct{}

func (e *nilSafeError) Error() string {
	if e == nil {
		return "no error at all"
	}
	return "some error"
}

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
		{&errtest.NilPointer{ID: "1"}, "order 1 rejected"},
		{(*errtest.NilPointer)(nil), "*errtest.NilPointer returned as a nil pointer"},
		{(*nilSafeError)(nil), "no error at all"},
		{errtest.Broken{}, "Error method of errtest.Broken panicked: broken"},
		{recursiveError{}, "Error method of text_test.recursiveError panicked: text_test.recursiveError"},
	} {
		var got string
		assert.NotPanics(t, func() { got = text.Error(c.err) }, "%T", c.err)
		assert.Equal(t, c.want, got, "Error(%T)", c.err)
	}
}

func TestCapped(t *testing.T) {
	assert.Equal(t, "boom", text.Capped(errors.New("boom")))
	long := strings.Repeat("x", 1<<20)
	got := text.Capped(errors.New(long))
	assert.Len(t, got, text.MaxError)
	assert.Equal(t, text.Truncate(long, text.MaxError), got)
	assert.Equal(t, "*errtest.NilPointer returned as a nil pointer", text.Capped((*errtest.NilPointer)(nil)))
}
