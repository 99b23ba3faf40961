package expiration

import "testing"

// What RabbitMQ 3.10 takes and refuses, as found by publishing each.
func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		s  string
		ok bool
	}{
		{"", true}, {"0", true}, {"60000", true}, {"007", true}, {"+5", true}, {"-0", true},
		{"315360000000", true}, {"315360000001", false}, {"18446744073709551616", false},
		{"-1", false}, {"1.5", false}, {"60s", false}, {" 5", false}, {"5 ", false},
		{"1e3", false}, {"+", false}, {"-", false}, {"+-5", false}, {"abc", false},
	} {
		if err := Check(tc.s); (err == nil) != tc.ok {
			t.Errorf("Check(%q) = %v; want ok %v", tc.s, err, tc.ok)
		}
	}
}
