// Package redisstore is a [store.Store] in Redis, over go-redis: [Store],
// made with [New], and [Batcher], which coalesces the commands of
// concurrent callers into pipelines.
//
// It lives apart from package store, as a database driver lives apart from
// database/sql, so that only a program that imports it links go-redis:
//
//	client := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
//	defer client.Close()
//	st := redisstore.New(redisstore.NewBatcher(client, redisstore.BatcherOptions{}), redisstore.Options{})
//
// The key layout is the one hand-written consumers commonly use (see
// [Store]), so a consumer built on rabbitmw can join a fleet of them on the
// same queue and Redis.
package redisstore
