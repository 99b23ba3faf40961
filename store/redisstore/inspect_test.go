package redisstore_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
	"github.com/rabbitmw/rabbitmw/store/storetest"
)

func TestInspect(t *testing.T) {
	t.Run("miniredis", func(t *testing.T) {
		storetest.RunInspector(t, func(t *testing.T) store.Store {
			_, c := newMiniredis(t)
			return redisstore.New(c, redisstore.Options{})
		})
	})
	t.Run("redis", func(t *testing.T) {
		c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t)})
		t.Cleanup(func() { c.Close() })
		storetest.RunInspector(t, func(t *testing.T) store.Store {
			return redisstore.New(c, redisstore.Options{Prefix: "rabbitmw-test:"})
		})
	})
}

// Inspect reads a claim key as Claim decides it: a value Claim takes for a
// claim of a Redis store is Processing while its key's PTTL is more than
// the claim's abandoned retention and Abandoned after (without expiry too),
// and any other value is a hand-written consumer's mark, Processing. On a
// real Redis: miniredis's Lua reads a number past an int64 as nil, where
// Redis's reads it as a float.
func TestInspectAgreesWithClaim(t *testing.T) {
	cases := []struct {
		name  string
		value string
		pttl  time.Duration // 0: no expiry
	}{
		{"a claim", "rabbitmw:claim:60000:tok", 2 * time.Minute},
		{"a claim, its lease ended", "rabbitmw:claim:60000:tok", 30 * time.Second},
		{"a claim without expiry", "rabbitmw:claim:60000:tok", 0},
		{"a retention past a Duration", "rabbitmw:claim:10000000000000:tok", 30 * time.Second},
		{"a retention past an int64", "rabbitmw:claim:99999999999999999999:tok", 30 * time.Second},
		{"a signed retention", "rabbitmw:claim:+60000:tok", 30 * time.Second},
		{"a negative retention", "rabbitmw:claim:-1:tok", 30 * time.Second},
		{"a hand-written mark", "processing", 30 * time.Second},
		{"a hand-written mark without expiry", "processing", 0},
	}
	c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t)})
	t.Cleanup(func() { c.Close() })
	prefix := "rabbitmw-test-inspect-" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	s := redisstore.New(c, redisstore.Options{Prefix: prefix})
	ctx := context.Background()
	for _, tc := range cases {
		k := prefix + "msg:" + tc.name
		t.Cleanup(func() { c.Del(context.Background(), k) })
		require.NoError(t, c.Set(ctx, k, tc.value, tc.pttl).Err())
		got, err := s.Inspect(ctx, tc.name)
		require.NoError(t, err)
		want, err := s.Claim(ctx, tc.name, "other", time.Minute)
		require.NoError(t, err)
		assert.Equal(t, want, got.Status, "%s: Inspect's status; Claim found %s", tc.name, want)
	}
}
