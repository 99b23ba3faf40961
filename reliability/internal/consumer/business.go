package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/middleware"
)

// applyEffect is the business effect: counted per message, in total, and
// in distinct messages, and logged with who applied it, all at once.
// KEYS: effect:<key>, total, distinct, log. ARGV: the log entry.
var applyEffect = redis.NewScript(`
local n = redis.call('INCR', KEYS[1])
redis.call('INCR', KEYS[2])
if n == 1 then
  redis.call('INCR', KEYS[3])
end
redis.call('RPUSH', KEYS[4], ARGV[1])
return n`)

// A poison-mode body is a JSON object; its kind says what the handler does
// with it. A body that is not JSON is malformed: dead-lettered at once.
type order struct {
	Kind string `json:"kind"` // "ok" (or absent), "poison", "fail", "panic", "retry"
	// Fails and After are for kind "retry": the handler's first Fails
	// calls return rabbitmw.RetryAfter with After (a time.Duration string;
	// default 1ms); the calls after them succeed.
	Fails int64  `json:"fails"`
	After string `json:"after"`
}

var (
	errPoison  = errors.New("business: order refused: poison")
	errGateway = errors.New("business: payment gateway failed")
)

type business struct {
	cfg     config
	rdb     *redis.Client
	effects *atomic.Int64
}

func (b *business) key(name string) string { return b.cfg.effectsPrefix + name }

func (b *business) handler() rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		id, err := middleware.Key(d)
		if err != nil {
			return rabbitmw.Permanent(err) // Dedup refuses such a delivery first
		}
		switch b.cfg.mode {
		case "slow", "stubborn":
			return b.slow(ctx, id)
		case "poison":
			return b.poison(ctx, id, d.Body)
		}
		if b.cfg.work > 0 {
			if err := wait(ctx, b.cfg.work); err != nil {
				return err
			}
		}
		return b.apply(ctx, id)
	})
}

// apply applies the effect of message id.
func (b *business) apply(ctx context.Context, id string) error {
	keys := []string{b.key("effect:" + id), b.key("total"), b.key("distinct"), b.key("log")}
	if err := applyEffect.Run(ctx, b.rdb, keys, b.cfg.name+" "+id).Err(); err != nil {
		return fmt.Errorf("business: applying the effect of %s: %w", id, err)
	}
	b.effects.Add(1)
	return nil
}

// slow holds the message for -hold, then applies its effect. In slow mode
// it honours ctx: when ctx is done first it records the cancellation and
// its cause, and applies nothing. In stubborn mode it ignores ctx, as a
// handler that does not watch its context would.
func (b *business) slow(ctx context.Context, id string) error {
	b.event(ctx, "start", id, "")
	b.rdb.Incr(context.WithoutCancel(ctx), b.key("attempts:"+id))
	if b.cfg.mode == "stubborn" {
		time.Sleep(b.cfg.hold)
		if ctx.Err() != nil {
			b.event(ctx, "ignored", id, context.Cause(ctx).Error())
		}
		return b.apply(context.WithoutCancel(ctx), id)
	}
	if err := wait(ctx, b.cfg.hold); err != nil {
		b.event(ctx, "cancelled", id, context.Cause(ctx).Error())
		return err
	}
	return b.apply(ctx, id)
}

// poison handles a JSON order by its kind.
func (b *business) poison(ctx context.Context, id string, body []byte) error {
	// On a Redis error calls is 0: a "retry" order asks for a retry.
	calls, _ := b.rdb.Incr(ctx, b.key("attempts:"+id)).Result()
	var o order
	if err := json.Unmarshal(body, &o); err != nil {
		return rabbitmw.Permanent(fmt.Errorf("business: malformed order: %w", err))
	}
	switch o.Kind {
	case "", "ok":
		return b.apply(ctx, id)
	case "poison":
		return rabbitmw.Permanent(errPoison)
	case "fail":
		return errGateway
	case "panic":
		panic("business: order " + id + " panicked")
	case "retry":
		if calls > o.Fails {
			return b.apply(ctx, id)
		}
		after := time.Millisecond
		if o.After != "" {
			d, err := time.ParseDuration(o.After)
			if err != nil {
				return rabbitmw.Permanent(fmt.Errorf("business: order after %q: %w", o.After, err))
			}
			after = d
		}
		return rabbitmw.RetryAfter(errGateway, after)
	}
	return rabbitmw.Permanent(fmt.Errorf("business: unknown order kind %q", o.Kind))
}

// countDeliveries is a layer that counts each delivery of a message.
func (b *business) countDeliveries(next rabbitmw.Handler) rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if id, err := middleware.Key(d); err == nil {
			b.rdb.Incr(ctx, b.key("deliveries:"+id))
		} else {
			b.rdb.Incr(ctx, b.key("deliveries:(no key)"))
		}
		return next.Handle(ctx, d)
	})
}

// event records what a slow handler did, best effort.
func (b *business) event(ctx context.Context, what, id, cause string) {
	e := what + " " + b.cfg.name + " " + id
	if cause != "" {
		e += " " + cause
	}
	b.rdb.RPush(context.WithoutCancel(ctx), b.key("events"), e)
}

// wait waits for d, or until ctx is done (its error then).
func wait(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
