// Package pidlimit sets the PID limit (pids.max) of the process's own
// cgroup, as ceph-csi's --pidlimit does: a container runtime's default
// limit (often 1024 or 4096) is too low for a plugin whose librbd
// connections each start dozens of threads, and a thread that cannot
// start aborts the process.
package pidlimit

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// Cgroup says where to find the process's cgroup; the zero value is the
// running process's own.
type Cgroup struct {
	// Root is where cgroupfs is mounted (default /sys/fs/cgroup).
	Root string
	// Self is the process's cgroup membership (default
	// /proc/self/cgroup).
	Self string
}

// Set writes limit to the pids.max of the cgroup: -1 is unlimited
// ("max"), 0 leaves it alone, anything else is that many tasks. It
// returns the file it wrote, or "" when there was nothing to do: limit
// 0, or a process in the root pids cgroup, which has no limit.
func (c Cgroup) Set(limit int) (string, error) {
	if limit == 0 {
		return "", nil
	}
	if limit < -1 {
		return "", fmt.Errorf("pid limit %d: want -1 (unlimited), 0 (leave it) or a positive count", limit)
	}
	root, self := c.Root, c.Self
	if root == "" {
		root = "/sys/fs/cgroup"
	}
	if self == "" {
		self = "/proc/self/cgroup"
	}
	dir, err := pidsDir(root, self)
	if errors.Is(err, errNoPids) && limit == -1 {
		return "", nil // no pids cgroup, no limit: unlimited already
	}
	if err != nil || dir == "" {
		return "", err
	}
	path := filepath.Join(dir, "pids.max")
	value := "max"
	if limit > 0 {
		value = strconv.Itoa(limit)
	}
	if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
		return path, fmt.Errorf("set the pid limit: %w", err)
	}
	return path, nil
}

// pidsDir is the directory of the process's pids cgroup: the v1 pids
// hierarchy if it is mounted, else the unified (v2) one; "" for the
// root cgroup.
func pidsDir(root, self string) (string, error) {
	b, err := os.ReadFile(self)
	if err != nil {
		return "", fmt.Errorf("own cgroup: %w", err)
	}
	var v1, v2 string
	found1, found2 := false, false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		// hierarchy-ID:controller-list:path
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		switch {
		case parts[0] == "0" && parts[1] == "":
			v2, found2 = parts[2], true
		case containsField(parts[1], "pids"):
			v1, found1 = parts[2], true
		}
	}
	switch {
	case found1:
		if v1 == "/" {
			return "", nil
		}
		return filepath.Join(root, "pids", v1), nil
	case found2:
		if v2 == "/" {
			return "", nil
		}
		return filepath.Join(root, v2), nil
	}
	return "", fmt.Errorf("%w in %s", errNoPids, self)
}

// errNoPids: the process is in no pids cgroup (none is mounted).
var errNoPids = errors.New("own cgroup: no pids controller")

func containsField(list, name string) bool {
	for _, f := range strings.Split(list, ",") {
		if f == name {
			return true
		}
	}
	return false
}
