// Package sysmon gives the Go runtime's monitor thread a coarse timer, so
// that it stops costing a context switch every few tens of microseconds.
//
// sysmon is the runtime thread that, without a P, retakes Ps from long
// system calls, preempts goroutines that ran for 10 ms and polls the
// network when nobody has for 10 ms. It sleeps 20 µs between rounds
// whenever it has just had work, and a system call (a cgo call too) made
// while every P was idle counts as work. An NBD server for librbd is the
// worst case: every request wakes the process from idle and makes system
// calls and cgo calls, so sysmon never backs off. On the project's 2-CPU
// box it did about 3,000 rounds a second at 4k QD32, each a nanosleep
// and a context switch, 19 µs of CPU per I/O: a third of the Go side's.
//
// Linux rounds a thread's timer up by its timer slack. With 4 ms of slack
// on sysmon, its rounds are at most 250 a second. What sysmon does
// becomes up to 4 ms later: retaking the P of a long system call (the
// daemon keeps spare Ps, so work never waits for one) and the 10 ms
// preemption and network poll. A new thread inherits its creator's
// slack, and sysmon sometimes starts the thread that takes over a P it
// retook; so some Go threads (and librados threads they start) carry the
// slack too, and their timed waits may end up to 4 ms late. Nothing on
// the I/O path is timed: requests and completions wake threads through
// sockets, eventfds and futex wake-ups, which slack does not delay, and
// the timeouts that are (a reader's SO_RCVTIMEO runs on the timer wheel,
// which slack does not touch; the rest are seconds, in Go and in Ceph)
// do not notice a few milliseconds. That is also why MaxSlack bounds
// what EnvSlack may ask.
//
// Measured, kernel NBD in the project's TCG VM at 4k QD32 (CPU of the
// serving process per I/O against Ceph's rbd-nbd, medians over three
// runs with rbd-nbd in each): no slack 1.25x (reads) and 1.26x (writes),
// 1 ms 1.07x and 1.08x, 4 ms 1.11x and 1.07x. Rounds swing by 40 %
// there, so whole-process CPU could not rank 1 and 4 ms. Sysmon's own
// thread, counted per thread (perf stat --per-thread, 3 rounds each, same
// binary; bench/reference/vm/2026-11-26-sysmon) can: with 1 ms it woke
// 0.84-0.98 times per I/O and spent 77-99 µs of CPU per I/O (a TCG
// round costs about 90 µs: a nanosleep, a context switch and HPET clock
// reads), with 4 ms 0.27-0.40 times and 23-46 µs.
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
