package main

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/rabbitmw/rabbitmw/broker"
)

// A downWatch ends the command once the Broker has been unable to reach
// the server for the timeout: not before, not if a connection came
// meanwhile, and not for a timer of an earlier outage that fires late.
func TestDownWatch(t *testing.T) {
	refused := errors.New("connection refused")
	newWatch := func() (*downWatch, *env, context.Context) {
		e := &env{}
		ctx, cancel := context.WithCancel(context.Background())
		return &downWatch{e: e, timeout: 10 * time.Second, where: "amqp://node/", cancel: cancel}, e, ctx
	}
	t.Run("unreachable for the timeout", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w, e, ctx := newWatch()
			w.reconnect(broker.ReconnectEvent{Err: refused})
			time.Sleep(9 * time.Second)
			w.reconnect(broker.ReconnectEvent{Err: refused}) // tries again: the outage goes on
			synctest.Wait()
			assert.NoError(t, ctx.Err(), "before the timeout")
			time.Sleep(time.Second)
			synctest.Wait()
			assert.Error(t, ctx.Err(), "at the timeout")
			assert.ErrorIs(t, e.lostErr(), refused)
			assert.ErrorContains(t, e.lostErr(), "RabbitMQ at amqp://node/ did not answer again within 10s (--timeout)")
		})
	})
	t.Run("a connection came back", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w, e, ctx := newWatch()
			w.reconnect(broker.ReconnectEvent{Err: refused})
			time.Sleep(9 * time.Second)
			w.connect(broker.ConnectEvent{})
			time.Sleep(time.Minute)
			synctest.Wait()
			assert.NoError(t, ctx.Err())
			assert.NoError(t, e.lostErr())
			w.stop()
		})
	})
	t.Run("a timer of an earlier outage", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w, e, ctx := newWatch()
			w.reconnect(broker.ReconnectEvent{Err: refused}) // arming 1
			w.connect(broker.ConnectEvent{})
			w.reconnect(broker.ReconnectEvent{Err: refused}) // arming 2
			w.fire(1)                                        // arming 1's timer, come late
			assert.NoError(t, ctx.Err(), "ended by the timer of an outage that ended")
			time.Sleep(10 * time.Second)
			synctest.Wait()
			assert.Error(t, ctx.Err(), "the second outage, at its timeout")
			assert.Error(t, e.lostErr())
		})
	})
	t.Run("stopped", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			w, e, ctx := newWatch()
			w.reconnect(broker.ReconnectEvent{Err: refused})
			w.stop()
			time.Sleep(time.Minute)
			synctest.Wait()
			assert.NoError(t, ctx.Err())
			assert.NoError(t, e.lostErr())
		})
	})
}
