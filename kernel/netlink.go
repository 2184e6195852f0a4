package kernel

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"time"

	"github.com/mdlayher/genetlink"
	"github.com/mdlayher/netlink"
)

// Names and numbers from include/uapi/linux/nbd-netlink.h; x/sys/unix has
// none of them.
const (
	familyName  = "nbd"
	familyGroup = "nbd_mc_group"

	cmdConnect     = 1
	cmdDisconnect  = 2
	cmdReconfigure = 3
	cmdLinkDead    = 4
	cmdStatus      = 5

	attrIndex           = 1
	attrSizeBytes       = 2
	attrBlockSizeBytes  = 3
	attrTimeout         = 4
	attrServerFlags     = 5
	attrClientFlags     = 6
	attrSockets         = 7
	attrDeadConnTimeout = 8
	attrDeviceList      = 9
	attrBackendID       = 10

	sockItem = 1
	sockFD   = 1

	deviceItem      = 1
	deviceIndex     = 1
	deviceConnected = 2
)

// Client flags (NBD_ATTR_CLIENT_FLAGS).
const (
	// ClientDestroyOnDisconnect removes a kernel-created device when it
	// is disconnected.
	ClientDestroyOnDisconnect = 1 << 0
	// ClientDisconnectOnClose disconnects when the last opener closes.
	ClientDisconnectOnClose = 1 << 1
)

// AnyIndex lets the kernel choose (or create) the device.
const AnyIndex = -1

// Config describes a device to connect.
type Config struct {
	Index     int    // device number, or AnyIndex
	Size      uint64 // bytes
	BlockSize uint64 // logical block size; 0 means 4096
	// ServerFlags are the NBD transmission flags the server would have
	// sent in its handshake (nbd.Flag*): they decide which commands the
	// kernel sends and whether it opens one queue per socket.
	ServerFlags uint64
	// Timeout aborts a request after this long and marks its socket
	// dead; 0 never times out (what a storage daemon that may wait for
	// a recovering cluster wants).
	Timeout time.Duration
	// DeadConnTimeout is how long I/O waits for a RECONFIGURE once every
	// socket is dead, before it fails.
	DeadConnTimeout time.Duration
	ClientFlags     uint64
	// BackendID is checked on RECONFIGURE, so a restarted server cannot
	// reattach the wrong image to a device.
	BackendID string
}

func (c Config) blockSize() uint64 {
	if c.BlockSize == 0 {
		return 4096
	}
	return c.BlockSize
}

// Reconfig changes a connected device. Zero fields are left as they are;
// BackendID must match the one the device was connected with.
type Reconfig struct {
	Size            uint64
	BlockSize       uint64 // with Size; 0 means 4096
	DeadConnTimeout time.Duration
	BackendID       string
}

// Status is one device as the kernel reports it.
type Status struct {
	Index     int
	Connected bool
}

// Controller is what an attacher needs from the kernel. Sockets are the
// kernel's ends of connected stream sockets; the kernel takes its own
// reference, so the caller may close them once the call returns.
type Controller interface {
	Connect(cfg Config, socks []*os.File) (index int, err error)
	// Reconfigure replaces dead sockets (one per socket given) and
	// applies rc.
	Reconfigure(index int, rc Reconfig, socks []*os.File) error
	Disconnect(index int) error
	Status(index int) (Status, error)
	// Name says which interface this is, for logs.
	Name() string
	Close() error
}

// ErrNoFamily means the running kernel has no "nbd" genl family: the
// module is not loaded, or not built.
var ErrNoFamily = errors.New("nbd netlink family not available")

// Netlink is the genetlink Controller.
type Netlink struct {
	c   *genetlink.Conn
	fam genetlink.Family
}

// DialNetlink connects to the kernel's nbd family.
func DialNetlink() (*Netlink, error) {
	c, err := genetlink.Dial(nil)
	if err != nil {
		return nil, fmt.Errorf("generic netlink: %w", err)
	}
	n, err := NewNetlink(c)
	if err != nil {
		c.Close()
	}
	return n, err
}

// NewNetlink uses c (a real connection, or genltest's fake kernel).
func NewNetlink(c *genetlink.Conn) (*Netlink, error) {
	fam, err := c.GetFamily(familyName)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, ErrNoFamily
		}
		return nil, fmt.Errorf("look up genl family %s: %w", familyName, err)
	}
	return &Netlink{c: c, fam: fam}, nil
}

func (n *Netlink) Name() string { return "netlink" }

func (n *Netlink) Close() error { return n.c.Close() }

func (n *Netlink) Connect(cfg Config, socks []*os.File) (int, error) {
	if len(socks) == 0 {
		return 0, errors.New("connect: no sockets")
	}
	if cfg.Size == 0 {
		return 0, errors.New("connect: size is zero")
	}
	ae := netlink.NewAttributeEncoder()
	if cfg.Index != AnyIndex {
		ae.Uint32(attrIndex, uint32(cfg.Index))
	}
	ae.Uint64(attrSizeBytes, cfg.Size)
	ae.Uint64(attrBlockSizeBytes, cfg.blockSize())
	ae.Uint64(attrServerFlags, cfg.ServerFlags)
	ae.Uint64(attrTimeout, seconds(cfg.Timeout))
	if cfg.DeadConnTimeout > 0 {
		ae.Uint64(attrDeadConnTimeout, seconds(cfg.DeadConnTimeout))
	}
	if cfg.ClientFlags != 0 {
		ae.Uint64(attrClientFlags, cfg.ClientFlags)
	}
	if cfg.BackendID != "" {
		ae.String(attrBackendID, cfg.BackendID)
	}
	encodeSockets(ae, socks)
	msgs, err := n.execute(cmdConnect, ae, true)
	if err != nil {
		if cfg.Index != AnyIndex && errors.Is(err, syscall.EBUSY) {
			return 0, fmt.Errorf("/dev/nbd%d is busy (already connected)", cfg.Index)
		}
		return 0, fmt.Errorf("nbd connect: %w", err)
	}
	for _, m := range msgs {
		if idx, ok := decodeIndex(m.Data); ok {
			return idx, nil
		}
	}
	return 0, errors.New("nbd connect: the kernel's reply has no device index")
}

func (n *Netlink) Reconfigure(index int, rc Reconfig, socks []*os.File) error {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	if rc.Size != 0 {
		ae.Uint64(attrSizeBytes, rc.Size)
		ae.Uint64(attrBlockSizeBytes, Config{BlockSize: rc.BlockSize}.blockSize())
	}
	if rc.DeadConnTimeout > 0 {
		ae.Uint64(attrDeadConnTimeout, seconds(rc.DeadConnTimeout))
	}
	if rc.BackendID != "" {
		ae.String(attrBackendID, rc.BackendID)
	}
	if len(socks) > 0 {
		encodeSockets(ae, socks)
	}
	if _, err := n.execute(cmdReconfigure, ae, false); err != nil {
		switch {
		case errors.Is(err, syscall.EINVAL):
			return fmt.Errorf("nbd reconfigure /dev/nbd%d: refused (not connected, or another backend/cookie): %w", index, err)
		case errors.Is(err, syscall.ENOSPC):
			return fmt.Errorf("nbd reconfigure /dev/nbd%d: no dead connection to replace: %w", index, err)
		}
		return fmt.Errorf("nbd reconfigure /dev/nbd%d: %w", index, err)
	}
	return nil
}

func (n *Netlink) Disconnect(index int) error {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	if _, err := n.execute(cmdDisconnect, ae, false); err != nil {
		return fmt.Errorf("nbd disconnect /dev/nbd%d: %w", index, err)
	}
	return nil
}

func (n *Netlink) Status(index int) (Status, error) {
	ae := netlink.NewAttributeEncoder()
	ae.Uint32(attrIndex, uint32(index))
	msgs, err := n.execute(cmdStatus, ae, true)
	if err != nil {
		return Status{}, fmt.Errorf("nbd status /dev/nbd%d: %w", index, err)
	}
	for _, m := range msgs {
		list, err := decodeDeviceList(m.Data)
		if err != nil {
			return Status{}, fmt.Errorf("nbd status: %w", err)
		}
		for _, s := range list {
			if s.Index == index {
				return s, nil
			}
		}
	}
	return Status{}, fmt.Errorf("nbd status: /dev/nbd%d: %w", index, os.ErrNotExist)
}

// execute sends one command. Commands the kernel answers with a message
// (CONNECT, STATUS) must not also ask for an acknowledgement: the ack can
// arrive in a later read, after Execute has returned with the reply, and
// the next command would then read a stale ack ("mismatched sequence").
// Errors come back as netlink errors either way.
func (n *Netlink) execute(cmd uint8, ae *netlink.AttributeEncoder, replies bool) ([]genetlink.Message, error) {
	b, err := ae.Encode()
	if err != nil {
		return nil, err
	}
	flags := netlink.Request
	if !replies {
		flags |= netlink.Acknowledge
	}
	return n.c.Execute(genetlink.Message{
		Header: genetlink.Header{Command: cmd, Version: n.fam.Version},
		Data:   b,
	}, n.fam.ID, flags)
}

func encodeSockets(ae *netlink.AttributeEncoder, socks []*os.File) {
	ae.Nested(attrSockets, func(nae *netlink.AttributeEncoder) error {
		for _, f := range socks {
			nae.Nested(sockItem, func(iae *netlink.AttributeEncoder) error {
				iae.Uint32(sockFD, uint32(f.Fd()))
				return nil
			})
		}
		return nil
	})
}

func decodeIndex(b []byte) (int, bool) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return 0, false
	}
	for ad.Next() {
		if ad.Type() == attrIndex {
			return int(ad.Uint32()), ad.Err() == nil
		}
	}
	return 0, false
}

func decodeDeviceList(b []byte) ([]Status, error) {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return nil, err
	}
	var list []Status
	for ad.Next() {
		if ad.Type() != attrDeviceList {
			continue
		}
		ad.Nested(func(lad *netlink.AttributeDecoder) error {
			for lad.Next() {
				if lad.Type() != deviceItem {
					continue
				}
				var s Status
				lad.Nested(func(iad *netlink.AttributeDecoder) error {
					for iad.Next() {
						switch iad.Type() {
						case deviceIndex:
							s.Index = int(iad.Uint32())
						case deviceConnected:
							s.Connected = iad.Uint8() != 0
						}
					}
					return nil
				})
				list = append(list, s)
			}
			return nil
		})
	}
	return list, ad.Err()
}

func seconds(d time.Duration) uint64 {
	if d <= 0 {
		return 0
	}
	return uint64((d + time.Second - 1) / time.Second)
}
