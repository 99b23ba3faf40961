package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/clock"
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
//
// A kind "slow-<kind>" ("slow" alone is "slow-ok") first holds the order
// for -hold, recording a "start" event, and then does what <kind> says,
// even when its context ended the hold early: as a handler that settles
// its result whatever the shutdown does.
type order struct {
	Kind string `json:"kind"` // "ok" (or absent), "poison", "fail", "once", "panic", "kill", "later", "retry"
	// Fails and After are for kind "retry": the handler's first Fails
	// calls return rabbitmw.RetryAfter with After (a time.Duration string;
	// default 1ms); the calls after them succeed.
	Fails int64  `json:"fails"`
	After string `json:"after"`
}

// laterDelay is the delay a "later" order asks for, longer than any tier
// of the suite: its copy stays in the longest delay queue.
const laterDelay = time.Hour

var (
	errPoison  = errors.New("business: order refused: poison")
	errGateway = errors.New("business: payment gateway failed")
)

type business struct {
	cfg          config
	rdb          *redis.Client
	effects      *atomic.Int64
	effectsTable string // with PostgreSQL: where inTx inserts effects
}

// inTx is the business handler of the PostgreSQL inbox: the effect is a
// row in tx, which commits with the message's done mark. Modes normal,
// slow and stubborn as in handler (stubborn: its statements ignore ctx's
// cancellation too); in poison mode, the orders "ok" and "kill" as in
// poison, the handler calls counted in the effects Redis.
func (b *business) inTx(ctx context.Context, tx pgx.Tx, d *amqp.Delivery) error {
	id, err := middleware.Key(d)
	if err != nil {
		return rabbitmw.Permanent(err)
	}
	switch b.cfg.mode {
	case "slow":
		b.event(ctx, "start", id, "")
		if err := clock.Sleep(ctx, b.cfg.hold); err != nil {
			b.event(ctx, "cancelled", id, context.Cause(ctx).Error())
			return err
		}
	case "stubborn":
		b.event(ctx, "start", id, "")
		time.Sleep(b.cfg.hold)
		if ctx.Err() != nil {
			b.event(ctx, "ignored", id, context.Cause(ctx).Error())
		}
		ctx = context.WithoutCancel(ctx)
	case "poison":
		b.rdb.Incr(ctx, b.key("attempts:"+id))
		var o order
		if err := json.Unmarshal(d.Body, &o); err != nil {
			return rabbitmw.Permanent(fmt.Errorf("business: malformed order: %w", err))
		}
		switch o.Kind {
		case "kill":
			return b.kill()
		case "", "ok":
		default:
			return rabbitmw.Permanent(fmt.Errorf("business: order kind %q is not played over PostgreSQL", o.Kind))
		}
		fallthrough
	default:
		if b.cfg.work > 0 {
			if err := clock.Sleep(ctx, b.cfg.work); err != nil {
				return err
			}
		}
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+b.effectsTable+` (id, consumer) VALUES ($1, $2)`, id, b.cfg.name); err != nil {
		return fmt.Errorf("business: inserting the effect of %s: %w", id, err)
	}
	b.effects.Add(1)
	return nil
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
			if err := clock.Sleep(ctx, b.cfg.work); err != nil {
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
	if err := clock.Sleep(ctx, b.cfg.hold); err != nil {
		b.event(ctx, "cancelled", id, context.Cause(ctx).Error())
		return err
	}
	return b.apply(ctx, id)
}

// poison handles a JSON order by its kind: "once" fails at its first
// handler call (as counted in attempts:<key>), and succeeds after.
func (b *business) poison(ctx context.Context, id string, body []byte) error {
	calls, _ := b.rdb.Incr(ctx, b.key("attempts:"+id)).Result()
	var o order
	if err := json.Unmarshal(body, &o); err != nil {
		return rabbitmw.Permanent(fmt.Errorf("business: malformed order: %w", err))
	}
	if o.Kind == "slow" {
		o.Kind = "slow-ok"
	}
	if kind, ok := strings.CutPrefix(o.Kind, "slow-"); ok {
		b.event(ctx, "start", id, "")
		_ = clock.Sleep(ctx, b.cfg.hold) // the kind decides, however the hold ended
		o.Kind = kind
	}
	switch o.Kind {
	case "", "ok":
		if b.cfg.work > 0 {
			if err := clock.Sleep(ctx, b.cfg.work); err != nil {
				return err
			}
		}
		return b.apply(ctx, id)
	case "kill":
		return b.kill()
	case "poison":
		return rabbitmw.Permanent(errPoison)
	case "fail":
		return errGateway
	case "once":
		if calls <= 1 {
			return errGateway
		}
		return b.apply(ctx, id)
	case "panic":
		panic("business: order " + id + " panicked")
	case "later":
		return rabbitmw.RetryAfter(errGateway, laterDelay)
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

// kill kills the process, as an OOM kill or a segfault in cgo would: at
// once, with the other handlers in flight, nothing returned, nothing
// released. It returns only if it could not.
func (b *business) kill() error {
	self, err := os.FindProcess(os.Getpid())
	if err == nil {
		err = self.Kill() // SIGKILL
	}
	if err != nil {
		return fmt.Errorf("business: killing the process: %w", err)
	}
	select {}
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

// countAbandoned is a layer, beneath Retry and above Dedup, that counts
// the deliveries that found their message's last attempt abandoned.
func (b *business) countAbandoned(next rabbitmw.Handler) rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		err := next.Handle(ctx, d)
		if errors.Is(err, middleware.ErrAbandoned) {
			if id, kerr := middleware.Key(d); kerr == nil {
				b.rdb.Incr(context.WithoutCancel(ctx), b.key("abandoned:"+id))
			}
			b.rdb.Incr(context.WithoutCancel(ctx), b.key("abandoned"))
		}
		return err
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
