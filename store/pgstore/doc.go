// Package pgstore is a [store.Store] in PostgreSQL, and a transactional
// inbox on it: a handler whose business effect and done mark commit in one
// transaction, so that a consumer that dies at any moment leaves either
// both or neither, and no effect is ever applied twice.
//
// [Store] holds the claims, done marks and failure counters of message
// keys in two tables ([Schema] gives their SQL; [Store.Migrate] creates
// them). Used on its own, it is a drop-in for the Redis store: the
// recommended stack runs over it unchanged.
package pgstore
