// Package redisstore is a [store.Store] in Redis, over go-redis: [Store],
// made with [New]. By default the store coalesces the commands of
// concurrent calls into pipelines, with a [Batcher]; [Options.NoBatching]
// turns that off. BENCHMARKS.md, at the root of the repository, measures
// what batching saves.
//
// It lives apart from package store, as a database driver lives apart from
// database/sql, so that only a program that imports it links go-redis:
//
//	client := redis.NewClient(&redis.Options{Addr: addr, ContextTimeoutEnabled: true})
//	defer client.Close()
//	st := redisstore.New(client, redisstore.Options{})
//	redis.SetLogger(redisstore.Logging(logger)) // go-redis's own lines, through slog
//
// The key layout is the one hand-written consumers commonly use (see
// [Store]), so a consumer built on rabbitmw can join a fleet of them on the
// same queue and Redis.
package redisstore
