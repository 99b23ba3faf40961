package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"

	"github.com/rabbitmw/rabbitmw/broker/deadletter"
)

// An interrupts turns an operator's signals (SIGINT, SIGTERM) into a
// command's stop and abort. The first ends the command's context: it
// sends nothing more and finishes what it has in flight, for up to 5 s
// (see deadletter.WithAbort), and the command says that a second signal
// stops it at once. The second aborts that wait: the command returns at
// once, naming what it gave up on, and exits 128 + the signal's number
// (130 for SIGINT), as a process the signal ended would.
type interrupts struct {
	stderr io.Writer
	cancel context.CancelCauseFunc
	abort  chan struct{} // closed at the second signal
	quit   chan struct{} // closed by stop
	done   chan struct{} // closed as watch returns

	mu     sync.Mutex
	second os.Signal
}

// watchInterrupts returns the context to run a command under, derived
// from ctx and carrying the abort, and the interrupts that reads sigs
// for it, in a goroutine that ends at stop, which must be called.
func watchInterrupts(ctx context.Context, sigs <-chan os.Signal, stderr io.Writer) (context.Context, *interrupts) {
	ctx, cancel := context.WithCancelCause(ctx)
	in := &interrupts{stderr: stderr, cancel: cancel, abort: make(chan struct{}), quit: make(chan struct{}), done: make(chan struct{})}
	go in.watch(sigs)
	return deadletter.WithAbort(ctx, in.abort), in
}

func (in *interrupts) watch(sigs <-chan os.Signal) {
	defer close(in.done)
	var first os.Signal
	for {
		select {
		case <-in.quit:
			return
		case sig := <-sigs:
			if first == nil {
				first = sig
				in.cancel(fmt.Errorf("%v signal received", sig))
				fmt.Fprintf(in.stderr, "rabbitmw: %v: stopping, once what is in flight is finished (up to 5s); interrupt again to stop at once\n", sig)
				continue
			}
			in.mu.Lock()
			in.second = sig
			in.mu.Unlock()
			close(in.abort)
			return
		}
	}
}

// stop ends the watch, and returns the second signal, or nil.
func (in *interrupts) stop() os.Signal {
	close(in.quit)
	<-in.done
	in.cancel(context.Canceled)
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.second
}
