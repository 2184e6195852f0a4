// Package unixsock listens on unix sockets only their owner can reach,
// for every server here: the NBD export, the node daemon's control
// socket, the CSI endpoint and the kubelet registration socket.
package unixsock

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
)

// Listen listens on a unix socket at path that only its owner can
// connect to (mode 0600). The socket is bound inside a fresh 0700
// directory, chmod-ed, then renamed into place, so there is no moment when
// it exists at path with looser permissions. A stale socket left by a dead
// server is replaced; one that still answers is an error.
func Listen(path string) (net.Listener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("listen %s: exists and is not a socket", path)
		}
		if c, err := net.Dial("unix", path); err == nil {
			c.Close()
			return nil, fmt.Errorf("listen %s: another server is listening there", path)
		}
	}
	tmp, err := os.MkdirTemp(filepath.Dir(path), ".sock-")
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	defer os.RemoveAll(tmp)
	staging := filepath.Join(tmp, "s")
	l, err := net.Listen("unix", staging)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	ul := l.(*net.UnixListener)
	ul.SetUnlinkOnClose(false) // it will not be at staging any more
	if err := os.Chmod(staging, 0o600); err == nil {
		err = os.Rename(staging, path)
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	return &unixListener{UnixListener: ul, path: path}, nil
}

type unixListener struct {
	*net.UnixListener
	path string
}

// Close removes the socket file, so a clean exit leaves nothing behind.
func (l *unixListener) Close() error {
	err := l.UnixListener.Close()
	os.Remove(l.path)
	return err
}
