package broker

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A wrong password is fatal at once, with a clear error, for Consume and
// for Publish; the password appears in no error.
func TestRabbitMQWrongPassword(t *testing.T) {
	u, err := url.Parse(testenv.RabbitMQURL(t))
	noErr(t, "parse URL", err)
	u.User = url.UserPassword(u.User.Username(), "wrong-password-x")
	b := New(u.String(), Options{ReconnectMin: 10 * time.Millisecond})
	defer b.Close()
	ctx := testContext(t, 20*time.Second)
	start := time.Now()
	err = b.Consume(ctx, queueName(t), rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }), ConsumeOptions{})
	isErr(t, "Consume with a wrong password", err, ErrAccessRefused)
	contains(t, "error", err.Error(), "password")
	if strings.Contains(err.Error(), "wrong-password-x") {
		t.Errorf("error %q shows the password", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("Consume took %v to fail; want a prompt fatal error", took)
	}
	err = b.Publish(ctx, "", "any", amqp.Publishing{})
	isErr(t, "Publish with a wrong password", err, ErrAccessRefused)
	noErr(t, "context (Publish gave up at once)", ctx.Err())
	var ae *amqp.Error
	if !errors.As(err, &ae) || ae.Code != amqp.AccessRefused {
		t.Errorf("Publish error %v does not wrap the 403 amqp.Error", err)
	}
}
