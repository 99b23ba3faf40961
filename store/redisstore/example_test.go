package redisstore_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw/store/redisstore"
)

func ExampleNew() {
	srv, _ := miniredis.Run() // in production: your Redis, Sentinel or Cluster
	defer srv.Close()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr(), ContextTimeoutEnabled: true})
	defer client.Close()

	st := redisstore.New(client, redisstore.Options{})
	ctx := context.Background()
	if err := st.Load(ctx); err != nil { // optional: fail fast at start-up
		fmt.Println("Redis:", err)
		return
	}
	first, _ := st.Claim(ctx, "order-42", "worker-a", time.Minute)
	second, _ := st.Claim(ctx, "order-42", "worker-b", time.Minute)
	st.Complete(ctx, "order-42", "worker-a", 24*time.Hour)
	third, _ := st.Claim(ctx, "order-42", "worker-b", time.Minute)
	mark, _ := srv.Get("msg:order-42")
	fmt.Println(first, second, third, mark)
	// Output:
	// claimed processing done done
}
