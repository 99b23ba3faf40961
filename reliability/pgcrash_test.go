//go:build reliability

package reliability_test

// Scenario 1 over the PostgreSQL inbox: as TestCrash (5,000 messages, a
// fifth repeating an earlier id, SIGKILLs at random moments, a restart
// after each), with the effect a row inserted in the transaction that
// commits the done mark. A kill between the effect and the done mark,
// which on Redis applies the effect a second time, cannot happen here:
// both commit, or neither. Required: no effect twice, nothing lost.

import (
	"fmt"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/internal/testenv"
)

func TestPostgresCrash(t *testing.T) {
	r, e, _ := crash(t, "pgcrash", testenv.PostgresURL(t))
	e.wantEachOnce(t)
	t.Logf("last consumer: %+v; took %v", e.stats[0], time.Since(r.began).Round(time.Millisecond))
	record(t, e.v.counted(row{
		Scenario:   "1 crash, PostgreSQL inbox",
		Messages:   crashMessages,
		Duplicates: crashDups,
		Faults:     fmt.Sprintf("%d × SIGKILL + restart", crashKills),
		Note:       "required: 0 twice (effect and done mark in one commit); Redis: see 1 crash",
	}))
}
