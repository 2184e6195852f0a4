package interop

import (
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// TestServeMetrics: fio through serve, then a scrape of its metrics
// endpoint. The counts are what fio did (requests within 1 %, bytes
// exact for fixed-size jobs), nothing is left in flight, and a bare port
// listens on loopback only.
func TestServeMetrics(t *testing.T) {
	need(t, "fio")
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	l.Close()
	s := serve(t, false, "--metrics-address", port, "mem:64M")
	for _, job := range [][]string{
		{"--rw=randwrite", "--bs=4k", "--iodepth=16", "--size=16M"},
		{"--rw=randread", "--bs=64k", "--iodepth=4", "--size=16M"},
	} {
		args := append([]string{"--name=m", "--ioengine=nbd", "--uri=" + s.uri, "--output-format=json"}, job...)
		if j := fioJobs(t, run(t, "fio", args...))[0]; j.Error != 0 {
			t.Fatalf("fio %v: error %d", job, j.Error)
		}
	}
	resp, err := http.Get("http://127.0.0.1:" + port + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := parseMetrics(string(body))
	want := func(name, op string, n float64, tol float64) {
		t.Helper()
		key := name + `{cookie="",device="unix:` + s.socket + `",image="mem:64M",namespace="",op="` + op + `",pool="",pvc="",pvc_namespace=""}`
		got, ok := m[key]
		if !ok {
			t.Fatalf("no %s in the scrape:\n%s", key, body)
		}
		if got < n*(1-tol) || got > n*(1+tol) {
			t.Errorf("%s = %v, want %v", key, got, n)
		}
	}
	want("rbd_nbd_requests_total", "write", 4096, 0.01)
	want("rbd_nbd_bytes_total", "write", 16<<20, 0)
	want("rbd_nbd_requests_total", "read", 256, 0.01)
	want("rbd_nbd_bytes_total", "read", 16<<20, 0)
	want("rbd_nbd_request_backend_seconds_count", "write", m[`rbd_nbd_requests_total{cookie="",device="unix:`+s.socket+`",image="mem:64M",namespace="",op="write",pool="",pvc="",pvc_namespace=""}`], 0)
	if v := m[`rbd_nbd_requests_in_flight{cookie="",device="unix:`+s.socket+`",image="mem:64M",namespace="",pool="",pvc="",pvc_namespace=""}`]; v != 0 {
		t.Errorf("%v requests in flight after fio ended", v)
	}
	if m["rbd_nbd_devices"] != 1 || m["go_goroutines"] == 0 || m["process_cpu_seconds_total"] == 0 {
		t.Errorf("devices %v, go_goroutines %v, process_cpu_seconds_total %v", m["rbd_nbd_devices"],
			m["go_goroutines"], m["process_cpu_seconds_total"])
	}
	s.stop(t) // stderr is read only once the server has exited
	if !strings.Contains(s.stderr.String(), "address=http://127.0.0.1:"+port+"/metrics") {
		t.Errorf("a bare port did not listen on loopback: %s", s.stderr)
	}
}

// parseMetrics reads Prometheus' text format into series → value.
func parseMetrics(text string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(text, "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		if v, err := strconv.ParseFloat(line[i+1:], 64); err == nil {
			out[line[:i]] = v
		}
	}
	return out
}
