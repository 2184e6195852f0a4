// Package storagee2e is Kubernetes' e2e suite cut down to its storage
// tests for an out-of-tree CSI driver: the External.Storage specs of
// k8s.io/kubernetes/test/e2e/storage/external, run by the e2e suite's own
// RunE2ETests (its cluster checks before the suite, its reports after),
// with the flags and file sources upstream's e2e.test sets up
// (test/e2e/e2e_test.go at the pinned version).
//
// Why not upstream's e2e.test: it compiles every e2e spec (7907 at
// v1.36.1), and each ginkgo process builds that whole tree before it
// filters it. In the TCG VM that took 33 s per process on an idle box
// and about four minutes for three processes beside a loaded cluster,
// before the first storage spec ran. This binary's tree is 865 specs
// (the e2e package brings test/e2e/common's along) and selects the same
// External.Storage ones (the same 248, by name, with make
// e2e-k8s-conformance's skips), built in a sixth of the time. It is what
// Kubernetes documents for out-of-tree drivers: import the external
// package into a suite of one's own.
package storagee2e

import (
	"flag"
	"os"
	"testing"

	"k8s.io/kubernetes/test/e2e"
	"k8s.io/kubernetes/test/e2e/framework"
	"k8s.io/kubernetes/test/e2e/framework/config"
	"k8s.io/kubernetes/test/e2e/framework/testfiles"
	"k8s.io/kubernetes/test/e2e/invariants/logcheck"
	e2etestingmanifests "k8s.io/kubernetes/test/e2e/testing-manifests"
	testfixtures "k8s.io/kubernetes/test/fixtures"

	// Feature names frozen before any spec names one, as in e2e.test.
	_ "k8s.io/kubernetes/test/e2e/feature"
	// The checks e2e.test runs after the suite (metrics, log check).
	_ "k8s.io/kubernetes/test/e2e/invariants"
	// The specs: every External.Storage spec, for the driver that
	// -storage.testdriver describes.
	_ "k8s.io/kubernetes/test/e2e/storage/external"

	// The framework's hooks e2e.test installs.
	_ "k8s.io/kubernetes/test/e2e/framework/debug/init"
	_ "k8s.io/kubernetes/test/e2e/framework/metrics/init"
	_ "k8s.io/kubernetes/test/e2e/framework/node/init"
	_ "k8s.io/kubernetes/test/utils/format"
)

// TestMain registers and reads the flags as e2e.test's does, and adds
// the same file sources: the embedded testing manifests and fixtures,
// then -repo-root.
func TestMain(m *testing.M) {
	config.CopyFlags(config.Flags, flag.CommandLine)
	framework.RegisterCommonFlags(flag.CommandLine)
	framework.RegisterClusterFlags(flag.CommandLine)
	logcheck.RegisterFlags(flag.CommandLine)
	flag.Parse()
	testfiles.AddFileSource(e2etestingmanifests.GetE2ETestingManifestsFS())
	testfiles.AddFileSource(testfixtures.GetTestFixturesFS())
	framework.AfterReadingAllFlags(&framework.TestContext)
	if framework.TestContext.RepoRoot != "" {
		testfiles.AddFileSource(testfiles.RootFileSource{Root: framework.TestContext.RepoRoot})
	}
	os.Exit(m.Run())
}

// TestE2E runs the suite the way e2e.test's TestE2E does.
func TestE2E(t *testing.T) { e2e.RunE2ETests(t) }
