package header

import (
	"math"
	"testing"
)

func TestIntAndInteger(t *testing.T) {
	for _, tc := range []struct {
		name    string
		v       any
		n       int64
		integer bool // Integer accepts it
		int     bool // Int accepts it
	}{
		{"int8", int8(-3), -3, true, true},
		{"int16", int16(300), 300, true, true},
		{"int32", int32(70000), 70000, true, true},
		{"int64", int64(-1), -1, true, true},
		{"int", 42, 42, true, true},
		{"uint8", uint8(255), 255, true, true},
		{"uint16", uint16(65535), 65535, true, true},
		{"uint32", uint32(1 << 31), 1 << 31, true, true},
		{"uint64 clamped", uint64(math.MaxUint64), math.MaxInt64, true, true},
		{"whole float", float64(5), 5, false, true},
		{"float32", float32(-2), -2, false, true},
		{"huge float clamped", 1e300, math.MaxInt64, false, true},
		{"fractional float", 1.5, 0, false, false},
		{"NaN", math.NaN(), 0, false, false},
		{"decimal string", " 17 ", 17, false, true},
		{"bytes", []byte("9"), 9, false, true},
		{"word", "seven", 0, false, false},
		{"bool", true, 0, false, false},
		{"nil", nil, 0, false, false},
	} {
		n, ok := Integer(tc.v)
		if ok != tc.integer || (ok && n != tc.n) {
			t.Errorf("Integer(%s) = %d, %v; want %d, %v", tc.name, n, ok, tc.n, tc.integer)
		}
		n, ok = Int(tc.v)
		if ok != tc.int || (ok && n != tc.n) {
			t.Errorf("Int(%s) = %d, %v; want %d, %v", tc.name, n, ok, tc.n, tc.int)
		}
	}
}
