//go:build reliability

package reliability_test

// Scenario 3 over the PostgreSQL inbox: the database, which holds both the
// store and the effects, is a cluster of the test's own. It is stopped at
// once (immediate shutdown, as a crash) mid-stream for a few seconds, then
// started again on the same port and data directory. Meanwhile claims
// fail (fail closed: the message goes to a delay queue), and the
// transactions in flight break before or after their commit: those that
// committed left their effect and done mark, the others neither. The
// consumer reconnects by itself. Nothing twice, nothing lost.

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestPostgresOutage(t *testing.T) {
	const (
		messages = 3000
		dups     = messages / 5
		outage   = 5 * time.Second
		workers  = 4
	)
	db := startPostgresServer(t)
	ctx, r := startLoad(t, loadSpec{
		scenario: "pgoutage",
		delays:   tiers,
		messages: messages,
		dups:     dups,
		stream:   3,
		postgres: db.url,
		opts: consumerOpts{
			workers:     workers,
			work:        2 * time.Millisecond,
			busy:        500 * time.Millisecond,
			unavailable: 500 * time.Millisecond,
			lease:       5 * time.Second,
			timeout:     4 * time.Second,
		},
		consumers: []string{"pgoutage-A"},
	})
	p := r.procs[0]
	r.outage(ctx, t, serverOutage{
		what:   "the database",
		length: outage,
		count:  "distinct",
		stop:   db.stop,
		start:  db.start,
		back: func() {
			require.NoError(t, p.unexpectedExit(), "the consumer did not survive the outage")
		},
	})
	e := r.wrapUp(ctx, 4*time.Second, p)
	e.wantEachOnce(t)
	if e.stats[0].Unavailable == 0 {
		t.Errorf("the consumer never found the database unavailable (%+v); the outage did not reach it", e.stats[0])
	}
	t.Logf("consumer: %+v; took %v", e.stats[0], time.Since(r.began).Round(time.Millisecond))
	record(t, e.v.counted(row{
		Scenario:   "3 PostgreSQL outage, inbox",
		Messages:   messages,
		Duplicates: dups,
		Faults:     fmt.Sprintf("database stopped (immediate) for %v, restarted", outage),
		Note:       fmt.Sprintf("store and effects in one database; %d deliveries found it unavailable", e.stats[0].Unavailable),
	}))
}
