package attach

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// ioctl numbers of FIFREEZE and FITHAW (_IOWR('X', 119/120, int)).
const (
	fiFreeze = 0xc0045877
	fiThaw   = 0xc0045878
)

// RunQuiesceHook runs rec's hook as "HOOK DEVICE quiesce|unquiesce" (the
// interface of Ceph's rbd-nbd-quiesce-hook), or, without a hook, freezes
// and thaws the filesystem mounted on the device, so the snapshot librbd
// is about to take is consistent.
func RunQuiesceHook(rec Record, quiesce bool) error {
	verb := "unquiesce"
	if quiesce {
		verb = "quiesce"
	}
	if rec.QuiesceHook != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, rec.QuiesceHook, rec.Device(), verb).CombinedOutput()
		if err != nil {
			return fmt.Errorf("quiesce hook %s %s: %v: %s", rec.QuiesceHook, verb, err, strings.TrimSpace(string(out)))
		}
		return nil
	}
	mnt, err := mountPoint(rec.Index)
	if err != nil || mnt == "" {
		return err // nothing mounted: nothing to freeze
	}
	f, err := os.Open(mnt)
	if err != nil {
		return err
	}
	defer f.Close()
	req := uintptr(fiThaw)
	if quiesce {
		req = fiFreeze
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), req, 0); e != 0 && !(e == unix.EINVAL && !quiesce) {
		return fmt.Errorf("%s %s: %w", verb, mnt, e)
	}
	return nil
}

// mountPoint finds where /dev/nbdN is mounted, from mountinfo's
// major:minor (device paths there can be anything).
func mountPoint(index int) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(fmt.Sprintf("/dev/nbd%d", index), &st); err != nil {
		return "", err
	}
	want := fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && fields[2] == want {
			return unescapeOctal(fields[4]), nil
		}
	}
	return "", sc.Err()
}

// unescapeOctal undoes mountinfo's \040-style escapes.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
