package main

import (
	"crypto/md5"
	"encoding/hex"
)

// What the business handler does with a message, by its Type property.
const (
	kindOrder     = "order"      // succeeds
	kindFail      = "fail"       // always fails
	kindPanicOnce = "panic-once" // panics on its first attempt, then succeeds
	kindSlow      = "slow"       // outlives its lease, then succeeds
)

// A scenario is a message published copies times.
type scenario struct {
	id     string // message_id; "" to publish without one
	kind   string
	body   string
	copies int
	atOnce bool // publish the copies concurrently
	what   string
}

// lostAckKey is the message whose first acknowledgement the demo drops.
const lostAckKey = "order-3"

var scenarios = []scenario{
	{id: "order-1", kind: kindOrder, body: `{"amount":1200}`, copies: 1, what: "ordinary message"},
	{id: "order-2", kind: kindOrder, body: `{"amount":800}`, copies: 1, what: "ordinary message"},
	{id: lostAckKey, kind: kindOrder, body: `{"amount":450}`, copies: 1, what: "done, ack lost, redelivered"},
	{id: "dup-1", kind: kindOrder, body: `{"amount":99}`, copies: 3, what: "same message_id published 3 times"},
	{id: "fail-1", kind: kindFail, body: `{"amount":5000}`, copies: 1, what: "handler fails until fixed, then replayed"},
	{id: "panic-1", kind: kindPanicOnce, body: `{"amount":70}`, copies: 1, what: "handler panics once"},
	{id: "", kind: kindOrder, body: `{"sku":"A-7","qty":2}`, copies: 2, what: "no message_id (key: MD5 of body), twice"},
	{id: "slow-1", kind: kindSlow, body: `{"amount":310}`, copies: 1, what: "handler outlives its lease"},
	{id: "race-1", kind: kindOrder, body: `{"amount":15}`, copies: 10, atOnce: true, what: "10 copies at once, 2 consumers"},
}

// key returns the idempotency key of the scenario's message, as
// middleware.Key computes it.
func (s scenario) key() string {
	if s.id != "" {
		return s.id
	}
	sum := md5.Sum([]byte(s.body))
	return hex.EncodeToString(sum[:])
}

// name returns how the table shows the message.
func (s scenario) name() string {
	if s.id != "" {
		return s.id
	}
	return "md5:" + s.key()[:8] + "…"
}

// wantEffects is how many times the message's effect must happen.
func (s scenario) wantEffects() int {
	return 1 // kindFail's once replayed with its cause fixed
}
