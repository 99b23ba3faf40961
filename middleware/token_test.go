package middleware

import (
	"os"
	"sync"
	"testing"
)

func TestTokenOwner(t *testing.T) {
	for _, c := range []struct {
		token string
		host  string
		pid   int
		ok    bool
	}{
		{"web-1/4242/a1b2c3d4e5f6/1z", "web-1", 4242, true},
		{"processing", "", 0, false},
		{"h/notapid/x/1", "", 0, false},
		{"/1/x/1", "", 0, false},
		{"h/1/x", "", 0, false},
	} {
		host, pid, ok := TokenOwner(c.token)
		if host != c.host || pid != c.pid || ok != c.ok {
			t.Errorf("TokenOwner(%q) = %q, %d, %v; want %q, %d, %v", c.token, host, pid, ok, c.host, c.pid, c.ok)
		}
	}
}

// Tokens made at once on several goroutines are distinct, and each names
// this process.
func TestNewTokenUnique(t *testing.T) {
	const goroutines, each = 8, 100
	got := make([][]string, goroutines)
	var wg sync.WaitGroup
	for g := range got {
		wg.Go(func() {
			for range each {
				got[g] = append(got[g], newToken())
			}
		})
	}
	wg.Wait()
	seen := make(map[string]bool)
	for _, tokens := range got {
		for _, tok := range tokens {
			if seen[tok] {
				t.Fatalf("newToken() = %q twice", tok)
			}
			seen[tok] = true
			if _, pid, ok := TokenOwner(tok); !ok || pid != os.Getpid() {
				t.Fatalf("TokenOwner(%q) = pid %d, %v; want %d, true", tok, pid, ok, os.Getpid())
			}
		}
	}
}
