package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/storetest"
)

func TestMemoryConformance(t *testing.T) {
	storetest.Run(t, func(*testing.T) store.Store { return store.NewMemory() })
}

func TestMemoryZeroValue(t *testing.T) {
	var m store.Memory
	if got, err := m.Claim(context.Background(), "k", "t", time.Minute); err != nil || got != store.Claimed {
		t.Fatalf("Claim on a zero Memory = %v, %v; want claimed, nil", got, err)
	}
}

// The sweep must keep a long-running Memory from growing with expired
// entries that are never touched again.
func TestMemorySweepsExpiredEntries(t *testing.T) {
	m := store.NewMemory()
	ctx := context.Background()
	for i := range 5000 {
		k := fmt.Sprint("short-", i)
		if _, err := m.Claim(ctx, k, "t", time.Millisecond); err != nil {
			t.Fatal(err)
		}
		if _, err := m.Fail(ctx, k, time.Millisecond); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(10 * time.Millisecond)
	// A sweep comes within as many writes as the last one kept entries
	// (at most 10,000 here), and it removes every expired entry.
	const live = 20000
	for i := range live {
		if _, err := m.Claim(ctx, fmt.Sprint("live-", i), "t", time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	claims, failures := m.Len()
	if claims != live || failures != 0 {
		t.Fatalf("Len() = %d, %d; want %d, 0", claims, failures, live)
	}
	if held := m.Held(); held != live {
		t.Fatalf("Memory holds %d entries for %d live ones; want the 10,000 expired ones swept", held, live)
	}
}
