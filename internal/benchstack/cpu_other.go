//go:build !linux

package benchstack

import "time"

// threadCPU is unknown (-1) off Linux.
func threadCPU() time.Duration { return -1 }
