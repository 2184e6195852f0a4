package daemon

import (
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"
)

// userHZ is the unit of /proc/PID/stat's starttime (USER_HZ, 100 on
// every Linux architecture Go supports).
const userHZ = 100

// logStart says how long ago this process and the one that started it
// (the node plugin, when it is the parent) were created. After a kill -9
// the devices wait on the new plugin's start, then on the daemon's; on
// a slow node each can take seconds, and these two figures tell which.
// (A container's first process is created by runc, before its set-up
// and exec: its age holds those too.)
func logStart(log *slog.Logger) {
	attrs := []any{"pid", os.Getpid()}
	if age, ok := ProcessAge(os.Getpid()); ok {
		attrs = append(attrs, "started_ago", age.Round(time.Millisecond))
	}
	if age, ok := ProcessAge(os.Getppid()); ok {
		attrs = append(attrs, "parent_pid", os.Getppid(), "parent_started_ago", age.Round(time.Millisecond))
	}
	log.Info("daemon starting", attrs...)
}

// ProcessAge is how long ago pid was started, to the clock tick. The
// node plugin logs its own too: its start is the first part of the wait
// after a kill -9.
func ProcessAge(pid int) (time.Duration, bool) {
	start, err := procStart(pid)
	if err != nil {
		return 0, false
	}
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return 0, false
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return 0, false
	}
	up, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return 0, false
	}
	age := time.Duration(up*float64(time.Second)) - time.Duration(start)*time.Second/userHZ
	return max(age, 0), true
}
