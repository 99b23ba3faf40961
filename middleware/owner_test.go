package middleware

import "testing"

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
