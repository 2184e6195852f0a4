package daemon

import (
	"context"
	"log/slog"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// protectFromReclaim keeps the daemon from deadlocking under memory
// pressure: its own allocations must not wait on writeback to the devices
// it serves (PR_SET_IO_FLUSHER), and its pages must not be swapped out
// (mlockall; MCL_ONFAULT so address space reserved by Go and librados
// costs nothing until touched).
//
// PR_SET_IO_FLUSHER marks only the calling thread, and Go's threads (and
// librbd's) come from many places; but the mark is inherited by new
// threads and kept across exec. So the client that starts the daemon
// sets it on the thread that forks it (control's startFlusher), and
// every daemon thread is born with it. Here we only check, and mark this
// thread for daemons started by other means.
func protectFromReclaim(log *slog.Logger) {
	if on, _ := unix.PrctlRetInt(control.PrGetIOFlusher, 0, 0, 0, 0); on != 1 {
		log.Warn("started without PR_SET_IO_FLUSHER: only some threads get it")
		if err := unix.Prctl(control.PrSetIOFlusher, 1, 0, 0, 0); err != nil {
			log.Warn("PR_SET_IO_FLUSHER failed", "err", err)
		}
	}
	// No transparent huge pages, as Ceph's own daemons (global_init,
	// with thp=false): khugepaged refills the holes Go's scavenger and
	// jemalloc punch into their heaps, 2 MiB at a time, whenever one
	// small page of the range is still in use, so memory handed back
	// came back as soon as it was given. (Set before mlockall: pages
	// locked from here on are small ones.)
	if err := unix.Prctl(unix.PR_SET_THP_DISABLE, 1, 0, 0, 0); err != nil {
		log.Warn("PR_SET_THP_DISABLE failed", "err", err)
	}
	if err := unix.Mlockall(lockFlags); err != nil {
		log.Warn("mlockall failed", "err", err)
	}
}

const lockFlags = unix.MCL_CURRENT | unix.MCL_FUTURE | unix.MCL_ONFAULT

// releaseMemory gives the memory the daemon no longer uses back to the
// system. Under mlockall it never could: the kernel refuses
// MADV_DONTNEED on locked pages, which is how Go's scavenger, jemalloc
// (librbd's heap) and glibc (the stacks of ended threads) return
// memory, so the daemon kept its peak for good. So, unlocked:
//   - empty the Ps' lists of ended goroutines, narrowing the scheduler
//     to its idle width if no device is left (procs.settle), so the
//     collections below free their stacks;
//   - two collections, since sync.Pools (payload and read buffers) keep
//     one cycle's worth in their victim caches, and a pause for the
//     cleanups that unmap pooled payload mappings;
//   - Go's heap back to the system;
//   - end the Go runtime's idle threads (endIdleThreads): glibc frees
//     their stacks, and jemalloc takes back their thread caches.
//     Last, because a collection wakes a thread for every idle P to run
//     its idle mark worker;
//   - jemalloc's free pages back to the system;
//
// then lock again. The pages the daemon still uses stay resident
// throughout (munlock evicts nothing); for the fraction of a second in
// between they could only be reclaimed under memory pressure, and this
// runs only once devices went away, not on a busy I/O path.
func releaseMemory(p *procs, freeC func()) {
	unix.Munlockall()
	width := p.settle()
	runtime.GC()
	runtime.GC()
	time.Sleep(releasePause)
	debug.FreeOSMemory()
	endIdleThreads(width + spareThreads)
	time.Sleep(threadExitPause)
	if freeC != nil {
		freeC()
	}
	unix.Mlockall(lockFlags)
}

// releasePause lets cleanups run; threadExitPause lets ended threads
// finish exiting (endIdleThreads returns once their goroutines ran).
const (
	releasePause    = 200 * time.Millisecond
	threadExitPause = 50 * time.Millisecond
)

// procs sets the Go scheduler's width: the Ps cmd chose while devices
// are served (spare ones, which the I/O path wants: cmd's spareProcs,
// 8 on a 2-CPU node), the idle width (Config.IdleProcs: the runtime's
// own default, which counts a cgroup's CPU limit) while none is. An
// idle P costs nothing until a collection runs: then each wakes a
// thread for its idle mark worker, so at 8 Ps an idle daemon kept 12-13
// threads whatever endIdleThreads ended.
type procs struct {
	busy, idle int
	devices    func() int // devices served
	mu         sync.Mutex
	pending    int // map and attach requests under way
}

// newProcs: busy is the width the daemon started with; idle, if not
// between 1 and busy, one P per CPU. (runtime.NumCPU counts the CPUs
// the process may run on, not a cgroup's CPU limit, which only the
// runtime's default GOMAXPROCS reflects: cmd passes that.)
func newProcs(idle int, devices func() int) *procs {
	busy := runtime.GOMAXPROCS(0)
	if idle < 1 || idle > busy {
		idle = min(busy, runtime.NumCPU())
	}
	return &procs{busy: busy, idle: idle, devices: devices}
}

// serving widens the scheduler for a device about to be served; the
// returned func says the request is over. (Setting GOMAXPROCS to its
// value is a no-op: no stop-the-world.)
func (p *procs) serving() (done func()) {
	p.mu.Lock()
	p.pending++
	runtime.GOMAXPROCS(p.busy)
	p.mu.Unlock()
	return func() {
		p.mu.Lock()
		p.pending--
		p.narrowIfIdle()
		p.mu.Unlock()
	}
}

// narrowIfIdle (p.mu held) narrows the scheduler when nothing is served
// or being mapped: after a map or attach that failed, which leaves no
// device whose unmap would lead to a release, and at start-up with no
// device to take back. (No purge of ended goroutines' stacks here: a
// failed map ends a few; the next release frees them.)
func (p *procs) narrowIfIdle() {
	if p.pending == 0 && p.devices() == 0 {
		runtime.GOMAXPROCS(p.idle)
	}
}

// start narrows the scheduler of a daemon that took back no device.
func (p *procs) start() {
	p.mu.Lock()
	p.narrowIfIdle()
	p.mu.Unlock()
}

// settle returns the width a release leaves: narrow, with the stacks of
// ended goroutines freed, if no device is served and none is being
// mapped; else the busy width, untouched (no stop-the-world while
// devices do I/O; their goroutines reuse those stacks). The runtime
// keeps up to 63 ended goroutines on each P's free list, with their
// stacks, for reuse, and a collection frees only the stacks on the
// global list, so megabytes of stacks outlived the last unmap. Shrinking
// GOMAXPROCS to one
// destroys every P but one, which hand their lists to the global one
// (the runtime's procresize, one stop-the-world each way; the list of
// the P left stays).
func (p *procs) settle() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.pending > 0 || p.devices() > 0 {
		return p.busy
	}
	runtime.GOMAXPROCS(1)
	runtime.GOMAXPROCS(p.idle)
	return p.idle
}

// giveBack calls release once the number of devices has dropped and
// then held still for one tick (an unmap burst is over), until ctx ends.
func giveBack(ctx context.Context, tick time.Duration, devices func() int, release func()) {
	t := time.NewTicker(tick)
	defer t.Stop()
	prev, shrunk := devices(), false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n := devices()
		switch {
		case n < prev:
			shrunk = true
		case shrunk && n == prev:
			release()
			shrunk = false
		}
		prev = n
	}
}

// spareThreads is how many Go threads beyond one per P endIdleThreads
// keeps: sysmon and the template thread, which never run goroutines.
// None for the next burst: the runtime makes a thread in tens of
// microseconds, and an idle one keeps every stack page its busiest
// moment touched (hundreds of KiB after librbd's calls).
const spareThreads = 2

// endIdleThreads ends Go runtime threads until at most keep are left.
// The runtime never ends an idle thread itself, so every thread a burst
// of blocking calls once needed (maps, unmaps, reads of busy sockets)
// would stay for the life of the daemon. A goroutine that exits while
// locked to its thread takes the thread with it; the scheduler runs
// those goroutines on idle threads first, and makes new threads later
// only for work that needs them (born with PF_MEMALLOC_NOIO like every
// thread: it is inherited at clone).
func endIdleThreads(keep int) {
	n := goThreads() - keep
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			runtime.LockOSThread()
			wg.Done()
		}()
	}
	wg.Wait()
}

// goThreads counts this process's threads that carry its own name: the
// Go runtime's (librados names its threads, and cgo callbacks run on
// those).
func goThreads() int {
	self, err := os.ReadFile("/proc/self/comm")
	if err != nil {
		return 0
	}
	tasks, err := os.ReadDir("/proc/self/task")
	if err != nil {
		return 0
	}
	n := 0
	for _, t := range tasks {
		if comm, err := os.ReadFile("/proc/self/task/" + t.Name() + "/comm"); err == nil && string(comm) == string(self) {
			n++
		}
	}
	return n
}

// goMemory says, as log attributes in KiB, where the Go runtime's
// resident memory is after a release: what an operator (and the scale
// bench) needs to tell a leak from the runtime's own bookkeeping.
func goMemory() []any {
	classes := []struct{ key, name string }{
		{"heap_objects", "/memory/classes/heap/objects:bytes"},
		{"heap_free", "/memory/classes/heap/free:bytes"},
		{"heap_unused", "/memory/classes/heap/unused:bytes"},
		{"heap_released", "/memory/classes/heap/released:bytes"},
		{"stacks", "/memory/classes/heap/stacks:bytes"},
		{"os_stacks", "/memory/classes/os-stacks:bytes"},
		{"metadata", "/memory/classes/metadata/other:bytes"},
		{"mspan", "/memory/classes/metadata/mspan/inuse:bytes"},
		{"mcache", "/memory/classes/metadata/mcache/inuse:bytes"},
		{"other", "/memory/classes/other:bytes"},
		{"total", "/memory/classes/total:bytes"},
	}
	s := make([]metrics.Sample, len(classes))
	for i, c := range classes {
		s[i].Name = c.name
	}
	metrics.Read(s)
	attrs := make([]any, 0, 2*len(classes)+2)
	for i, c := range classes {
		if s[i].Value.Kind() == metrics.KindUint64 {
			attrs = append(attrs, "go_"+c.key+"_kib", s[i].Value.Uint64()>>10)
		}
	}
	return append(attrs, "go_threads", goThreads(), "goroutines", runtime.NumGoroutine(), "go_procs", runtime.GOMAXPROCS(0))
}
