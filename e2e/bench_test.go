package e2e_test

import (
	"testing"

	"github.com/rabbitmw/rabbitmw/internal/benchstack"
	"github.com/rabbitmw/rabbitmw/internal/redistest"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// BenchmarkChain measures the whole recommended stack per delivery, on the
// happy path (a new message id each time: claim, handler, complete) and for
// a duplicate (claim only), over each store; "nop" is a store that claims
// every key and does nothing else, so that its figures are the layers'
// alone. In "new" the handler is the realistic one, which waits on its
// context (it calls ctx.Done once, as any handler doing I/O does); in
// "new-consumer" it is that handler under a context like the one package
// broker gives its handlers (cancellable, counting the writes that record
// an attempt); in "new-ignores-ctx" it does nothing at all. (cd bench &&
// go run . -stack-only) runs the same loops.
func BenchmarkChain(b *testing.B) {
	stores := []struct {
		name string
		new  func(b *testing.B) store.Store
	}{
		{"nop", func(*testing.B) store.Store { return benchstack.NopStore{} }},
		{"memory", func(*testing.B) store.Store { return store.NewMemory() }},
		{"miniredis", func(b *testing.B) store.Store {
			_, c, _ := redistest.Start(b)
			return redisstore.New(c, redisstore.Options{})
		}},
	}
	for _, s := range stores {
		b.Run(s.name+"/new", func(b *testing.B) {
			benchstack.RunWaiting(b, benchstack.Recommended(s.new(b)))
		})
		b.Run(s.name+"/new-consumer", func(b *testing.B) {
			benchstack.RunWaitingInConsumer(b, benchstack.Recommended(s.new(b)))
		})
		b.Run(s.name+"/new-ignores-ctx", func(b *testing.B) {
			benchstack.Run(b, benchstack.Recommended(s.new(b)), false)
		})
		if s.name == "nop" {
			continue // it finds no duplicate
		}
		b.Run(s.name+"/duplicate", func(b *testing.B) {
			benchstack.Run(b, benchstack.Recommended(s.new(b)), true)
		})
	}
}
