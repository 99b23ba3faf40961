package storetest_test

import (
	"testing"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/storetest"
)

// A backend proves itself by running the kit in its own tests.
func ExampleRun() {
	_ = func(t *testing.T) { // func TestConformance(t *testing.T) in your package
		storetest.Run(t, func(t *testing.T) store.Store {
			return store.NewMemory() // your backend, empty or with keys of its own
		})
	}
}
