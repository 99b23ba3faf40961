package rabbitnode

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// A node starts, serves AMQP, and is gone after Kill.
func TestNodeStartsAndDies(t *testing.T) {
	n := Start(t, Dir(t), Config{Name: "rmwnodetest"})
	conn, err := amqp.Dial(n.URL())
	require.NoError(t, err)
	require.NoError(t, conn.Close())
	n.Kill()
	_, err = amqp.Dial(n.URL())
	require.Error(t, err)
}
