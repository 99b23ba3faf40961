package redisstore_test

import (
	"syscall"
	"time"
)

// selfCPU returns the CPU time, user and system, that this process has
// used, or -1 if it is unknown.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
