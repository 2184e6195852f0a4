package metrics

import (
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

func TestAddress(t *testing.T) {
	for in, want := range map[string]string{"9100": "127.0.0.1:9100", ":9100": "127.0.0.1:9100",
		"0.0.0.0:9100": "0.0.0.0:9100", "[::1]:9100": "[::1]:9100"} {
		if got, err := Address(in); err != nil || got != want {
			t.Errorf("Address(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "foo", "host:", "1.2.3.4:99999", "a:b:c"} {
		if _, err := Address(bad); err == nil {
			t.Errorf("Address(%q) accepted", bad)
		}
	}
}

func TestForSpec(t *testing.T) {
	d := ForSpec("/dev/nbd3", "rbd/ns1/img@s", "c", nbd.Snapshot{})
	if d.Pool != "rbd" || d.Namespace != "ns1" || d.Image != "img@s" || d.Device != "/dev/nbd3" || d.Cookie != "c" {
		t.Fatalf("%+v", d)
	}
	if d := ForSpec("x", "mem:1G", "", nbd.Snapshot{}); d.Image != "mem:1G" || d.Pool != "" {
		t.Fatalf("%+v", d)
	}
}

// TestCollector: a device's series, its cumulative buckets in seconds,
// and none left once the device is gone.
func TestCollector(t *testing.T) {
	var h nbd.HistogramSnapshot
	h.Counts[0], h.Counts[4] = 3, 1 // 3 under 50 µs, 1 in (500 µs, 1 ms]
	h.Sum = 2 * time.Millisecond
	devs := []Device{ForSpec("/dev/nbd0", "rbd/img", "vol-1", nbd.Snapshot{
		Ops:    map[string]nbd.OpSnapshot{"write": {Requests: 4, Bytes: 16384, Queued: h, Backend: h}},
		Errors: map[string]uint64{"EIO": 2}, InFlight: 1})}
	c := NewCollector(func() []Device { return devs })
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(c)
	want := `
# HELP rbd_nbd_requests_total NBD requests answered, by command.
# TYPE rbd_nbd_requests_total counter
rbd_nbd_requests_total{cookie="vol-1",device="/dev/nbd0",image="img",namespace="",op="write",pool="rbd",pvc="",pvc_namespace=""} 4
# HELP rbd_nbd_errors_total Requests answered with an error, by NBD errno.
# TYPE rbd_nbd_errors_total counter
rbd_nbd_errors_total{cookie="vol-1",device="/dev/nbd0",errno="EIO",image="img",namespace="",pool="rbd",pvc="",pvc_namespace=""} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "rbd_nbd_requests_total", "rbd_nbd_errors_total"); err != nil {
		t.Fatal(err)
	}
	out, err := testutil.CollectAndFormat(c, expfmt.TypeTextPlain, "rbd_nbd_request_backend_seconds")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{`le="5e-05"} 3`, `le="0.001"} 4`, `le="+Inf"} 4`, `_sum{cookie="vol-1",device="/dev/nbd0",image="img",namespace="",op="write",pool="rbd",pvc="",pvc_namespace=""} 0.002`} {
		if !strings.Contains(string(out), s) {
			t.Errorf("no %s in\n%s", s, out)
		}
	}
	devs = nil
	if n := testutil.CollectAndCount(c, "rbd_nbd_requests_total"); n != 0 {
		t.Fatalf("%d series of an unmapped device", n)
	}
}

// TestCSICalls: calls by method and code, with durations, under the
// name csi-lib-utils gives plugins.
func TestCSICalls(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	c := NewCSICalls(reg, "rbd.csi.ceph.com")
	c.ObserveCall("/csi.v1.Node/NodeStageVolume", "OK", 3*time.Second)
	c.ObserveCall("/csi.v1.Node/NodeStageVolume", "OK", 20*time.Millisecond)
	c.ObserveCall("/csi.v1.Controller/CreateVolume", "Aborted", time.Millisecond)
	if n := testutil.CollectAndCount(c.h); n != 2 {
		t.Fatalf("%d series, want one per method and code", n)
	}
	out, err := testutil.CollectAndFormat(c.h, expfmt.TypeTextPlain, "csi_plugin_operations_seconds")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{
		`csi_plugin_operations_seconds_count{driver_name="rbd.csi.ceph.com",grpc_status_code="OK",method_name="/csi.v1.Node/NodeStageVolume"} 2`,
		`csi_plugin_operations_seconds_bucket{driver_name="rbd.csi.ceph.com",grpc_status_code="OK",method_name="/csi.v1.Node/NodeStageVolume",le="2.5"} 1`,
		`csi_plugin_operations_seconds_count{driver_name="rbd.csi.ceph.com",grpc_status_code="Aborted",method_name="/csi.v1.Controller/CreateVolume"} 1`,
	} {
		if !strings.Contains(string(out), s) {
			t.Errorf("no %s in\n%s", s, out)
		}
	}
	if _, err := reg.Gather(); err != nil {
		t.Fatal(err)
	}
}

// TestClusterImages: images open per cluster connection, one series per
// cluster and user.
func TestClusterImages(t *testing.T) {
	reg := NewRegistry(func() []Device { return nil }, func() []Connection {
		return []Connection{{Cluster: "10.0.0.1:6789", User: "csi", Images: 2}, {Cluster: "/etc/ceph/ceph.conf", User: "admin", Images: 1}}
	})
	want := `
# HELP rbd_nbd_cluster_images_open Images open on each cluster connection the daemon holds (one per cluster and user).
# TYPE rbd_nbd_cluster_images_open gauge
rbd_nbd_cluster_images_open{cluster="/etc/ceph/ceph.conf",user="admin"} 1
rbd_nbd_cluster_images_open{cluster="10.0.0.1:6789",user="csi"} 2
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "rbd_nbd_cluster_images_open"); err != nil {
		t.Fatal(err)
	}
}
