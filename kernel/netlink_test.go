package kernel

import (
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/genetlink/genltest"
	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nlenc"
	"golang.org/x/sys/unix"
)

// fakeKernel answers the nbd family the way drivers/block/nbd.c does, for
// the parts the attacher relies on.
type fakeKernel struct {
	t       *testing.T
	devices map[int]*fakeDev
	nbdsMax int
	last    map[uint16][]byte // raw attributes of the last request, by type
}

type fakeDev struct {
	size, bs, flags, timeout, dead uint64
	backend                        string
	socks, deadSocks               int
	connected                      bool
}

var fakeFamily = genetlink.Family{ID: 42, Version: 1, Name: familyName,
	Groups: []genetlink.MulticastGroup{{ID: 7, Name: familyGroup}}}

func newFake(t *testing.T) (*fakeKernel, *Netlink) {
	fk := &fakeKernel{t: t, devices: map[int]*fakeDev{}, nbdsMax: 2}
	c := genltest.Dial(genltest.ServeFamily(fakeFamily,
		genltest.CheckRequest(fakeFamily.ID, 0, 0, fk.serve)))
	n, err := NewNetlink(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { n.Close() })
	return fk, n
}

func (fk *fakeKernel) serve(greq genetlink.Message, nreq netlink.Message) ([]genetlink.Message, error) {
	wantAck := greq.Header.Command == cmdReconfigure || greq.Header.Command == cmdDisconnect
	if gotAck := nreq.Header.Flags&netlink.Acknowledge != 0; gotAck != wantAck {
		// A reply plus an ack can be split across reads (see execute).
		fk.t.Errorf("command %d: acknowledge flag %v, want %v", greq.Header.Command, gotAck, wantAck)
	}
	if greq.Header.Version != 1 {
		return nil, genltest.Error(int(syscall.EINVAL))
	}
	ad, err := netlink.NewAttributeDecoder(greq.Data)
	if err != nil {
		return nil, err
	}
	fk.last = map[uint16][]byte{}
	var fds []int
	for ad.Next() {
		fk.last[ad.Type()] = ad.Bytes()
		if ad.Type() == attrSockets {
			ad.Nested(func(s *netlink.AttributeDecoder) error {
				for s.Next() {
					s.Nested(func(i *netlink.AttributeDecoder) error {
						for i.Next() {
							if i.Type() == sockFD {
								fds = append(fds, int(i.Uint32()))
							}
						}
						return nil
					})
				}
				return nil
			})
		}
	}
	if err := ad.Err(); err != nil {
		return nil, err
	}
	for _, fd := range fds {
		// The kernel does sockfd_lookup: the fd must be a socket of
		// the calling process.
		if st, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || st != unix.SOCK_STREAM {
			return nil, genltest.Error(int(syscall.ENOTSOCK))
		}
	}
	u64 := func(a uint16) uint64 {
		b, ok := fk.last[a]
		if !ok {
			return 0
		}
		return nlenc.Uint64(b)
	}
	idx, hasIdx := fk.last[attrIndex]
	index := -1
	if hasIdx {
		index = int(nlenc.Uint32(idx))
	}
	switch greq.Header.Command {
	case cmdConnect:
		if len(fds) == 0 || u64(attrSizeBytes) == 0 {
			return nil, genltest.Error(int(syscall.EINVAL))
		}
		if len(fds) > 1 && u64(attrServerFlags)&(1<<8) == 0 {
			return nil, genltest.Error(int(syscall.EINVAL)) // multi-conn without CAN_MULTI_CONN
		}
		if index < 0 {
			for index = 0; fk.devices[index] != nil && fk.devices[index].connected; index++ {
			}
		} else if d := fk.devices[index]; d != nil && d.connected {
			return nil, genltest.Error(int(syscall.EBUSY))
		}
		fk.devices[index] = &fakeDev{size: u64(attrSizeBytes), bs: u64(attrBlockSizeBytes),
			flags: u64(attrServerFlags), timeout: u64(attrTimeout), dead: u64(attrDeadConnTimeout),
			backend: nlenc.String(fk.last[attrBackendID]), socks: len(fds), connected: true}
		return fk.reply(index), nil
	case cmdReconfigure:
		d := fk.devices[index]
		if d == nil || !d.connected {
			return nil, genltest.Error(int(syscall.EINVAL))
		}
		if d.backend != "" && nlenc.String(fk.last[attrBackendID]) != d.backend {
			return nil, genltest.Error(int(syscall.EINVAL))
		}
		if len(fds) > d.deadSocks {
			return nil, genltest.Error(int(syscall.ENOSPC))
		}
		d.deadSocks -= len(fds)
		if s := u64(attrSizeBytes); s != 0 {
			d.size = s
		}
		return ack(cmdReconfigure), nil
	case cmdDisconnect:
		d := fk.devices[index]
		if d == nil {
			return nil, genltest.Error(int(syscall.EINVAL))
		}
		d.connected = false
		return ack(cmdDisconnect), nil
	case cmdStatus:
		ae := netlink.NewAttributeEncoder()
		ae.Nested(attrDeviceList, func(l *netlink.AttributeEncoder) error {
			for i, d := range fk.devices {
				if index >= 0 && i != index {
					continue
				}
				l.Nested(deviceItem, func(it *netlink.AttributeEncoder) error {
					it.Uint32(deviceIndex, uint32(i))
					c := uint8(0)
					if d.connected {
						c = 1
					}
					it.Uint8(deviceConnected, c)
					return nil
				})
			}
			return nil
		})
		b, _ := ae.Encode()
		return []genetlink.Message{{Header: genetlink.Header{Command: cmdStatus, Version: 1}, Data: b}}, nil
	}
	return nil, genltest.Error(int(syscall.EOPNOTSUPP))
}

func (fk *fakeKernel) reply(index int) []genetlink.Message {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	b, _ := ae.Encode()
	return []genetlink.Message{{Header: genetlink.Header{Command: cmdConnect, Version: 1}, Data: b}}
}

// ack stands in for the kernel's bare acknowledgement (genltest needs a
// message to end the exchange).
func ack(cmd uint8) []genetlink.Message {
	return []genetlink.Message{{Header: genetlink.Header{Command: cmd, Version: 1}}}
}

func socketpairs(t *testing.T, n int) []*os.File {
	t.Helper()
	var out []*os.File
	for range n {
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		a, b := os.NewFile(uintptr(fds[0]), "k"), os.NewFile(uintptr(fds[1]), "u")
		t.Cleanup(func() { a.Close(); b.Close() })
		out = append(out, a)
	}
	return out
}

func TestConnectEncodesEverything(t *testing.T) {
	fk, n := newFake(t)
	cfg := Config{Index: AnyIndex, Size: 1 << 30, ServerFlags: 1 | 1<<2 | 1<<3 | 1<<5 | 1<<6 | 1<<8,
		Timeout: 0, DeadConnTimeout: 300 * time.Second, BackendID: "vol-1"}
	idx, err := n.Connect(cfg, socketpairs(t, 4))
	if err != nil {
		t.Fatal(err)
	}
	d := fk.devices[idx]
	if idx != 0 || d == nil || d.socks != 4 || d.size != 1<<30 || d.bs != 4096 ||
		d.flags != cfg.ServerFlags || d.dead != 300 || d.timeout != 0 || d.backend != "vol-1" {
		t.Fatalf("index %d, device %+v", idx, d)
	}
	if _, ok := fk.last[attrIndex]; ok {
		t.Fatal("AnyIndex sent an INDEX attribute; the kernel would not pick")
	}
	if _, ok := fk.last[attrClientFlags]; ok {
		t.Fatal("zero client flags were sent")
	}
	// The kernel picks the next free device.
	idx2, err := n.Connect(Config{Index: AnyIndex, Size: 4096, BlockSize: 512}, socketpairs(t, 1))
	if err != nil || idx2 != 1 || fk.devices[1].bs != 512 {
		t.Fatalf("second connect: %d %v", idx2, err)
	}
}

func TestConnectErrors(t *testing.T) {
	fk, n := newFake(t)
	if _, err := n.Connect(Config{Index: 3, Size: 4096}, socketpairs(t, 1)); err != nil {
		t.Fatal(err)
	}
	if fk.devices[3] == nil {
		t.Fatal("INDEX was not honoured")
	}
	_, err := n.Connect(Config{Index: 3, Size: 4096}, socketpairs(t, 1))
	if err == nil || !strings.Contains(err.Error(), "/dev/nbd3 is busy") {
		t.Fatalf("busy device: %v", err)
	}
	if _, err := n.Connect(Config{Index: AnyIndex, Size: 4096}, socketpairs(t, 2)); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("two sockets without CAN_MULTI_CONN: %v", err)
	}
	if _, err := n.Connect(Config{Index: AnyIndex, Size: 4096}, nil); err == nil {
		t.Fatal("no sockets accepted")
	}
	if _, err := n.Connect(Config{Index: AnyIndex}, socketpairs(t, 1)); err == nil {
		t.Fatal("zero size accepted")
	}
	f, _ := os.CreateTemp(t.TempDir(), "notasocket")
	defer f.Close()
	if _, err := n.Connect(Config{Index: AnyIndex, Size: 4096}, []*os.File{f}); !errors.Is(err, syscall.ENOTSOCK) {
		t.Fatalf("a file as socket: %v", err)
	}
}

func TestReconfigure(t *testing.T) {
	fk, n := newFake(t)
	idx, err := n.Connect(Config{Index: AnyIndex, Size: 8 << 20, ServerFlags: 1 << 8, BackendID: "cookie-a"}, socketpairs(t, 2))
	if err != nil {
		t.Fatal(err)
	}
	// Resize only: no sockets needed.
	if err := n.Reconfigure(idx, Reconfig{Size: 16 << 20, BackendID: "cookie-a"}, nil); err != nil {
		t.Fatal(err)
	}
	if fk.devices[idx].size != 16<<20 {
		t.Fatalf("size %d", fk.devices[idx].size)
	}
	// Replacing sockets needs dead ones.
	if err := n.Reconfigure(idx, Reconfig{BackendID: "cookie-a"}, socketpairs(t, 1)); !errors.Is(err, syscall.ENOSPC) ||
		!strings.Contains(err.Error(), "no dead connection") {
		t.Fatalf("no dead sockets: %v", err)
	}
	fk.devices[idx].deadSocks = 2
	if err := n.Reconfigure(idx, Reconfig{BackendID: "cookie-b"}, socketpairs(t, 2)); !errors.Is(err, syscall.EINVAL) ||
		!strings.Contains(err.Error(), "cookie") {
		t.Fatalf("wrong cookie: %v", err)
	}
	if err := n.Reconfigure(idx, Reconfig{BackendID: "cookie-a", DeadConnTimeout: 90 * time.Second}, socketpairs(t, 2)); err != nil {
		t.Fatal(err)
	}
	if fk.devices[idx].deadSocks != 0 || nlenc.Uint64(fk.last[attrDeadConnTimeout]) != 90 {
		t.Fatalf("after reattach: %+v", fk.devices[idx])
	}
}

func TestStatusAndDisconnect(t *testing.T) {
	_, n := newFake(t)
	idx, err := n.Connect(Config{Index: AnyIndex, Size: 4096}, socketpairs(t, 1))
	if err != nil {
		t.Fatal(err)
	}
	if s, err := n.Status(idx); err != nil || !s.Connected || s.Index != idx {
		t.Fatalf("status %+v %v", s, err)
	}
	if err := n.Disconnect(idx); err != nil {
		t.Fatal(err)
	}
	if s, err := n.Status(idx); err != nil || s.Connected {
		t.Fatalf("status after disconnect %+v %v", s, err)
	}
	if _, err := n.Status(9); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("status of an unknown device: %v", err)
	}
	if err := n.Disconnect(9); err == nil {
		t.Fatal("disconnect of an unknown device succeeded")
	}
}

func TestNoFamily(t *testing.T) {
	// The kernel answers CTRL_CMD_GETFAMILY for an unknown name with ENOENT.
	c := genltest.Dial(func(genetlink.Message, netlink.Message) ([]genetlink.Message, error) {
		return nil, genltest.Error(int(syscall.ENOENT))
	})
	if _, err := NewNetlink(c); !errors.Is(err, ErrNoFamily) {
		t.Fatalf("missing family: %v", err)
	}
}

func TestLinkDeadIndex(t *testing.T) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, 5)
	b, _ := ae.Encode()
	if i, ok := linkDeadIndex(genetlink.Message{Header: genetlink.Header{Command: cmdLinkDead}, Data: b}); !ok || i != 5 {
		t.Fatalf("got %d %v", i, ok)
	}
	if _, ok := linkDeadIndex(genetlink.Message{Header: genetlink.Header{Command: cmdStatus}, Data: b}); ok {
		t.Fatal("a status message read as LINK_DEAD")
	}
}
