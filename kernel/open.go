package kernel

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/pmorjan/kmod"
	"golang.org/x/sys/unix"
)

// ModuleOptions are nbd.ko parameters, used only when this call loads it.
type ModuleOptions struct {
	NbdsMax int // devices made at load time; 0 leaves the module's default
	MaxPart int // partitions per device
}

func (o ModuleOptions) params() string {
	var p []string
	if o.NbdsMax > 0 {
		p = append(p, fmt.Sprintf("nbds_max=%d", o.NbdsMax))
	}
	if o.MaxPart > 0 {
		p = append(p, fmt.Sprintf("max_part=%d", o.MaxPart))
	}
	return strings.Join(p, " ")
}

// Probe is where Open looks; tests point it at fakes.
type Probe struct {
	Dial    func() (Controller, error) // the netlink controller
	Ioctl   func() Controller
	DevNbd0 string                    // "/dev/nbd0"
	SysMod  string                    // "/sys/module/nbd"
	Load    func(params string) error // load the nbd module
	Wait    time.Duration             // for the family to appear after a load
	Release func() string             // kernel release, for messages
}

// DefaultProbe looks at the running kernel.
func DefaultProbe() Probe {
	return Probe{
		Dial:    func() (Controller, error) { return DialNetlink() },
		Ioctl:   func() Controller { return NewIoctl() },
		DevNbd0: "/dev/nbd0",
		SysMod:  "/sys/module/nbd",
		Load:    loadModule,
		Wait:    2 * time.Second,
		Release: release,
	}
}

// Open returns a Controller for the running kernel: netlink when the nbd
// family exists, ioctl when only /dev/nbd0 does, after loading the module
// when neither does. Without any NBD support it says so in one line.
func Open(o ModuleOptions) (Controller, error) { return DefaultProbe().Open(o) }

// Open is the package-level Open over p.
func (p Probe) Open(o ModuleOptions) (Controller, error) {
	c, err := p.find()
	if c != nil || !errors.Is(err, ErrNoFamily) {
		return c, err
	}
	if _, serr := os.Stat(p.SysMod); serr == nil {
		// Loaded (or built in) but no family and no device node:
		// nothing more a module load could add.
		return nil, fmt.Errorf("the nbd driver is loaded but has neither a netlink family nor %s", p.DevNbd0)
	}
	if lerr := p.Load(o.params()); lerr != nil {
		return nil, fmt.Errorf("this kernel (%s) has no NBD driver: %v", p.Release(), lerr)
	}
	deadline := time.Now().Add(p.Wait)
	for {
		c, err = p.find()
		if c != nil || !errors.Is(err, ErrNoFamily) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if errors.Is(err, ErrNoFamily) {
		return nil, fmt.Errorf("loaded the nbd module but found no nbd netlink family or %s", p.DevNbd0)
	}
	return c, err
}

func (p Probe) find() (Controller, error) {
	c, err := p.Dial()
	if err == nil {
		return c, nil
	}
	if !errors.Is(err, ErrNoFamily) {
		return nil, err
	}
	if _, serr := os.Stat(p.DevNbd0); serr == nil {
		return p.Ioctl(), nil
	}
	return nil, ErrNoFamily
}

// loadModule loads nbd.ko through the modules.dep of the running kernel,
// as modprobe would, without needing modprobe in the image.
func loadModule(params string) error {
	rel := release()
	if _, err := os.Stat(filepath.Join("/lib/modules", rel)); err != nil {
		return fmt.Errorf("no modules for this kernel in /lib/modules/%s and nbd is not built in (CONFIG_BLK_DEV_NBD)", rel)
	}
	k, err := kmod.New()
	if err != nil {
		return fmt.Errorf("cannot read /lib/modules/%s/modules.dep: %w", rel, err)
	}
	if err := k.Load("nbd", params, 0); err != nil {
		if errors.Is(err, kmod.ErrModuleNotFound) {
			return errors.New("module nbd not found (CONFIG_BLK_DEV_NBD is off)")
		}
		return fmt.Errorf("load nbd module: %w", err)
	}
	return nil
}

func release() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return "unknown"
	}
	return unix.ByteSliceToString(u.Release[:])
}
