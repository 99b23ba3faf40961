package store_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The core packages, the store interface among them, do not link go-redis
// (nor the PostgreSQL driver): only a program that imports the backend's
// package does.
func TestCoreDoesNotLinkClients(t *testing.T) {
	core := []string{"github.com/rabbitmw/rabbitmw", "github.com/rabbitmw/rabbitmw/middleware",
		"github.com/rabbitmw/rabbitmw/store", "github.com/rabbitmw/rabbitmw/store/storetest",
		"github.com/rabbitmw/rabbitmw/broker/...", "github.com/rabbitmw/rabbitmw/rabbitmwtest"}
	out, err := exec.Command("go", append([]string{"list", "-deps"}, core...)...).CombinedOutput()
	require.NoError(t, err, "go list -deps: %s", out)
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "github.com/redis/go-redis/") || strings.HasPrefix(p, "github.com/jackc/pgx/") ||
			strings.HasSuffix(p, "/redisstore") || strings.HasSuffix(p, "/pgstore") {
			t.Errorf("go list -deps of the core lists %s", p)
		}
	}
}
