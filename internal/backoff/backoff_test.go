package backoff

import (
	"math"
	"testing"
	"time"
)

func TestDoubled(t *testing.T) {
	const maxD = time.Duration(math.MaxInt64)
	for _, tc := range []struct {
		d       time.Duration
		n       int
		ceiling time.Duration
		want    time.Duration
	}{
		{time.Second, 0, time.Minute, time.Second},
		{time.Second, 1, time.Minute, 2 * time.Second},
		{time.Second, 5, time.Minute, 32 * time.Second},
		{time.Second, 6, time.Minute, time.Minute}, // 64 s: capped
		{time.Second, 6, 64 * time.Second, 64 * time.Second},
		{time.Second, -3, time.Minute, time.Second},
		{0, 3, time.Minute, time.Minute},
		{-time.Second, 1, time.Minute, time.Minute},
		// Overflow: the doubling leaves the int64 range, by a dropped bit,
		// into the sign bit, or by a shift of 64 or more.
		{1, 62, maxD, 1 << 62},
		{1, 63, maxD, maxD},
		{3, 62, maxD, maxD},
		{time.Hour, 40, maxD, maxD},
		{1, 64, maxD, maxD},
		{1, 1000, maxD, maxD},
		{maxD, 1, maxD, maxD},
		{maxD/2 + 1, 1, maxD, maxD},
		{maxD / 2, 1, maxD, maxD - 1},
	} {
		if got := Doubled(tc.d, tc.n, tc.ceiling); got != tc.want {
			t.Errorf("Doubled(%d, %d, %d) = %d; want %d", tc.d, tc.n, tc.ceiling, got, tc.want)
		}
	}
}
