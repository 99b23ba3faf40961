package storetest

import (
	"testing"
	"time"

	"github.com/rabbitmw/rabbitmw/store"
)

// RunInspector checks that a store implementing [store.Inspector] reports
// each state of a key as the other methods left it. It fails the test if
// the store returned by newStore is not an Inspector.
func RunInspector(t *testing.T, newStore func(t *testing.T) store.Store) {
	t.Helper()
	s := newStore(t)
	in, ok := s.(store.Inspector)
	if !ok {
		t.Fatalf("%T does not implement store.Inspector", s)
	}
	k := "storetest:inspect:" + randomHex(6)
	inspect := func(what string, status store.Status, token string, failures int64) store.KeyState {
		t.Helper()
		got, err := in.Inspect(bg, k)
		if err != nil {
			t.Fatalf("%s: Inspect = %v; want nil error", what, err)
		}
		if got.Status != status || got.Token != token || got.Failures != failures {
			t.Errorf("%s: Inspect = %s %q, %d failures; want %s %q, %d",
				what, got.State(), got.Token, got.Failures, store.KeyState{Status: status}.State(), token, failures)
		}
		return got
	}
	inspect("absent", 0, "", 0)
	if _, err := s.Claim(bg, k, "host/42/ab/1", longTTL); err != nil {
		t.Fatal(err)
	}
	if got := inspect("claimed", store.Processing, "host/42/ab/1", 0); got.TTL <= longTTL/2 || got.TTL > longTTL {
		t.Errorf("claimed: TTL = %v; want about %v", got.TTL, longTTL)
	}
	if _, err := s.Fail(bg, k, longTTL); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Fail(bg, k, longTTL); err != nil {
		t.Fatal(err)
	}
	if got := inspect("claimed, failed twice", store.Processing, "host/42/ab/1", 2); got.FailuresTTL <= longTTL/2 || got.FailuresTTL > longTTL {
		t.Errorf("failed: FailuresTTL = %v; want about %v", got.FailuresTTL, longTTL)
	}
	if err := s.Complete(bg, k, "host/42/ab/1", 2*longTTL); err != nil {
		t.Fatal(err)
	}
	if got := inspect("done", store.Done, "", 2); got.TTL <= longTTL || got.TTL > 2*longTTL {
		t.Errorf("done: TTL = %v; want about %v", got.TTL, 2*longTTL)
	}
	if err := s.ResetFailures(bg, k); err != nil {
		t.Fatal(err)
	}
	inspect("done, failures reset", store.Done, "", 0)
	k = "storetest:inspect:" + randomHex(6)
	if _, err := s.Claim(bg, k, "t", shortTTL); err != nil {
		t.Fatal(err)
	}
	time.Sleep(expired) // the backend's clock
	inspect("lease ended", store.Abandoned, "t", 0)
	if st, err := s.Claim(bg, k, "t2", longTTL); err != nil || st != store.Abandoned {
		t.Fatalf("Claim after the lease = %v, %v; want abandoned", st, err)
	}
	inspect("abandoned claim reported", 0, "", 0)
}
