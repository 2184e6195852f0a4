package attach

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// ioctl numbers of FIFREEZE and FITHAW (_IOWR('X', 119/120, int)).
const (
	fiFreeze = 0xc0045877
	fiThaw   = 0xc0045878
)

// RunQuiesceHook runs rec's hook as "HOOK DEVICE quiesce|unquiesce" (the
// interface of Ceph's rbd-nbd-quiesce-hook), or, without a hook, freezes
// and thaws the filesystem mounted on the device, so the snapshot librbd
// is about to take is consistent. It returns what it acted on (the hook,
// a mount point, or "" when nothing is mounted), for the log.
func RunQuiesceHook(rec control.Record, quiesce bool) (string, error) {
	verb := "unquiesce"
	if quiesce {
		verb = "quiesce"
	}
	if rec.QuiesceHook != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cmd := exec.CommandContext(ctx, rec.QuiesceHook, rec.Device(), verb)
		// A hook may leave a helper running that keeps its stdout open;
		// librbd's snapshot waits on us, so stop reading soon after the
		// hook itself exits and judge it by its exit status alone.
		cmd.WaitDelay = 2 * time.Second
		out, err := cmd.CombinedOutput()
		if errors.Is(err, exec.ErrWaitDelay) {
			err = nil
		}
		if err != nil {
			err = fmt.Errorf("quiesce hook %s %s: %v: %s", rec.QuiesceHook, verb, err, strings.TrimSpace(string(out)))
		}
		return rec.QuiesceHook, err
	}
	mnt, err := mountPoint(rec.Index)
	if err != nil || mnt == "" {
		return "", err // nothing mounted: nothing to freeze
	}
	f, err := os.Open(mnt)
	if err != nil {
		return mnt, err
	}
	defer f.Close()
	req := uintptr(fiThaw)
	if quiesce {
		req = fiFreeze
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), req, 0); e != 0 && !(e == unix.EINVAL && !quiesce) {
		return mnt, fmt.Errorf("%s %s: %w", verb, mnt, e)
	}
	return mnt, nil
}

// mountPoint finds where /dev/nbdN is mounted, by major:minor (the
// source path in mountinfo can be anything).
func mountPoint(index int) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/dev/nbd%d", index), &st); err != nil {
		return "", err
	}
	major, minor := int(unix.Major(st.Rdev)), int(unix.Minor(st.Rdev))
	mounts, err := mountinfo.GetMounts(func(i *mountinfo.Info) (skip, stop bool) {
		found := i.Major == major && i.Minor == minor
		return !found, found
	})
	if err != nil || len(mounts) == 0 {
		return "", err
	}
	return mounts[0].Mountpoint, nil
}
