package pidlimit

import (
	"os"
	"path/filepath"
	"testing"
)

func TestSet(t *testing.T) {
	for _, tc := range []struct {
		name, self, dir string
		limit           int
		want            string // pids.max afterwards; "" if nothing written
	}{
		{"v2", "0::/kubepods/pod1/ctr\n", "kubepods/pod1/ctr", -1, "max"},
		{"v1", "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n", "pids/docker/abc", 4096, "4096"},
		{"v1 shared hierarchy", "3:cpu,pids:/x\n", "pids/x", -1, "max"},
		{"root v1", "8:pids:/\n0::/\n", "", -1, ""},
		{"root v2", "0::/\n", "", -1, ""},
		{"leave it", "0::/a\n", "a", 0, "1024"},
		{"no cgroup at all", "", "", -1, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			self := filepath.Join(root, "self")
			os.WriteFile(self, []byte(tc.self), 0o600)
			file := ""
			if tc.dir != "" {
				os.MkdirAll(filepath.Join(root, tc.dir), 0o755)
				file = filepath.Join(root, tc.dir, "pids.max")
				os.WriteFile(file, []byte("1024"), 0o644)
			}
			path, err := Cgroup{Root: root, Self: self}.Set(tc.limit)
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == "" {
				if path != "" {
					t.Fatalf("wrote %s", path)
				}
				return
			}
			b, _ := os.ReadFile(file)
			if string(b) != tc.want {
				t.Fatalf("pids.max = %q, want %q", b, tc.want)
			}
		})
	}
	root := t.TempDir()
	os.WriteFile(filepath.Join(root, "self"), []byte("0::/gone\n"), 0o600)
	if _, err := (Cgroup{Root: root, Self: filepath.Join(root, "self")}).Set(-1); err == nil {
		t.Fatal("no error for a cgroup that cannot be written")
	}
	if _, err := (Cgroup{}).Set(-5); err == nil {
		t.Fatal("-5 accepted")
	}
	os.WriteFile(filepath.Join(root, "self"), nil, 0o600)
	if _, err := (Cgroup{Root: root, Self: filepath.Join(root, "self")}).Set(100); err == nil {
		t.Fatal("a limit of 100 set with no pids cgroup")
	}
}
