// Package backoff holds the arithmetic that the module's exponential
// backoffs share: the broker's reconnections and middleware.Exponential.
package backoff

import "time"

// Doubled returns d doubled n times, d·2ⁿ, or ceiling where that is
// ceiling or more or does not fit in a time.Duration. An n below 0 counts
// as 0; a d of 0 or less gives ceiling.
func Doubled(d time.Duration, n int, ceiling time.Duration) time.Duration {
	n = max(n, 0)
	// A shift that drops a set bit, or sets the sign, overflowed; one of
	// 64 or more gives 0.
	if x := d << n; x > 0 && x < ceiling && x>>n == d {
		return x
	}
	return ceiling
}
