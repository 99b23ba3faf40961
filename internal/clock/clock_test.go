package clock

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestSleep(t *testing.T) {
	for _, tc := range []struct {
		name     string
		d        time.Duration
		cancelAt time.Duration // 0: never
		want     error
		took     time.Duration
	}{
		{"the whole wait", time.Second, 0, nil, time.Second},
		{"cut short", time.Second, 300 * time.Millisecond, context.Canceled, 300 * time.Millisecond},
		{"no wait", 0, 0, nil, 0},
		{"negative", -time.Second, 0, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				if tc.cancelAt > 0 {
					time.AfterFunc(tc.cancelAt, cancel)
				}
				began := time.Now()
				err := Sleep(ctx, tc.d)
				assert.ErrorIs(t, err, tc.want, "Sleep(ctx, %v)", tc.d)
				if took := time.Since(began); took != tc.took {
					t.Errorf("Sleep(ctx, %v) took %v; want %v", tc.d, took, tc.took)
				}
			})
		})
	}
}

// A context done before the call: no wait, whatever d, and its error.
func TestSleepDoneContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, d := range []time.Duration{-time.Second, 0, time.Hour} {
		assert.ErrorIs(t, Sleep(ctx, d), context.Canceled, "Sleep(done ctx, %v)", d)
	}
}
