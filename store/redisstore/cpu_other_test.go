//go:build !linux

package redisstore_test

import "time"

// selfCPU is unknown (-1) off Linux.
func selfCPU() time.Duration { return -1 }
