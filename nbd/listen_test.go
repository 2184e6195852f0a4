package nbd

import (
	"net"
	"testing"
)

func TestListenTCPDefaultsToLoopback(t *testing.T) {
	for _, addr := range []string{"0", ":0"} {
		l, err := ListenTCP(addr)
		if err != nil {
			t.Fatal(err)
		}
		if ip := l.Addr().(*net.TCPAddr).IP; !ip.IsLoopback() {
			t.Fatalf("%q listened on %v", addr, ip)
		}
		l.Close()
	}
	if _, err := ListenTCP("not an address"); err == nil {
		t.Fatal("bad address accepted")
	}
}
