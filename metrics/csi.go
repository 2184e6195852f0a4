package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// CSICalls counts a CSI plugin's calls by method and status code, with
// their durations, as csi_plugin_operations_seconds: the name and labels
// csi-lib-utils gives plugins, so dashboards made for other CSI drivers
// read it. NodeStageVolume's and NodeUnstageVolume's series are the
// stage and unstage durations.
type CSICalls struct {
	driver string
	h      *prometheus.HistogramVec
}

// NewCSICalls registers the calls' histogram, and the Go runtime's and
// the process's collectors, in reg.
func NewCSICalls(reg prometheus.Registerer, driver string) *CSICalls {
	c := &CSICalls{driver: driver, h: prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "csi_plugin_operations_seconds",
		Help: "CSI calls this plugin answered, by method and gRPC status code, with their durations.",
		// From a Probe (milliseconds) to a CreateVolume waiting on a
		// flatten or a NodeStageVolume formatting a large volume.
		Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300},
	}, []string{"driver_name", "method_name", "grpc_status_code"})}
	reg.MustRegister(c.h, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return c
}

// ObserveCall implements csi.CallObserver.
func (c *CSICalls) ObserveCall(method, code string, took time.Duration) {
	c.h.WithLabelValues(c.driver, method, code).Observe(took.Seconds())
}
