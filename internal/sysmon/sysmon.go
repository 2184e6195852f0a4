// Package sysmon gives the Go runtime's monitor thread a coarse timer
// slack. An NBD server for librbd wakes from idle and makes system and cgo
// calls on every request, so sysmon never backs off from its 20 µs rounds:
// each a nanosleep and a context switch. Linux rounds a thread's timers up
// by its slack; with 4 ms, sysmon does at most 250 rounds a second.
//
// The cost: what sysmon does (retake the P of a long system call, the
// 10 ms preemption and network poll) may come up to 4 ms later, and so may
// the timed waits of threads that inherit the slack. Nothing on the I/O
// path is timed (sockets, eventfds and futex wake-ups ignore slack), and
// the timeouts that are take seconds; MaxSlack bounds what EnvSlack asks.
// The measurements behind 4 ms: bench/reference/vm/README.md and
// bench/reference/vm/2026-11-26-sysmon.
package sysmon

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// DefaultSlack is the timer slack Relax gives sysmon.
const DefaultSlack = 4 * time.Millisecond

// EnvSlack names the environment variable that overrides DefaultSlack
// for Setup: a Go duration up to MaxSlack, 0 to leave sysmon alone (for
// A/B runs).
const EnvSlack = "RBD_NBD_GO_SYSMON_SLACK"

// MaxSlack is the most Setup gives: sysmon asleep for longer would stop
// preempting goroutines and retaking Ps from blocked system calls in
// time, and the threads that inherit the slack would wake late from
// every timed wait.
const MaxSlack = 10 * time.Millisecond

// Setup relaxes sysmon for a process that serves I/O (the node daemon,
// serve), with DefaultSlack or what EnvSlack says, and logs what it did.
// A failure costs only CPU, so it is logged, not returned.
func Setup(log *slog.Logger) {
	slack := DefaultSlack
	if v := os.Getenv(EnvSlack); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 0 || d > MaxSlack {
			log.Warn("ignoring "+EnvSlack+": not a duration from 0 to "+MaxSlack.String(), "value", v)
		} else {
			slack = d
		}
	}
	if slack == 0 {
		return
	}
	tid, err := Relax(slack)
	if err != nil {
		log.Info("sysmon timer slack not set; costs CPU per request", "err", err)
		return
	}
	log.Info("sysmon timer slack set", "thread", tid, "slack", slack)
}

// Relax sets sysmon's timer slack to slack, returning sysmon's thread
// ID. Another thread's slack may be set only with CAP_SYS_NICE (the
// node daemon runs as root); without it this fails and changes nothing.
func Relax(slack time.Duration) (int, error) {
	tid, err := thread()
	if err != nil {
		return 0, err
	}
	v := strconv.FormatInt(slack.Nanoseconds(), 10)
	if err := os.WriteFile(fmt.Sprintf("/proc/%d/timerslack_ns", tid), []byte(v), 0); err != nil {
		return tid, err
	}
	return tid, nil
}

// thread finds sysmon: runtime.main starts it before anything else of
// Go's (before package init), so it is the first thread the process made
// after its main thread: the earliest start time, then the lowest ID.
func thread() (int, error) {
	pid := os.Getpid()
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return 0, err
	}
	type task struct{ start, tid int }
	var ts []task
	for _, e := range tasks {
		tid, err := strconv.Atoi(e.Name())
		if err != nil || tid == pid {
			continue
		}
		b, err := os.ReadFile("/proc/self/task/" + e.Name() + "/stat")
		if err != nil {
			continue // ended meanwhile
		}
		start, err := startTime(string(b))
		if err != nil {
			return 0, err
		}
		ts = append(ts, task{start, tid})
	}
	if len(ts) == 0 {
		return 0, errors.New("sysmon: no thread besides the main one")
	}
	first := slices.MinFunc(ts, func(a, b task) int {
		if a.start != b.start {
			return a.start - b.start
		}
		return a.tid - b.tid
	})
	return first.tid, nil
}

// startTime is field 22 of a /proc stat line (after the parenthesised
// command name, which may hold spaces).
func startTime(stat string) (int, error) {
	i := strings.LastIndexByte(stat, ')')
	f := strings.Fields(stat[i+1:])
	if i < 0 || len(f) < 20 {
		return 0, fmt.Errorf("sysmon: unexpected stat line %q", stat)
	}
	return strconv.Atoi(f[19]) // field 22; f[0] is field 3
}
