package nbd

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"syscall"
)

// ListenTCP listens on addr; a bare port or ":port" means loopback only,
// so exposing a disk to the network is always an explicit choice.
func ListenTCP(addr string) (net.Listener, error) {
	if _, err := strconv.Atoi(addr); err == nil {
		addr = ":" + addr
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("listen %q: want HOST:PORT or PORT", addr)
	}
	if host == "" {
		host = "127.0.0.1"
	}
	l, err := net.Listen("tcp", net.JoinHostPort(host, port))
	if err != nil {
		return nil, err
	}
	return tcpNoDelay{l.(*net.TCPListener)}, nil
}

// tcpNoDelay is explicit about Nagle being off: replies are already
// batched into one writev, delaying them would only add latency.
type tcpNoDelay struct{ *net.TCPListener }

func (l tcpNoDelay) Accept() (net.Conn, error) {
	c, err := l.AcceptTCP()
	if err != nil {
		return nil, err
	}
	c.SetNoDelay(true)
	return c, nil
}

// ActivationListener returns the listener passed by systemd-style socket
// activation (LISTEN_PID = us, LISTEN_FDS >= 1, first fd 3), or nil when
// there is none. nbdinfo and nbdcopy start servers this way.
func ActivationListener() (net.Listener, error) {
	if os.Getenv("LISTEN_PID") != strconv.Itoa(os.Getpid()) {
		return nil, nil
	}
	n, err := strconv.Atoi(os.Getenv("LISTEN_FDS"))
	if err != nil || n < 1 {
		return nil, nil
	}
	os.Unsetenv("LISTEN_PID")
	os.Unsetenv("LISTEN_FDS")
	os.Unsetenv("LISTEN_FDNAMES")
	syscall.CloseOnExec(3)
	f := os.NewFile(3, "listen-fd")
	l, err := net.FileListener(f)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("socket activation: %w", err)
	}
	return l, nil
}

func isTemporaryAccept(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.ENOBUFS) ||
		errors.Is(err, syscall.ENOMEM)
}
