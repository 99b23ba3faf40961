package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
	"github.com/rabbitmw/rabbitmw/middleware"
	"github.com/rabbitmw/rabbitmw/store"
)

// unrenewable is a store whose Extend blocks until the test ends, as a
// store that stopped answering does: Dedup must cancel the handler before
// the lease ends, on the clock alone.
type unrenewable struct {
	store.Store
	stop <-chan struct{}
}

func (s unrenewable) Extend(context.Context, string, string, time.Duration) error {
	<-s.stop
	return errors.New("store stopped answering")
}

// A handler's call of a real client, blocked when Dedup cancels its
// context because the lease may end (a renewal that does not return),
// returns before the lease ends: net/http's and pgx's do. go-redis (v9)
// does not watch a context's cancellation, the standard library's no more
// than the stack's: with ContextTimeoutEnabled it reads the deadline, and
// its call ends at the deadline of a Timeout below the lease.
func TestDedupCancelsClientCalls(t *testing.T) {
	const lease = 1500 * time.Millisecond // cancelled at 2/3 of it
	ctx := context.Background()

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-r.Context().Done() // a request that never completes
	}))
	defer srv.Close()
	rc := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(t), ContextTimeoutEnabled: true})
	defer rc.Close()
	pool, err := pgxpool.New(ctx, testenv.PostgresURL(t))
	require.NoError(t, err)
	defer pool.Close()
	listKey := fmt.Sprintf("rabbitmw-e2e:%s:%d", t.Name(), time.Now().UnixNano())

	calls := []struct {
		name    string
		timeout time.Duration // the Timeout beneath Dedup
		call    func(ctx context.Context) error
	}{
		{"net/http", time.Hour, func(ctx context.Context) error {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
			if err != nil {
				return err
			}
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
			}
			return err
		}},
		{"go-redis BLPOP at the deadline", lease / 3, func(ctx context.Context) error {
			return rc.BLPop(ctx, 0, listKey).Err() // waits for good on an empty list
		}},
		{"pgx pg_sleep", time.Hour, func(ctx context.Context) error {
			_, err := pool.Exec(ctx, "SELECT pg_sleep(60)")
			return err
		}},
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			stop := make(chan struct{})
			defer close(stop)
			var (
				callErr  error
				returned time.Duration
			)
			start := time.Now()
			h := rabbitmw.Chain(middleware.Dedup(unrenewable{store.NewMemory(), stop}, middleware.DedupOptions{Lease: lease}), middleware.Timeout(c.timeout))(
				rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
					ctx, cancel := context.WithCancel(ctx) // a context the handler derives
					defer cancel()
					callErr = c.call(ctx)
					returned = time.Since(start)
					return callErr
				}))
			d, _ := deliverytest.New("m1", "")
			h.Handle(ctx, d)
			assert.Error(t, callErr, "the call's result")
			assert.Less(t, returned, lease, "the call returned after the lease ended: %v", callErr)
		})
	}
}
