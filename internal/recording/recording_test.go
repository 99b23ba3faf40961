package recording

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestTrackerCountsTheWritesUnderItsContext(t *testing.T) {
	var tr Tracker
	ctx, cancel := context.WithCancel(With(context.Background(), &tr))
	cancel() // a write is counted whatever its context's state
	now := time.Now()
	a := Begin(ctx, now.Add(time.Second))
	b := Begin(context.WithValue(ctx, struct{}{}, 1), now.Add(3*time.Second))
	n, until := tr.Pending()
	assert.Equal(t, 2, n)
	assert.Equal(t, now.Add(3*time.Second), until)
	b.End()
	a.End()
	n, until = tr.Pending()
	assert.Equal(t, 0, n)
	assert.True(t, until.IsZero(), "until = %v once nothing is pending", until)

	none := Begin(context.Background(), now) // no tracker: nothing to count
	assert.Nil(t, none)
	none.End()
}
