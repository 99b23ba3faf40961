//go:build reliability

package reliability_test

import (
	"os/exec"
	"testing"
	"time"
)

// A child is a process that a test started: a server of its own, or a
// consumer. A goroutine waits for it, and ends when the process does: at
// the latest in the cleanup of the test, which stops it.
type child struct {
	cmd     *exec.Cmd
	exited  chan struct{} // closed once cmd has been waited for
	waitErr error         // cmd.Wait's result, once exited is closed
}

// startChild starts cmd, with childAttr's attributes unless it has
// attributes of its own, and its waiter. When t ends, stop ends the
// process and waits for it; a nil stop is (*child).kill.
func startChild(t *testing.T, cmd *exec.Cmd, stop func(*child)) (*child, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = childAttr()
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{cmd: cmd, exited: make(chan struct{})}
	go func() {
		c.waitErr = cmd.Wait()
		close(c.exited)
	}()
	if stop == nil {
		stop = (*child).kill
	}
	t.Cleanup(func() { stop(c) })
	return c, nil
}

// kill kills the process and waits until it has exited.
func (c *child) kill() {
	c.cmd.Process.Kill() // an error means it had exited already
	<-c.exited
}

// wait waits up to d for the process to exit, and reports whether it did.
func (c *child) wait(d time.Duration) bool {
	select {
	case <-c.exited:
		return true
	case <-time.After(d):
		return false
	}
}
