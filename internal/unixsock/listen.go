// Package unixsock listens on unix sockets only their owner can reach,
// for every server here: the NBD export, the node daemon's control
// socket, the CSI endpoint and the kubelet registration socket.
package unixsock

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
)

// Listen listens on a unix socket at path that only its owner can
// connect to (mode 0600). The socket is bound inside a fresh 0700
// directory, chmod-ed, then renamed into place, so there is no moment when
// it exists at path with looser permissions. A stale socket left by a dead
// server is replaced; one that still answers is an error.
func Listen(path string) (net.Listener, error) { return listen("unix", path, false) }

// Replace is Listen that also takes the path from a live server: new
// clients reach us, the old server keeps the ones it has, and its Close
// leaves our socket alone. A DaemonSet's old and new pods overlap in an
// upgrade, and the kubelet must find the new one's sockets.
func Replace(path string) (net.Listener, error) { return listen("unix", path, true) }

// ListenSeqpacket is Listen for a SOCK_SEQPACKET socket: messages keep
// their boundaries, and the descriptors passed with each.
func ListenSeqpacket(path string) (net.Listener, error) { return listen("unixpacket", path, false) }

func listen(network, path string, replace bool) (net.Listener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("listen %s: exists and is not a socket", path)
		}
		if c, err := net.Dial(network, path); err == nil {
			c.Close()
			if !replace {
				return nil, fmt.Errorf("listen %s: another server is listening there", path)
			}
		}
	}
	tmp, err := os.MkdirTemp(filepath.Dir(path), ".sock-")
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	defer os.RemoveAll(tmp)
	staging := filepath.Join(tmp, "s")
	l, err := net.Listen(network, staging)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(false) // it will not be at staging any more
	var fi os.FileInfo
	if err = os.Chmod(staging, 0o600); err == nil {
		if fi, err = os.Lstat(staging); err == nil {
			err = os.Rename(staging, path)
		}
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	return &unixListener{UnixListener: ul, path: path, file: fi}, nil
}

type unixListener struct {
	*net.UnixListener
	path string
	file os.FileInfo // the socket file we bound; nil if received
	keep atomic.Bool // handed off: another process serves the path
}

// Close removes the socket file, so a clean exit leaves nothing behind,
// unless the socket was handed off or the path is another server's now
// (Replace).
func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	if l.keep.Load() {
		return err
	}
	if fi, serr := os.Lstat(l.path); serr == nil && (l.file == nil || os.SameFile(fi, l.file)) {
		os.Remove(l.path)
	}
	return err
}

// Handoff returns a duplicate of l's listening socket, for another
// process to serve (an upgrade of the daemon), and makes l's Close
// leave the socket file in place: the socket goes on accepting, in the
// other process, without a moment when the path answers nothing.
func Handoff(l net.Listener) (*os.File, error) {
	ul, ok := l.(*unixListener)
	if !ok {
		return nil, fmt.Errorf("handoff: not a unixsock listener")
	}
	f, err := ul.UnixListener.File()
	if err != nil {
		return nil, err
	}
	ul.keep.Store(true)
	return f, nil
}

// FromFile serves a listening socket received from another process,
// bound at path; its Close removes path, as Listen's does.
func FromFile(f *os.File, path string) (net.Listener, error) {
	l, err := net.FileListener(f)
	if err != nil {
		return nil, fmt.Errorf("listener %s: %w", path, err)
	}
	ul, ok := l.(*net.UnixListener)
	if !ok {
		l.Close()
		return nil, fmt.Errorf("listener %s: not a unix socket", path)
	}
	ul.SetUnlinkOnClose(false)
	fi, _ := os.Lstat(path) // the handed socket's file, unless replaced since
	return &unixListener{UnixListener: ul, path: path, file: fi}, nil
}
