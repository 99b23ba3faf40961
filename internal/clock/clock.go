// Package clock holds the one wait of the module that a context can cut
// short.
package clock

import (
	"context"
	"time"
)

// Sleep waits for d, or until ctx is done, whichever comes first. It
// returns nil once the whole of d has passed, or ctx's error if ctx was
// done first. A d of zero or less does not wait: Sleep then returns ctx's
// error, nil while ctx is not done.
func Sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
