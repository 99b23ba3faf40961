package errchain_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/errchain"
	"github.com/rabbitmw/rabbitmw/internal/errtest"
)

// deep returns an error n errors deep: n-1 wraps of one error.
func deep(n int) error {
	err := errors.New("bottom")
	for range n - 1 {
		err = fmt.Errorf("level: %w", err)
	}
	return err
}

// A well-formed error is returned as it is, without an allocation unless
// it has an As method (which Safe calls with a new target).
func TestSafeKeepsAWellFormedError(t *testing.T) {
	boom := errors.New("boom")
	for _, err := range []error{
		nil,
		boom,
		fmt.Errorf("order 7: %w", boom),
		errors.Join(boom, fmt.Errorf("b: %w", boom)),
		&errtest.NilPointer{ID: "1"},
		(*errtest.NilPointer)(nil), // its Error panics, but nothing else
		&errtest.NilIs{Target: boom},
		&errtest.Loop{Next: boom},
		deep(errchain.MaxDepth),
	} {
		got := errchain.Safe(err)
		assert.True(t, got == err, "Safe(%T) = %T; want it unchanged", err, got)
		if _, as := err.(interface{ As(any) bool }); !as {
			assert.Zero(t, testing.AllocsPerRun(10, func() { errchain.Safe(err) }), "allocations of Safe(%T)", err)
		}
	}
}

// A malformed error is cut, with its text and why; what Safe returns is
// safe to walk.
func TestSafeCutsAMalformedError(t *testing.T) {
	cases := []struct{ name, why string }{
		{"Unwrap returns itself", "a cycle, or over 100 errors deep"},
		{"a to b to a", "a cycle, or over 100 errors deep"},
		{"wrapped cycle", "a cycle, or over 100 errors deep"},
		{"join includes itself", "a cycle, or over 100 errors deep"},
		{"joined cycle", "a cycle, or over 100 errors deep"},
		{"nil pointer's Is and As", "the Is method of *errtest.NilIs panicked"},
		{"wrapped nil pointer's Is", "the Is method of *errtest.NilIs panicked"},
		{"nil pointer's Unwrap", "the Unwrap method of *errtest.NilUnwrap panicked"},
	}
	malformed := errtest.MalformedChains()
	require.Len(t, malformed, len(cases))
	for i, c := range malformed {
		require.Equal(t, cases[i].name, c.Name)
		var got error
		errtest.Returns(t, "Safe of "+c.Name, func() { got = errchain.Safe(c.Err) })
		var cut *errchain.Cut
		require.ErrorAs(t, got, &cut, c.Name)
		assert.Nil(t, errors.Unwrap(got), c.Name)
		assert.Equal(t, "malformed_chain", cut.ErrorType())
		text := map[bool]string{true: "order 7: ", false: ""}[c.Name == "wrapped cycle" || c.Name == "wrapped nil pointer's Is"]
		assert.Contains(t, got.Error(), text, c.Name)
		assert.Contains(t, got.Error(), " (rabbitmw: malformed error chain cut: "+cases[i].why+")", c.Name)
		assert.True(t, errchain.Safe(got) == got, "Safe of a cut error keeps it")
	}
	got := errchain.Safe(deep(errchain.MaxDepth + 1))
	assert.EqualError(t, got, deep(errchain.MaxDepth+1).Error()+" (rabbitmw: malformed error chain cut: a cycle, or over 100 errors deep)")
}

// Safe of a nil error, and of an error three deep, as Dedup's duplicate
// is under Retry.
func BenchmarkSafe(b *testing.B) {
	for _, c := range []struct {
		name string
		err  error
	}{{"nil", nil}, {"3-deep", deep(3)}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				errchain.Safe(c.err)
			}
		})
	}
}
