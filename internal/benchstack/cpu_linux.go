package benchstack

import (
	"syscall"
	"time"
)

// threadCPU returns the CPU time the calling thread has used (getrusage
// with RUSAGE_THREAD), which, unlike the time that passed, does not grow
// while the thread waits for a core on a busy machine. It is -1 when
// unknown.
func threadCPU() time.Duration {
	const rusageThread = 1
	var ru syscall.Rusage
	if err := syscall.Getrusage(rusageThread, &ru); err != nil {
		return -1
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
