package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/store"
	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

// A key of the store that holds in Redis a value that is not a string (a
// hash, a list, a set, written by something else that shares the Redis) is
// refused by every call that meets it, with an error that wraps
// ErrWrongType and store.ErrKeyRejected and names the Redis key, and is
// left as it is: it will not heal by waiting, so it is no outage. On
// miniredis and on a real Redis, batched and not, and with Claim's script
// alone (a Redis before 7.0).
func TestWrongType(t *testing.T) {
	ops := []struct {
		name   string
		failed bool // the failure key holds the hash, not the claim key
		call   func(ctx context.Context, s *redisstore.Store, key string) error
	}{
		{"Claim", false, func(ctx context.Context, s *redisstore.Store, key string) error {
			_, err := s.Claim(ctx, key, "tok", time.Minute)
			return err
		}},
		{"Extend", false, func(ctx context.Context, s *redisstore.Store, key string) error {
			return s.Extend(ctx, key, "tok", time.Minute)
		}},
		{"Complete", false, func(ctx context.Context, s *redisstore.Store, key string) error {
			return s.Complete(ctx, key, "tok", time.Hour)
		}},
		{"Release", false, func(ctx context.Context, s *redisstore.Store, key string) error {
			return s.Release(ctx, key, "tok")
		}},
		{"Fail", true, func(ctx context.Context, s *redisstore.Store, key string) error {
			_, err := s.Fail(ctx, key, time.Hour)
			return err
		}},
		{"Inspect", false, func(ctx context.Context, s *redisstore.Store, key string) error {
			_, err := s.Inspect(ctx, key)
			return err
		}},
		{"Inspect", true, func(ctx context.Context, s *redisstore.Store, key string) error {
			_, err := s.Inspect(ctx, key)
			return err
		}},
	}
	stores := []struct {
		name string
		new  func(c *redis.Client, prefix string) *redisstore.Store
	}{
		{"batched", func(c *redis.Client, prefix string) *redisstore.Store {
			return redisstore.New(c, redisstore.Options{Prefix: prefix})
		}},
		{"NoBatching", func(c *redis.Client, prefix string) *redisstore.Store {
			return redisstore.New(c, redisstore.Options{Prefix: prefix, NoBatching: true})
		}},
		{"before Redis 7", func(c *redis.Client, prefix string) *redisstore.Store {
			return redisstore.New(&oldRedis{Client: c}, redisstore.Options{Prefix: prefix})
		}},
	}
	for _, srv := range servers {
		t.Run(srv.name, func(t *testing.T) {
			c := srv.client(t)
			ctx := context.Background()
			prefix := "rabbitmw-test-wrongtype-" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
			for _, st := range stores {
				s := st.new(c, prefix)
				for i, op := range ops {
					key := st.name + "-" + op.name + strconv.Itoa(i)
					k := prefix + "msg:" + key
					if op.failed {
						k = prefix + "retry:" + key
					}
					require.NoError(t, c.HSet(ctx, k, "f", "v").Err())
					t.Cleanup(func() { c.Del(context.Background(), k) })

					err := op.call(ctx, s, key)
					what := fmt.Sprintf("%s, %s of %s", st.name, op.name, k)
					require.Error(t, err, what)
					assert.ErrorIs(t, err, store.ErrKeyRejected, what)
					assert.ErrorIs(t, err, redisstore.ErrWrongType, what)
					assert.NotErrorIs(t, err, store.ErrLostClaim, what)
					assert.Contains(t, err.Error(), strconv.Quote(k)+" holds a value of another type", what)
					got, gerr := c.HGet(ctx, k, "f").Result()
					assert.NoError(t, gerr, "%s: the hash after", what)
					assert.Equal(t, "v", got, "%s: the hash after", what)
				}
			}
		})
	}
}

// redisError is an error as go-redis returns Redis's answers.
type redisError string

func (e redisError) Error() string { return string(e) }
func (redisError) RedisError()     {}

// WRONGTYPE is found in the forms that Redis and miniredis give it, the
// answer to a command and to a script's call, and nowhere else.
func TestIsWrongType(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{redisError("WRONGTYPE Operation against a key holding the wrong kind of value"), true},
		// Redis 7, a script's call.
		{redisError("WRONGTYPE Operation against a key holding the wrong kind of value script: 59aac288d8f82e47910a17bc1d36d1acf4ead906, on @user_script:2."), true},
		// Redis before 7.0, a script's call.
		{redisError("ERR Error running script (call to f_59aac288d8f82e47910a17bc1d36d1acf4ead906): @user_script:2: WRONGTYPE Operation against a key holding the wrong kind of value"), true},
		// miniredis, a script's call.
		{redisError("ERR Error compiling script (new function): :2: WRONGTYPE Operation against a key holding the wrong kind of value stack traceback:"), true},
		{fmt.Errorf("wrapped: %w", redisError("WRONGTYPE Operation against a key holding the wrong kind of value")), true},
		{redisError("ERR syntax error"), false},
		{redisError("NOSCRIPT No matching script. Please use EVAL."), false},
		{errors.New("WRONGTYPE not from Redis"), false},
	} {
		if got := redisstore.IsWrongType(tc.err); got != tc.want {
			t.Errorf("isWrongType(%q) = %v; want %v", tc.err, got, tc.want)
		}
	}
}
