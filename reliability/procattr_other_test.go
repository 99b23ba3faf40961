//go:build reliability && !linux

package reliability_test

import "syscall"

// childAttr: outside Linux there is no parent-death signal; the owner
// test's cleanup is the only thing that stops the servers it started.
func childAttr() *syscall.SysProcAttr { return nil }
