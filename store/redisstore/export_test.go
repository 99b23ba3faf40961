package redisstore

// Queued returns the number of calls waiting for the next pipeline.
func (b *Batcher) Queued() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.queue)
}

var IsSyntaxError = isSyntaxError
