//go:build reliability

package reliability_test

// Scenario 10 over the PostgreSQL inbox: as TestCrashLoop's classic queue,
// with the orders' effects rows in the transaction that commits their done
// marks. The killer must reach the dead-letter queue after at most
// MaxAttempts deaths, counted through the abandoned claims in pgstore's
// table; no order may be applied twice.

import (
	"testing"

	"github.com/rabbitmw/rabbitmw/broker"
	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

func TestPostgresCrashLoop(t *testing.T) {
	crashLoop(t, "pgcrashloop", broker.Topology{}, testenv.PostgresURL(t))
}
