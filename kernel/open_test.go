package kernel

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

type stubController struct{ Controller }

func (stubController) Name() string { return "stub" }

func testProbe(t *testing.T) (*Probe, *bool, *string) {
	dir := t.TempDir()
	loaded := false
	var params string
	p := &Probe{
		DevNbd0: filepath.Join(dir, "nbd0"),
		SysMod:  filepath.Join(dir, "module"),
		Ioctl:   func() Controller { return stubController{} },
		Wait:    200 * time.Millisecond,
		Release: func() string { return "6.9.9-test" },
	}
	p.Dial = func() (Controller, error) {
		if loaded {
			return &Netlink{}, nil
		}
		return nil, ErrNoFamily
	}
	p.Load = func(ps string) error { params = ps; loaded = true; return nil }
	return p, &loaded, &params
}

func TestOpenPrefersNetlink(t *testing.T) {
	p, loaded, _ := testProbe(t)
	*loaded = true
	c, err := p.Open(ModuleOptions{})
	if err != nil || c.Name() != "netlink" {
		t.Fatalf("%v %v", c, err)
	}
}

func TestOpenFallsBackToIoctl(t *testing.T) {
	p, _, _ := testProbe(t)
	os.WriteFile(p.DevNbd0, nil, 0o600)
	c, err := p.Open(ModuleOptions{})
	if err != nil || c.Name() != "stub" {
		t.Fatalf("%v %v", c, err)
	}
}

func TestOpenLoadsModule(t *testing.T) {
	p, loaded, params := testProbe(t)
	c, err := p.Open(ModuleOptions{NbdsMax: 16, MaxPart: 4})
	if err != nil || !*loaded || c.Name() != "netlink" {
		t.Fatalf("%v %v loaded=%v", c, err, *loaded)
	}
	if *params != "nbds_max=16 max_part=4" {
		t.Fatalf("module params %q", *params)
	}
}

func TestOpenNoNBD(t *testing.T) {
	p, _, _ := testProbe(t)
	p.Load = func(string) error { return errors.New("module nbd not found (CONFIG_BLK_DEV_NBD is off)") }
	_, err := p.Open(ModuleOptions{})
	if err == nil || !strings.Contains(err.Error(), "this kernel (6.9.9-test) has no NBD driver") ||
		strings.Contains(err.Error(), "\n") {
		t.Fatalf("got %v", err)
	}
	// Loaded module without family or node: no second load.
	os.Mkdir(p.SysMod, 0o755)
	p.Load = func(string) error { t.Fatal("loaded twice"); return nil }
	if _, err := p.Open(ModuleOptions{}); err == nil || !strings.Contains(err.Error(), "neither a netlink family") {
		t.Fatalf("got %v", err)
	}
}

// TestOpenRealKernel runs against the machine's own kernel: it must either
// find NBD or say in one line that there is none — never hang or panic.
func TestOpenRealKernel(t *testing.T) {
	c, err := Open(ModuleOptions{})
	if err != nil {
		if strings.Contains(err.Error(), "\n") || !strings.Contains(err.Error(), "NBD") && !strings.Contains(err.Error(), "nbd") {
			t.Fatalf("unclear error: %q", err)
		}
		t.Logf("no NBD here: %v", err)
		return
	}
	defer c.Close()
	t.Logf("NBD via %s", c.Name())
}
