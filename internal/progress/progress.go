// Package progress tells a person at a terminal that a slow call is
// still going (a map waiting on a slow cluster), and tells a script
// nothing: on anything but a terminal it writes no byte.
package progress

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/term"
)

// Waiting starts a line "MSG... Ns" on w that counts the seconds from
// `after` on, rewritten in place each second; the returned stop clears it.
// Nothing is written unless tty, or if the call ends before `after`.
func Waiting(w io.Writer, tty bool, msg string, after time.Duration) (stop func()) {
	if !tty {
		return func() {}
	}
	t0 := time.Now()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		shown := false
		defer func() {
			if shown {
				fmt.Fprint(w, "\r\033[K") // clear the line for what follows
			}
		}()
		t := time.NewTimer(after)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			fmt.Fprintf(w, "\r\033[K%s... %ds", msg, int(time.Since(t0).Seconds()))
			shown = true
			t.Reset(time.Second)
		}
	}()
	var once sync.Once
	return func() { once.Do(func() { close(done); wg.Wait() }) }
}

// StderrIsTerminal reports whether standard error is a terminal.
func StderrIsTerminal() bool { return term.IsTerminal(int(os.Stderr.Fd())) }
