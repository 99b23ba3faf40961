package deadletter

import "context"

// PurgeOptions selects the messages that [Inspector.Purge]
// removes. The zero value removes them all.
type PurgeOptions struct {
	Filter
	// DryRun selects, and removes nothing.
	DryRun bool
	// Limit, if positive, is the largest number of messages removed.
	Limit int
	// ScanProgress, if not nil, is called as the dead-letter queue is read
	// (see ListOptions.Progress).
	ScanProgress func(done, total int)
}

// Purge removes from the dead-letter queue of work queue queue
// the messages that opts selects, and returns them; the others stay, in
// their order. It reads the queue as [Inspector.List] does. With an
// error, the messages returned are those removed before it.
func (in *Inspector) Purge(ctx context.Context, queue string, opts PurgeOptions) ([]*Message, error) {
	snap, err := in.snapshot(ctx, queue, opts.ScanProgress)
	if err != nil {
		return nil, err
	}
	var removed []*Message
	for i, dl := range snap.msgs {
		if opts.Limit > 0 && len(removed) == opts.Limit {
			break
		}
		if !opts.Filter.match(dl) {
			continue
		}
		if !opts.DryRun {
			if err := snap.ack(i); err != nil {
				snap.close(in)
				return removed, err
			}
		}
		removed = append(removed, dl)
	}
	return removed, snap.close(in)
}
