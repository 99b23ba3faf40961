package broker

import (
	"context"
	"errors"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

// A wrong password is fatal at once, with a clear error, for Consume and
// for Publish; the password appears in no error.
func TestRabbitMQWrongPassword(t *testing.T) {
	u, err := url.Parse(testenv.RabbitMQURL(t))
	require.NoError(t, err, "parse URL")
	u.User = url.UserPassword(u.User.Username(), "wrong-password-x")
	b := New(u.String(), Options{ReconnectMin: 10 * time.Millisecond})
	defer b.Close()
	ctx := testContext(t, 20*time.Second)
	start := time.Now()
	err = b.Consume(ctx, queueName(t), rabbitmw.HandlerFunc(func(context.Context, *amqp.Delivery) error { return nil }), ConsumeOptions{})
	require.ErrorIs(t, err, ErrAccessRefused, "Consume with a wrong password")
	assert.Contains(t, err.Error(), "password", "error")
	if strings.Contains(err.Error(), "wrong-password-x") {
		t.Errorf("error %q shows the password", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("Consume took %v to fail; want a prompt fatal error", took)
	}
	err = b.Publish(ctx, "", "any", amqp.Publishing{})
	require.ErrorIs(t, err, ErrAccessRefused, "Publish with a wrong password")
	require.NoError(t, ctx.Err(), "context (Publish gave up at once)")
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
	require.NoError(t, b.Declare(ctx, q, top))
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

// Consume returns soon after its cancellation on a socket the server no
// longer reads: basic.cancel, whose cancel-ok never comes, and the
// requeues are cut after closeTimeout, and the connection closed. The
// server then requeues every message: none was settled.
func TestRabbitMQConsumeReturnsOnAStalledSocket(t *testing.T) {
	f := setup(t, backends[1], Topology{})
	uri, err := amqp.ParseURI(testenv.RabbitMQURL(t))
	require.NoError(t, err, "ParseURI")
	px := startStallProxy(t, net.JoinHostPort(uri.Host, strconv.Itoa(uri.Port)))
	uri.Host, uri.Port = "127.0.0.1", px.port()
	// A long heartbeat: the server does not end the connection itself.
	cfg := f.b.cfg
	cfg.heartbeat = time.Minute
	b := newBroker(newAMQPTransport(uri.String(), cfg), cfg)

	started, release := make(chan struct{}), make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		// One worker: a is in its handler, b and c received and not
		// started, when the socket stalls.
		done <- b.Consume(ctx, f.q, rabbitmw.HandlerFunc(func(_ context.Context, d *amqp.Delivery) error {
			if d.MessageId == "a" {
				close(started)
				<-release
			}
			return nil
		}), ConsumeOptions{Workers: 1, Prefetch: 16, Topology: f.top})
	}()
	f.publish("a", nil, nil)
	<-started
	f.publish("b", nil, nil)
	f.publish("c", nil, nil)
	require.Eventually(t, func() bool { return f.polledLength(f.q) == 0 }, 20*time.Second, 10*time.Millisecond, "b and c not delivered")
	px.stall()
	began := time.Now()
	cancel()
	close(release)
	const bound = 20 * time.Second // closeTimeout twice, and room
	select {
	case err := <-done:
		require.NoError(t, err, "Consume")
		t.Logf("Consume returned %v after its cancellation", time.Since(began).Round(time.Millisecond))
	case <-time.After(bound):
		t.Errorf("Consume did not return within %v of its cancellation on a stalled socket", bound)
		px.cut()
		<-done
	}
	px.cut() // the server has not seen the connection close
	require.Eventually(t, func() bool { return f.polledLength(f.q) == 3 }, 20*time.Second, 10*time.Millisecond, "messages not requeued")
}
