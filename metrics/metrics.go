// Package metrics exposes the NBD devices' counters (nbd.Stats) to
// Prometheus. Nothing is counted here: each scrape reads the counters the
// request path keeps with atomic adds and turns them into metrics, so
// the fast path pays nothing for a collector, and a device's series go
// away with the device.
package metrics

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/loopback"
	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// Device is one device's labels and counters at a scrape. The labels
// name it and nothing else: never a key or a secret.
type Device struct {
	Device, Pool, Namespace, Image, Cookie string
	// PVC and PVCNamespace: the Kubernetes claim, for a CSI volume whose
	// provisioner named it.
	PVC, PVCNamespace string
	Stats             nbd.Snapshot
	// Replaced, Reattached and Resized count the device's dead sockets
	// replaced (LINK_DEAD), reattaches and resizes.
	Replaced, Reattached, Resized uint64
}

// Source lists the devices at a scrape.
type Source func() []Device

var deviceLabels = []string{"device", "pool", "namespace", "image", "cookie", "pvc", "pvc_namespace"}

// collector turns a Source into metrics at each scrape.
type collector struct {
	src                        Source
	reqs, bytes, queued, inRBD *prometheus.Desc
	errs, inflight, loans, spl *prometheus.Desc
	conns, closed              *prometheus.Desc
	replaced, reattached, grew *prometheus.Desc
	devices                    *prometheus.Desc
}

// NewCollector reports src's devices under the rbd_nbd_ prefix.
func NewCollector(src Source) prometheus.Collector {
	d := func(name, help string, extra ...string) *prometheus.Desc {
		return prometheus.NewDesc("rbd_nbd_"+name, help, append(append([]string{}, deviceLabels...), extra...), nil)
	}
	return &collector{src: src,
		reqs:  d("requests_total", "NBD requests answered, by command.", "op"),
		bytes: d("bytes_total", "Bytes the answered requests covered, by command.", "op"),
		queued: d("request_queued_seconds",
			"Time from reading a request to handing it to the backend (librbd), by command.", "op"),
		inRBD: d("request_backend_seconds",
			"Time a request spent in the backend (librbd) until it completed, by command.", "op"),
		errs:     d("errors_total", "Requests answered with an error, by NBD errno.", "errno"),
		inflight: d("requests_in_flight", "Requests in the backend now."),
		loans:    d("read_loans_total", "READs answered with data the backend lent (no copy into our buffers)."),
		spl:      d("spliced_bytes_total", "READ payload bytes sent to the kernel by reference (zero-copy)."),
		conns:    d("connections", "Connections (kernel sockets) being served now."),
		closed: d("connections_closed_total",
			"Connections that ended: the kernel gave up on a socket, a reconfigure, a handover, a client leaving."),
		replaced: d("link_dead_replacements_total",
			"Dead sockets replaced after the kernel said LINK_DEAD (a request timed out on them)."),
		reattached: d("reattaches_total", "Reattaches: new sockets after a detach, or after the daemon restarted."),
		grew:       d("resizes_total", "Times the image grew under the device and the kernel was told."),
		devices:    prometheus.NewDesc("rbd_nbd_devices", "Devices this process serves.", nil, nil),
	}
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.reqs, c.bytes, c.queued, c.inRBD, c.errs, c.inflight, c.loans, c.spl,
		c.conns, c.closed, c.replaced, c.reattached, c.grew, c.devices} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	devs := c.src()
	ch <- prometheus.MustNewConstMetric(c.devices, prometheus.GaugeValue, float64(len(devs)))
	for _, d := range devs {
		l := []string{d.Device, d.Pool, d.Namespace, d.Image, d.Cookie, d.PVC, d.PVCNamespace}
		with := func(v string) []string { return append(append([]string{}, l...), v) }
		s := d.Stats
		for op, o := range s.Ops {
			ch <- prometheus.MustNewConstMetric(c.reqs, prometheus.CounterValue, float64(o.Requests), with(op)...)
			ch <- prometheus.MustNewConstMetric(c.bytes, prometheus.CounterValue, float64(o.Bytes), with(op)...)
			ch <- histogram(c.queued, o.Queued, with(op))
			if o.Backend.Count() > 0 {
				ch <- histogram(c.inRBD, o.Backend, with(op))
			}
		}
		for e, n := range s.Errors {
			ch <- prometheus.MustNewConstMetric(c.errs, prometheus.CounterValue, float64(n), with(e)...)
		}
		ch <- prometheus.MustNewConstMetric(c.inflight, prometheus.GaugeValue, float64(s.InFlight), l...)
		ch <- prometheus.MustNewConstMetric(c.loans, prometheus.CounterValue, float64(s.Loans), l...)
		ch <- prometheus.MustNewConstMetric(c.spl, prometheus.CounterValue, float64(s.Spliced), l...)
		ch <- prometheus.MustNewConstMetric(c.conns, prometheus.GaugeValue, float64(s.Conns), l...)
		ch <- prometheus.MustNewConstMetric(c.closed, prometheus.CounterValue, float64(s.Closed), l...)
		ch <- prometheus.MustNewConstMetric(c.replaced, prometheus.CounterValue, float64(d.Replaced), l...)
		ch <- prometheus.MustNewConstMetric(c.reattached, prometheus.CounterValue, float64(d.Reattached), l...)
		ch <- prometheus.MustNewConstMetric(c.grew, prometheus.CounterValue, float64(d.Resized), l...)
	}
}

// histogram is h as a Prometheus histogram: cumulative buckets, seconds.
func histogram(d *prometheus.Desc, h nbd.HistogramSnapshot, labels []string) prometheus.Metric {
	buckets := make(map[float64]uint64, len(nbd.LatencyBounds))
	var cum uint64
	for i, b := range nbd.LatencyBounds {
		cum += h.Counts[i]
		buckets[b.Seconds()] = cum
	}
	return prometheus.MustNewConstHistogram(d, h.Count(), h.Sum.Seconds(), buckets, labels...)
}

// NewRegistry holds the devices' collector, the cluster connections'
// (if clusters is not nil), and the Go runtime's and the process's.
func NewRegistry(src Source, clusters ClusterSource) *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(NewCollector(src), collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if clusters != nil {
		reg.MustRegister(clusterCollector{clusters, prometheus.NewDesc("rbd_nbd_cluster_images_open",
			"Images open on each cluster connection the daemon holds (one per cluster and user).",
			[]string{"cluster", "user"}, nil)})
	}
	return reg
}

// Connection is one cluster connection at a scrape: where (monitors or
// ceph.conf), as whom, and the images open on it.
type Connection struct {
	Cluster, User string
	Images        int
}

// ClusterSource lists the cluster connections at a scrape.
type ClusterSource func() []Connection

type clusterCollector struct {
	src  ClusterSource
	desc *prometheus.Desc
}

func (c clusterCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c clusterCollector) Collect(ch chan<- prometheus.Metric) {
	seen := map[[2]string]int{}
	for _, cn := range c.src() {
		seen[[2]string{cn.Cluster, cn.User}] += cn.Images
	}
	for k, n := range seen {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), k[0], k[1])
	}
}

// Address checks addr, HOST:PORT or a bare PORT, and completes it.
// Without a host it is loopback: the endpoint names every image of the
// node, and is reachable from other hosts only when asked for.
func Address(addr string) (string, error) { return loopback.Address("metrics", addr) }

// Listen listens on Address(addr).
func Listen(addr string) (net.Listener, error) { return loopback.Listen("metrics", addr) }

// Serve answers /metrics from reg on l until ctx ends.
func Serve(ctx context.Context, l net.Listener, reg *prometheus.Registry, log *slog.Logger) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	stop := context.AfterFunc(ctx, func() { srv.Close() })
	defer stop()
	log.Info("serving metrics", "address", "http://"+l.Addr().String()+"/metrics")
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// ForSpec labels a device's counters from its spec (an RBD image's pool,
// namespace and image; any other spec whole, as the image).
func ForSpec(device, spec, cookie string, s nbd.Snapshot) Device {
	d := Device{Device: device, Image: spec, Cookie: cookie, Stats: s}
	if sp, err := devspec.Parse(spec); err == nil && sp.IsRBD() {
		d.Pool, d.Namespace, d.Image = sp.Image.Pool, sp.Image.Namespace, sp.Image.Image
		if sp.Image.Snap != "" {
			d.Image += "@" + sp.Image.Snap
		}
	}
	return d
}

// ServeRetrying is Listen and Serve, trying the listen again every
// second while the address is taken: in an upgrade the old daemon holds
// it until it has handed its devices over. Metrics never stop the
// caller; failures are logged.
func ServeRetrying(ctx context.Context, addr string, reg *prometheus.Registry, log *slog.Logger) {
	if _, err := Address(addr); err != nil {
		log.Error("no metrics endpoint", "err", err)
		return
	}
	logged := false
	for {
		l, err := Listen(addr)
		if err == nil {
			if err := Serve(ctx, l, reg, log); err != nil {
				log.Warn("metrics endpoint stopped", "err", err)
			}
			return
		}
		if !logged {
			log.Warn("metrics endpoint: cannot listen yet; trying every second", "address", addr, "err", err)
			logged = true
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}
