package redisstore_test

import (
	"testing"

	"github.com/redis/go-redis/v9"

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
