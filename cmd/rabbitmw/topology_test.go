package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/broker"
)

// topology delete refuses to delete queues that hold messages, naming
// them, unless told --force: a slip for "show" must not throw away a
// dead-letter queue's messages.
func TestTopologyDeleteKeepsMessages(t *testing.T) {
	b, url, q := setupQueue(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	require.NoError(t, b.Publish(ctx, "", q+".dlq", amqp.Publishing{MessageId: "m"}))

	var stdout, stderr bytes.Buffer
	code := run(ctx, []string{"topology", "delete", "-q", q, "--amqp", url}, strings.NewReader(""), &stdout, &stderr)
	assert.Equal(t, exitRefused, code, "exit code: %s", stderr.String())
	assert.Contains(t, stderr.String(), q+".dlq")
	assert.Contains(t, stderr.String(), "--force")
	n, err := b.Len(ctx, q+".dlq")
	require.NoError(t, err, "the dead-letter queue is still there")
	assert.Equal(t, 1, n, "messages in the dead-letter queue")

	stderr.Reset()
	code = run(ctx, []string{"topology", "delete", "-q", q, "--force", "--amqp", url}, strings.NewReader(""), &stdout, &stderr)
	assert.Equal(t, exitOK, code, "--force: exit code: %s", stderr.String())
	_, err = b.Len(ctx, q+".dlq")
	assert.ErrorIs(t, err, broker.ErrQueueNotFound, "--force: the dead-letter queue is deleted")
}
