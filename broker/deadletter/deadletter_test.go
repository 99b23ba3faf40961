package deadletter

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/rabbitmw/rabbitmw"
	"github.com/rabbitmw/rabbitmw/broker"
)

// behaviours run on both backends.
var behaviours = []struct {
	name string
	run  func(t *testing.T, be backend)
}{
	{"ListKeepsTheQueue", testListKeepsTheQueue},
	{"FirstFailureIsTheHandlers", testFirstFailureIsTheHandlers},
	{"ReplaySelected", testReplaySelected},
	{"ReplayedMessageFailsAgain", testReplayFailsAgain},
	{"ReplayOfServerDeadLetters", testReplayServerDeadLetters},
	{"ReplayOfAForwardedDeadLetter", testReplayForwardedDeadLetter},
	{"ReplayToMissingQueue", testReplayMissingQueue},
	{"ReplayOfADeadLetterNamingAnotherQueue", testReplayForeignQueue},
	{"MalformedHeaders", testDLQMalformed},
	{"PurgeSelected", testPurgeSelected},
	{"ExportImport", testExportImport},
	{"ExportImportTimestampsBeyondRFC3339", testExportImportTimestampsBeyondRFC3339},
}

func TestDeadLetterOperations(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			for _, c := range behaviours {
				t.Run(c.name, func(t *testing.T) { c.run(t, be) })
			}
		})
	}
}

// typedErr gives dead-lettered messages an error type of their own.
type typedErr struct{ msg string }

func (e *typedErr) Error() string { return e.msg }

// deadLetter sends the messages ids through a consumer that dead-letters
// each at its first call; with retryFirst, each is retried once first, so
// that its x-death holds a delay queue's record. Messages whose id has
// the prefix "typed" fail with a *typedErr.
func (f *fixture) deadLetter(t *testing.T, retryFirst bool, headers amqp.Table, ids ...string) {
	t.Helper()
	dlq0 := f.length(f.q + ".dlq")
	j := newJournal()
	r := f.consume(rabbitmw.HandlerFunc(func(ctx context.Context, d *amqp.Delivery) error {
		if j.record(d) == 1 && retryFirst {
			return rabbitmw.RetryAfter(errBoom, 50*time.Millisecond)
		}
		if strings.HasPrefix(d.MessageId, "typed") {
			return rabbitmw.Permanent(&typedErr{"typed failure of " + d.MessageId})
		}
		return rabbitmw.Permanent(fmt.Errorf("failure of %s: %w", d.MessageId, errBoom))
	}), broker.ConsumeOptions{Workers: 1})
	for _, id := range ids {
		f.publish(id, []byte("body of "+id), headers)
	}
	require.Eventually(t, func() bool { return f.length(f.q+".dlq") == dlq0+len(ids) }, 30*time.Second, 10*time.Millisecond, "messages not dead-lettered")
	require.NoError(t, r.stop(t), "Consume after cancel")
}

func ids(dls []*Message) []string {
	out := []string{}
	for _, dl := range dls {
		out = append(out, dl.ID)
	}
	return out
}

func deliveryIDs(ds []*amqp.Delivery) []string {
	out := []string{}
	for _, d := range ds {
		out = append(out, d.MessageId)
	}
	return out
}
