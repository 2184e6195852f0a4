package sysmon

import (
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// load keeps the scheduler the way an NBD server does: a goroutine
// blocked in read(2) outside the poller, woken every 100 µs by another
// that sleeps in between, so Ps go idle and come back all the time and
// sysmon keeps polling.
func load(t *testing.T) (stop func()) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	var done atomic.Bool
	go func() {
		b := make([]byte, 1)
		for !done.Load() {
			syscall.Read(p[0], b)
		}
	}()
	go func() {
		for !done.Load() {
			syscall.Write(p[1], []byte{1})
			time.Sleep(100 * time.Microsecond)
		}
		syscall.Write(p[1], []byte{1})
	}()
	return func() {
		done.Store(true)
		time.Sleep(10 * time.Millisecond)
		unix.Close(p[0])
		unix.Close(p[1])
	}
}

// switches is thread tid's voluntary context switches so far.
func switches(t *testing.T, tid int) int {
	b, err := os.ReadFile("/proc/self/task/" + strconv.Itoa(tid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "voluntary_ctxt_switches:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatal("no voluntary_ctxt_switches")
	return 0
}

// TestRelax: the thread found is the one that sleeps in nanosleep (Go's
// usleep is nanosleep; nothing else of the runtime's sleeps that way
// under this load), and with the slack it wakes far less often.
func TestRelax(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("linux only")
	}
	stop := load(t)
	defer stop()
	tid, err := thread()
	if err != nil {
		t.Fatal(err)
	}
	// Which thread sits in nanosleep, sampled.
	inSleep := map[string]int{}
	want := strconv.Itoa(unix.SYS_NANOSLEEP) + " "
	for range 200 {
		ts, _ := os.ReadDir("/proc/self/task")
		for _, e := range ts {
			if b, err := os.ReadFile("/proc/self/task/" + e.Name() + "/syscall"); err == nil && strings.HasPrefix(string(b), want) {
				inSleep[e.Name()]++
			}
		}
		time.Sleep(time.Millisecond)
	}
	best := ""
	for k, n := range inSleep {
		if best == "" || n > inSleep[best] {
			best = k
		}
	}
	if best != strconv.Itoa(tid) {
		t.Fatalf("thread() found %d, but the thread seen in nanosleep is %q (samples %v)", tid, best, inSleep)
	}
	rate := func() float64 {
		s0, t0 := switches(t, tid), time.Now()
		time.Sleep(300 * time.Millisecond)
		return float64(switches(t, tid)-s0) / time.Since(t0).Seconds()
	}
	before := rate()
	old, _ := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/timerslack_ns")
	// A slack well above DefaultSlack, so that sysmon's timed rounds
	// (at most 100 a second) stand out from the wake-ups no slack
	// governs (a system call made while every P was idle wakes it at
	// once), which a busy machine adds plenty of.
	const slack = 10 * time.Millisecond
	got, err := Relax(slack)
	if os.IsPermission(err) {
		t.Skipf("setting another thread's timer slack needs CAP_SYS_NICE: %v", err)
	}
	if err != nil || got != tid {
		t.Fatalf("Relax: %d, %v", got, err)
	}
	defer os.WriteFile("/proc/"+strconv.Itoa(tid)+"/timerslack_ns", old, 0)
	if b, _ := os.ReadFile("/proc/" + strconv.Itoa(tid) + "/timerslack_ns"); strings.TrimSpace(string(b)) != strconv.FormatInt(slack.Nanoseconds(), 10) {
		t.Fatalf("thread %d's timer slack reads %q after Relax(%v)", tid, b, slack)
	}
	after := rate()
	t.Logf("sysmon (thread %d) woke %.0f times a second, %.0f with %v of timer slack", tid, before, after, slack)
	if after > before*3/4 {
		t.Errorf("sysmon woke %.0f times a second with the slack, %.0f without", after, before)
	}
}

// TestSetupEnv: EnvSlack is obeyed within bounds; a value out of them is
// refused in the log and the default is used, and 0 leaves sysmon alone.
func TestSetupEnv(t *testing.T) {
	tid, err := thread()
	if err != nil {
		t.Fatal(err)
	}
	path := "/proc/" + strconv.Itoa(tid) + "/timerslack_ns"
	old, _ := os.ReadFile(path)
	defer os.WriteFile(path, old, 0)
	def := strconv.FormatInt(DefaultSlack.Nanoseconds(), 10)
	for _, c := range []struct {
		env, want string
		warn      bool
	}{
		{"2ms", "2000000", false},
		{"1h", def, true},           // above MaxSlack: the default
		{"-1ms", def, true},         // negative
		{"1000", def, true},         // no unit
		{"0", "50000", false},       // left alone
		{"10ms", "10000000", false}, // MaxSlack itself
	} {
		os.WriteFile(path, []byte("50000"), 0) // Go's default: each case starts from it
		t.Setenv(EnvSlack, c.env)
		var logged strings.Builder
		Setup(slog.New(slog.NewTextHandler(&logged, nil)))
		b, _ := os.ReadFile(path)
		if strings.Contains(logged.String(), "permission denied") {
			t.Skip("setting another thread's timer slack needs CAP_SYS_NICE")
		}
		if got := strings.TrimSpace(string(b)); got != c.want {
			t.Errorf("%s=%s: slack %s, want %s (log %q)", EnvSlack, c.env, got, c.want, logged.String())
		}
		if warned := strings.Contains(logged.String(), "ignoring"); warned != c.warn {
			t.Errorf("%s=%s: warned %v, want %v (log %q)", EnvSlack, c.env, warned, c.warn, logged.String())
		}
	}
}
