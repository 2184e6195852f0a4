package rbdio

import (
	"bufio"
	"context"
	"encoding/binary"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// TestStressUnmapUnderLoad maps, loads and unmaps images over and over,
// as the node daemon does under Kubernetes' storage tests, while the
// collector runs all the time and the scheduler is narrowed and widened:
// every path where a Go buffer is lent to librbd, to the completion
// callback or to the kernel (direct replies, spliced and lent reads)
// meets connections the peer cuts off mid-flight, as the kernel does
// when its timer fires, and images closed right after. A Go pointer the
// collector cannot see shows up as a runtime crash; a reply torn or sent
// to the wrong socket as a bad magic. It runs for stressSeconds, or
// RBDIO_STRESS_SECONDS; not under -short.
//
// Before the slots' Go pointers were stored in C (aio.go, nbdgo_offer)
// it crashed within 30 s in each of 8 runs, as the daemon did once or
// twice an hour under Kubernetes' storage tests.
func TestStressUnmapUnderLoad(t *testing.T) {
	secs := stressSeconds
	if s, err := strconv.Atoi(os.Getenv("RBDIO_STRESS_SECONDS")); err == nil {
		secs = s
	}
	if testing.Short() || secs <= 0 {
		t.Skip("short")
	}
	needCluster(t)
	defer debug.SetGCPercent(debug.SetGCPercent(5))
	stop := make(chan struct{})
	var churn sync.WaitGroup
	churn.Add(1)
	go func() { // what the daemon's release does, without the pauses
		defer churn.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			runtime.GC()
			runtime.GOMAXPROCS(1)
			runtime.GOMAXPROCS(8)
			for range 4 {
				go runtime.LockOSThread() // ends its thread
			}
			debug.FreeOSMemory()
			time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond)
		}
	}()
	defer func() { close(stop); churn.Wait() }()

	cl := NewClusters()
	specs := []ceph.ImageSpec{newImage(t, "64M"), newImage(t, "64M"), newImage(t, "64M")}
	deadline := time.Now().Add(time.Duration(secs) * time.Second)
	rounds := 0
	for time.Now().Before(deadline) {
		var wg sync.WaitGroup
		for _, spec := range specs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				stressRound(t, cl, spec, rand.Uint64())
			}()
		}
		wg.Wait()
		if t.Failed() {
			break
		}
		rounds++
	}
	t.Logf("%d rounds of %d images", rounds, len(specs))
}

const stressSeconds = 30

// stressRound opens spec, serves it on two kernel-style connections
// under random load for a moment, cuts one or both off mid-flight at
// random, and closes everything.
func stressRound(t *testing.T, cl *Clusters, spec ceph.ImageSpec, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 1))
	im, err := Open(cl, opts(), spec, OpenOptions{})
	if err != nil {
		t.Error(err)
		return
	}
	s := nbd.NewServer(nbd.Config{IdleAfter: time.Duration(1+rng.IntN(30)) * time.Millisecond})
	if err := s.AddExport(nbd.Export{Backend: im}); err != nil {
		t.Error(err)
		im.Close()
		return
	}
	var clients sync.WaitGroup
	for k := range 2 {
		a, c, err := stressPair()
		if err != nil {
			t.Error(err)
			break
		}
		go s.ServeNegotiated(a, "")
		clients.Add(1)
		go func() {
			defer clients.Done()
			stressClient(t, c.(*net.UnixConn), rand.New(rand.NewPCG(seed, uint64(k+2))))
		}()
	}
	clients.Wait()
	if err := s.Shutdown(context.Background()); err != nil {
		t.Error(err)
	}
	if err := im.Close(); err != nil {
		t.Error(err)
	}
}

// stressPair is socketpair's for goroutines other than the test's (no
// t.Fatal there).
func stressPair() (net.Conn, net.Conn, error) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, nil, err
	}
	var cs [2]net.Conn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		cs[i], err = net.FileConn(f)
		f.Close()
		if err != nil {
			return nil, nil, err
		}
	}
	return cs[0], cs[1], nil
}

// stressClient sends random requests, up to 32 at a time, for up to a
// second, checks every reply it reads is whole and its own, and then
// either cuts the connection off at once (shutdown, as the kernel's
// timeout does) or ends it with a disconnect.
func stressClient(t *testing.T, c *net.UnixConn, rng *rand.Rand) {
	const size = 64 << 20
	c.SetDeadline(time.Now().Add(60 * time.Second))
	var (
		mu      sync.Mutex
		pending = map[uint64]int{} // cookie: read length, or -1
		slots   = make(chan struct{}, 32)
		done    = make(chan struct{})
	)
	go func() { // replies
		defer close(done)
		br := bufio.NewReader(c)
		h := make([]byte, 16)
		buf := make([]byte, 1<<20)
		for {
			if _, err := io.ReadFull(br, h); err != nil {
				return
			}
			if m := binary.BigEndian.Uint32(h); m != 0x67446698 {
				t.Errorf("reply magic %#x", m)
				return
			}
			cookie := binary.BigEndian.Uint64(h[8:])
			mu.Lock()
			n, ok := pending[cookie]
			delete(pending, cookie)
			mu.Unlock()
			if !ok {
				t.Errorf("reply to cookie %d, not in flight", cookie)
				return
			}
			if e := binary.BigEndian.Uint32(h[4:]); e == 0 && n > 0 {
				if _, err := io.ReadFull(br, buf[:n]); err != nil {
					return
				}
			}
			<-slots
		}
	}()
	end := time.Now().Add(time.Duration(rng.IntN(1000)) * time.Millisecond)
	h := make([]byte, 28)
	data := make([]byte, 1<<20)
send:
	for cookie := uint64(0); time.Now().Before(end); cookie++ {
		select {
		case slots <- struct{}{}:
		case <-done:
			break send
		}
		cmd := []uint16{0, 0, 0, 1, 1, 3, 4, 6}[rng.IntN(8)]
		n := 512 << rng.IntN(12) // 512 B to 1 MiB
		off := rng.IntN(size/4096-256) * 4096
		flags := uint16(0)
		if cmd == 1 && rng.IntN(4) == 0 {
			flags = 1 // FUA
		}
		if cmd == 3 {
			n, off = 0, 0
		}
		read := -1
		if cmd == 0 {
			read = n
		}
		mu.Lock()
		pending[cookie] = read
		mu.Unlock()
		binary.BigEndian.PutUint32(h[0:], 0x25609513)
		binary.BigEndian.PutUint16(h[4:], flags)
		binary.BigEndian.PutUint16(h[6:], cmd)
		binary.BigEndian.PutUint64(h[8:], cookie)
		binary.BigEndian.PutUint64(h[16:], uint64(off))
		binary.BigEndian.PutUint32(h[24:], uint32(n))
		if _, err := c.Write(h); err != nil {
			break
		}
		if cmd == 1 {
			if _, err := c.Write(data[:n]); err != nil {
				break
			}
		}
	}
	if rng.IntN(2) == 0 {
		c.CloseRead() // cut off with requests in flight
		c.CloseWrite()
	} else {
		binary.BigEndian.PutUint16(h[6:], 2) // disconnect
		c.Write(h)
		c.CloseWrite()
	}
	<-done
	c.Close()
}
