package store_test

import (
	"testing"

	"github.com/rabbitmw/rabbitmw/store"
)

func TestStatusValid(t *testing.T) {
	for n := -1; n <= 6; n++ {
		s := store.Status(n)
		want := n >= 1 && n <= 4 // the numbers the backends' claims return
		if got := s.Valid(); got != want {
			t.Errorf("Status(%d).Valid() = %v; want %v", n, got, want)
		}
		if got := s.String() != "invalid"; got != want {
			t.Errorf("Status(%d).String() = %q; want a name: %v", n, s.String(), want)
		}
	}
	for n, want := range map[int]store.Status{1: store.Claimed, 2: store.Processing, 3: store.Done, 4: store.Abandoned} {
		if got := store.Status(n); got != want {
			t.Errorf("Status(%d) = %v; want %v (the scripts return these numbers)", n, got, want)
		}
	}
}
