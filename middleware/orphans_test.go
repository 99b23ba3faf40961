package middleware

import (
	"context"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
)

// releases records the releases it is asked for, and refuses them while
// down.
type releases struct {
	store.Store
	down bool
	got  []string
}

func (r *releases) Release(_ context.Context, key, _ string) error {
	if r.down {
		return errors.New("connection refused")
	}
	r.got = append(r.got, key)
	return nil
}

func TestOrphans(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	var o orphans
	for i := range maxOrphans + 2 {
		o.add("k"+strconv.Itoa(i), "t", now.Add(time.Hour))
	}
	o.add("ended", "t", now.Add(-time.Second))
	if n := int(o.n.Load()); n != maxOrphans {
		t.Fatalf("orphans kept = %d; want the bound %d", n, maxOrphans)
	}

	s := &releases{Store: store.NewMemory(), down: true}
	if o.release(ctx, s, "k5") {
		t.Errorf("release with the store down reported k5 released")
	}
	if n := int(o.n.Load()); n != maxOrphans {
		t.Errorf("orphans kept after a failed release = %d; want %d", n, maxOrphans)
	}

	s.down = false
	if !o.release(ctx, s, "k5") {
		t.Errorf("release did not report k5, an orphan, released")
	}
	if len(s.got) != maxOrphans-1 {
		t.Errorf("released %d claims; want %d (the oldest two dropped at the bound, the ended one skipped)", len(s.got), maxOrphans-1)
	}
	if s.got[0] != "k3" {
		t.Errorf("first released %q; want k3, the oldest kept", s.got[0])
	}
	if o.n.Load() != 0 || o.release(ctx, s, "k5") {
		t.Errorf("orphans left after a release that succeeded: %d", o.n.Load())
	}
}
