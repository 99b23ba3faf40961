package middleware_test

import (
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/middleware"
)

// Key must never panic, and must keep its contract for any id and body: the
// id when there is one, else a stable 32-character lowercase hex digest of
// a non-empty body, else ErrNoKey.
func FuzzKey(f *testing.F) {
	f.Add("order-42", []byte("x"))
	f.Add("", []byte("hello"))
	f.Add("", []byte{})
	f.Add(" ", []byte{})
	f.Add("ünïcødé\x00id", []byte{0, 0xff, '\n'})
	f.Add("", []byte{0})
	f.Fuzz(func(t *testing.T, id string, body []byte) {
		got, err := middleware.Key(&amqp.Delivery{MessageId: id, Body: body})
		switch {
		case id != "":
			if got != id || err != nil {
				t.Fatalf("Key(id %q, body %q) = %q, %v; want the id, nil", id, body, got, err)
			}
		case len(body) > 0:
			if err != nil || !lowerHex32(got) {
				t.Fatalf("Key(no id, body %q) = %q, %v; want 32 lowercase hex digits, nil", body, got, err)
			}
			// Equal bodies, not the same slice, give the same key.
			again, err := middleware.Key(&amqp.Delivery{Body: append([]byte(nil), body...)})
			if again != got || err != nil {
				t.Fatalf("Key(no id, body %q) = %q, then %q, %v for an equal body; want the same key", body, got, again, err)
			}
		default:
			if got != "" || !errors.Is(err, middleware.ErrNoKey) {
				t.Fatalf("Key(no id, empty body %q) = %q, %v; want \"\", ErrNoKey", body, got, err)
			}
		}
	})
}

func lowerHex32(s string) bool {
	if len(s) != 32 {
		return false
	}
	for _, c := range []byte(s) {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}
