package middleware_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/deliverytest"
	"github.com/rabbitmw/rabbitmw/middleware"
)

func panickyHandler(v any) rabbitmw.Handler {
	return rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { panic(v) })
}

func TestRecover(t *testing.T) {
	tests := []struct {
		name       string
		handler    rabbitmw.Handler
		wantValue  any    // the PanicError's value; nil: no panic
		wantText   string // the error text
		wantIs     error
		wantSettle string
	}{
		{
			name:       "no panic passes the result through",
			handler:    rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return errBoom }),
			wantText:   "boom",
			wantSettle: "requeued",
		},
		{
			name:       "a string panic becomes a PanicError",
			handler:    panickyHandler("kaboom"),
			wantValue:  "kaboom",
			wantText:   "panic: kaboom",
			wantSettle: "requeued",
		},
		{
			name:       "an error panic unwraps to the error",
			handler:    panickyHandler(errBoom),
			wantValue:  errBoom,
			wantText:   "panic: boom",
			wantIs:     errBoom,
			wantSettle: "requeued",
		},
		{
			name:       "a permanent error panic still dead-letters",
			handler:    panickyHandler(rabbitmw.Permanent(errBoom)),
			wantText:   "panic: boom",
			wantIs:     errBoom,
			wantSettle: "dead-lettered",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, rec := deliverytest.New("m1", "")
			err := middleware.Recover()(tt.handler).Handle(context.Background(), d)
			if err == nil || err.Error() != tt.wantText {
				t.Fatalf("Recover result = %v; want %q", err, tt.wantText)
			}
			var pe *rabbitmw.PanicError
			if tt.wantValue != nil {
				if !errors.As(err, &pe) || pe.Value != tt.wantValue {
					t.Fatalf("Recover result %#v; want a PanicError with value %v", err, tt.wantValue)
				}
				if !strings.Contains(string(pe.Stack), "panickyHandler") {
					t.Errorf("PanicError stack does not show the panicking function:\n%s", pe.Stack)
				}
			}
			if tt.wantIs != nil && !errors.Is(err, tt.wantIs) {
				t.Errorf("result %v does not wrap %v", err, tt.wantIs)
			}
			if got := deliverytest.Settle(t, d, rec, err); got != tt.wantSettle {
				t.Errorf("settled %s; want %s", got, tt.wantSettle)
			}
		})
	}
}

func TestRecoverNilPanic(t *testing.T) {
	d, _ := deliverytest.New("m1", "")
	err := middleware.Recover()(panickyHandler(nil)).Handle(context.Background(), d)
	var pe *rabbitmw.PanicError
	var pn *runtime.PanicNilError
	if !errors.As(err, &pe) || !errors.As(err, &pn) {
		t.Fatalf("Recover of panic(nil) = %v; want a PanicError holding a *runtime.PanicNilError", err)
	}
}
