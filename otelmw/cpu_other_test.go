//go:build !linux

package otelmw_test

import "time"

// threadCPU is unknown (-1) off Linux.
func threadCPU() time.Duration { return -1 }
