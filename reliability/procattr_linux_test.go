//go:build reliability && linux

package reliability_test

import "syscall"

// childAttr makes the kernel kill a server the tests started if the test
// binary dies without running its cleanups (a -timeout panic, a SIGKILL).
// It is only a safety net: the owner test kills and waits for its servers.
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
