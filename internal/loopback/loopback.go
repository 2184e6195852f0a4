// Package loopback reads the TCP addresses of the endpoints that show a
// node's insides (metrics, profiles): a bare port means 127.0.0.1, so
// another host reaches them only when a host is given.
package loopback

import (
	"fmt"
	"net"
	"strconv"
)

// Address checks addr, HOST:PORT, :PORT or PORT, and completes it; what
// names the flag in the error.
func Address(what, addr string) (string, error) {
	if _, err := strconv.Atoi(addr); err == nil {
		addr = ":" + addr
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("%s address %q: want HOST:PORT or PORT", what, addr)
	}
	if _, err := strconv.ParseUint(port, 10, 16); err != nil {
		return "", fmt.Errorf("%s address %q: bad port", what, addr)
	}
	if host == "" {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port), nil
}

// Listen listens on Address(what, addr).
func Listen(what, addr string) (net.Listener, error) {
	a, err := Address(what, addr)
	if err != nil {
		return nil, err
	}
	return net.Listen("tcp", a)
}
