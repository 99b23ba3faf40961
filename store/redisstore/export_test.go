package redisstore

// Queued returns the number of calls waiting for the next pipeline.
func (b *Batcher) Queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.queue)
}

var (
	IsSyntaxError = isSyntaxError
	IsWrongType   = isWrongType
)

// Batcher returns the batcher New put over the store's client, or nil.
func (r *Store) Batcher() *Batcher {
	b, _ := r.cmds.(*Batcher)
	return b
}

// Batched reports whether New put a batcher over the store's client.
func (r *Store) Batched() bool { return r.cmds != r.client }
