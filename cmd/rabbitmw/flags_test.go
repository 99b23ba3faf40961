package main

import (
	"bytes"
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

func TestAMQPFlagTakesSeveralURLs(t *testing.T) {
	var c common
	fs := (&env{stdout: io.Discard}).newFlags("t")
	c.register(fs, false)
	require.NoError(t, fs.Parse([]string{"--amqp", "amqp://a/", "--amqp", "amqp://b/, amqp://c/"}))
	assert.Equal(t, urlList{"amqp://a/", "amqp://b/", "amqp://c/"}, c.urls)
	assert.Error(t, fs.Parse([]string{"--amqp", "amqp://a/,,amqp://b/"}), "an empty URL")
}

// The commands connect to the node of the list that answers.
func TestCommandsUseEveryNode(t *testing.T) {
	url := testenv.RabbitMQURL(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	down := "amqp://guest:guest@" + l.Addr().String() + "/"
	require.NoError(t, l.Close())
	q := "rabbitmw-test-cmd-nodes-" + strings.ReplaceAll(time.Now().Format("150405.000000"), ".", "")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, args := range [][]string{
		{"topology", "declare", "-q", q, "--amqp", down, "--amqp", url + "," + down},
		{"dlq", "list", "-q", q, "--amqp", down + "," + url},
		{"topology", "delete", "-q", q, "--amqp", down, "--amqp", url},
	} {
		var stdout, stderr bytes.Buffer
		code := run(ctx, args, strings.NewReader(""), &stdout, &stderr)
		assert.Equal(t, 0, code, "%v: %s", args, stderr.String())
	}
}
