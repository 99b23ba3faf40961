package middleware_test

import (
	"errors"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw/middleware"
)

func TestKey(t *testing.T) {
	tests := []struct {
		id, body string
		want     string
		wantErr  error
	}{
		{id: "order-42", body: "x", want: "order-42"},
		{id: " spaced ", want: " spaced "},
		{body: "hello", want: "5d41402abc4b2a76b9719d911017c592"}, // md5("hello"), as hand-written consumers compute it
		{wantErr: middleware.ErrNoKey},
	}
	for _, tt := range tests {
		got, err := middleware.Key(&amqp.Delivery{MessageId: tt.id, Body: []byte(tt.body)})
		if got != tt.want || !errors.Is(err, tt.wantErr) {
			t.Errorf("Key(id %q, body %q) = %q, %v; want %q, %v", tt.id, tt.body, got, err, tt.want, tt.wantErr)
		}
	}
}
