package store_test

import (
	"testing"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/storetest"
)

func TestMemoryInspect(t *testing.T) {
	storetest.RunInspector(t, func(t *testing.T) store.Store { return store.NewMemory() })
}
