package broker

import (
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	b := newBackoff(100*time.Millisecond, 2*time.Second)
	ceilings := []time.Duration{100, 200, 400, 800, 1600, 2000, 2000}
	for i, c := range ceilings {
		c *= time.Millisecond
		for range 50 {
			bb := *b
			if d := bb.next(); d < 0 || d > c {
				t.Fatalf("wait %d = %v; want in [0, %v]", i, d, c)
			}
		}
		b.next()
	}
	b = newBackoff(time.Second, time.Hour)
	for range 200 {
		if d := b.next(); d < 0 || d > time.Hour {
			t.Fatalf("wait after many attempts = %v; want in [0, 1h]", d)
		}
	}
	b.reset()
	if d := b.next(); d > time.Second {
		t.Errorf("wait after reset = %v; want <= 1s", d)
	}
}
