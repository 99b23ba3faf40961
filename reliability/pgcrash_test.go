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
	pgCrash(t, "pgcrash", 0, "1 crash, PostgreSQL inbox", "required: 0 twice (effect and done mark in one commit); Redis: see 1 crash")
}

// TestPostgresCrash with group commit (HandlerOptions.GroupCommit): a kill
// takes whole groups, uncommitted, with it; still no effect twice,
// nothing lost.
func TestPostgresCrashGroupCommit(t *testing.T) {
	pgCrash(t, "pgcrashgroup", 8, "1 crash, PostgreSQL inbox, group commit", "required: 0 twice (each member's effect and done mark in its group's commit)")
}

// pgCrash runs the scenario over the inbox with groupCommit, and records
// its row.
func pgCrash(t *testing.T, scenario string, groupCommit int, name, note string) {
	r, e, _ := crash(t, scenario, testenv.PostgresURL(t), groupCommit)
	e.wantEachOnce(t)
	t.Logf("last consumer: %+v; took %v", e.stats[0], time.Since(r.began).Round(time.Millisecond))
	record(t, e.v.counted(row{
		Scenario:   name,
		Messages:   crashMessages,
		Duplicates: crashDups,
		Faults:     fmt.Sprintf("%d × SIGKILL + restart", crashKills),
		Note:       note,
	}))
}
