package broker

import (
	"context"
	"errors"
	"fmt"

	"github.com/rabbitmw/rabbitmw/broker/internal/expose"
	"github.com/rabbitmw/rabbitmw/internal/clock"
)

// Package deadletter works on the Broker's server through what this hands
// it (see package expose).
func init() {
	expose.Dial = func(ctx context.Context, b any) (session, error) { return b.(*Broker).dialOwn(ctx) }
	expose.Refusal = refusal
	expose.LostError = lostError
	expose.Republishing = republishing
	expose.AsCopy = asCopy
	expose.WellFormedXDeath = wellFormedXDeath
}

// dialOwn opens a session of the Broker's server that the caller closes,
// trying again while the server is unreachable, until ctx is done; each
// failed try is a Reconnect event, as for the Broker's own connections.
func (b *Broker) dialOwn(ctx context.Context) (session, error) {
	bo := newBackoff(b.cfg.rmin, b.cfg.rmax)
	for {
		s, err := b.dial(ctx, "", "dlq")
		if err == nil || !errors.Is(err, ErrUnreachable) {
			return s, err
		}
		wait := bo.next()
		b.cfg.obs.reconnect("", err, wait)
		if clock.Sleep(ctx, wait) != nil {
			return nil, fmt.Errorf("broker: connect: %w (last error: %w)", ctx.Err(), err)
		}
	}
}
