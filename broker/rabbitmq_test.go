package broker

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"sync"
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

// A basic.return names its message only by its properties. Publishes of
// one message id in flight at once, one routable and one not, must each
// get their own result: the unroutable one an error, never a silent nil.
// (Before publishes of one id were serialised, a routed publish to a
// durable queue, whose confirm waits for the disk, took the other's
// return in most rounds.)
func TestRabbitMQSameIDPublishesKeepTheirResults(t *testing.T) {
	b := New(testenv.RabbitMQURL(t), Options{KeepEmptyMessageID: true})
	t.Cleanup(func() { b.Close() })
	ctx := testContext(t, time.Minute)
	q, top := queueName(t), Topology{Delays: []time.Duration{time.Second}}
	if err := b.Declare(ctx, q, top); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Delete(context.Background(), q, top) })
	var routedWrong, droppedSilently int
	for range 100 {
		var routed, unroutable error
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); routed = b.Publish(ctx, "", q, amqp.Publishing{Body: []byte("a")}) }()
		go func() {
			defer wg.Done()
			unroutable = b.Publish(ctx, "", q+"-missing", amqp.Publishing{Body: []byte("b")})
		}()
		wg.Wait()
		if routed != nil {
			routedWrong++
		}
		if !errors.Is(unroutable, ErrUnroutable) {
			droppedSilently++
		}
	}
	if routedWrong > 0 || droppedSilently > 0 {
		t.Errorf("of 100 rounds: %d routed publishes failed, %d unroutable publishes reported published; want 0 and 0", routedWrong, droppedSilently)
	}
	if n, err := b.Len(ctx, q); err != nil || n != 100 {
		t.Errorf("Len(%s) = %d, %v; want the 100 routed messages", q, n, err)
	}
}
