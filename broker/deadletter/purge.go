package deadletter

import (
	"context"
	"errors"
	"fmt"

	"github.com/rabbitmw/rabbitmw/broker/internal/expose"
)

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
// their order. It reads the queue as [Inspector.List] does. A message
// counts as removed once the server has processed its acknowledgement (a
// round trip after each batch of acks): if the connection drops before,
// the server puts the message back. With an error, the messages returned
// are those removed before it; the error says how many more were
// acknowledged without a word from the server, and may be back. Once ctx
// ends it acknowledges nothing more, and waits, up to 5 seconds, for the
// server's word on what it has acknowledged; an abort (see [WithAbort])
// ends the wait at once.
func (in *Inspector) Purge(ctx context.Context, queue string, opts PurgeOptions) ([]*Message, error) {
	snap, err := in.snapshot(ctx, queue, opts.ScanProgress)
	if err != nil {
		return nil, err
	}
	var removed, acked []*Message
	// confirm waits until the server has processed the acks sent, and
	// counts their messages removed.
	confirm := func() error {
		if len(acked) == 0 {
			return nil
		}
		// The acks are sent: after ctx's end too, the server's word on
		// them is worth a wait (see finishing).
		sctx, stop := finishing(ctx)
		defer stop()
		if err := snap.s.SyncGets(sctx); err != nil {
			return fmt.Errorf("deadletter: purge: %d message(s) acknowledged, and not confirmed removed (they may be back in the dead-letter queue): %w",
				len(acked), expose.LostError(err))
		}
		removed = append(removed, acked...)
		acked = acked[:0]
		return nil
	}
	for i, dl := range snap.msgs {
		if opts.Limit > 0 && len(removed)+len(acked) == opts.Limit {
			break
		}
		if !opts.Filter.match(dl) {
			continue
		}
		if opts.DryRun {
			removed = append(removed, dl)
			continue
		}
		if err := ctx.Err(); err != nil {
			err = errors.Join(err, confirm())
			snap.close(in)
			return removed, err
		}
		err := snap.ack(i)
		if err == nil {
			acked = append(acked, dl)
			if len(acked) == purgeBatch {
				err = confirm()
			}
		} else if len(acked) > 0 {
			err = fmt.Errorf("deadletter: purge: %d message(s) acknowledged, and not confirmed removed (they may be back in the dead-letter queue): %w", len(acked), err)
		}
		if err != nil {
			snap.close(in)
			return removed, err
		}
	}
	if err := confirm(); err != nil {
		snap.close(in)
		return removed, err
	}
	return removed, snap.close(in)
}

// purgeBatch is the number of acks Purge sends before it waits for the
// server to have processed them.
const purgeBatch = 256
