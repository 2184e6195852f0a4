package filedev

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

func tempDev(t *testing.T, size int64) (*Device, string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "disk")
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(p, size); err != nil {
		t.Fatal(err)
	}
	d, err := Open(p, false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d, p
}

func TestReadWriteFUAFlush(t *testing.T) {
	d, p := tempDev(t, 1<<20)
	if d.Size() != 1<<20 {
		t.Fatalf("size %d", d.Size())
	}
	data := bytes.Repeat([]byte("nbd!"), 1024)
	if err := d.WriteAtFUA(data, 8192); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := d.Flush(); err != nil {
		t.Fatal(err)
	}
	disk, _ := os.ReadFile(p)
	if !bytes.Equal(disk[8192:12288], data) || !bytes.Equal(disk[:4096], data) {
		t.Fatal("file contents")
	}
	// A file that shrank under us gives an I/O error, not a short read.
	os.Truncate(p, 4096)
	if _, err := d.ReadAt(make([]byte, 4096), 1<<19); nbd.ErrnoOf(err) != nbd.ErrIO {
		t.Fatalf("read past EOF: %v", err)
	}
}

func TestTrimZeroAndBlockStatus(t *testing.T) {
	d, _ := tempDev(t, 4<<20)
	ext, err := d.BlockStatus(0, 4<<20, nil)
	if err != nil || len(ext) != 1 || ext[0].Flags != nbd.StateHole|nbd.StateZero {
		t.Fatalf("fresh sparse file: %+v %v", ext, err)
	}
	d.WriteAt(bytes.Repeat([]byte{9}, 2<<20), 0)
	d.Flush()
	if err := d.Trim(1<<20, 1<<20); err != nil {
		t.Fatal(err)
	}
	if err := d.Zero(0, 65536, true, true); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 2<<20)
	d.ReadAt(got, 0)
	want := bytes.Repeat([]byte{9}, 2<<20)
	clear(want[:65536])
	clear(want[1<<20:])
	if !bytes.Equal(got, want) {
		t.Fatal("contents after trim and zero")
	}
	ext, _ = d.BlockStatus(0, 4<<20, nil)
	// Data up to 1 MiB (ZERO_RANGE with NO_HOLE keeps it allocated),
	// then a hole where the trim punched one and beyond.
	if len(ext) != 2 || ext[0].Flags != 0 || ext[0].Length != 1<<20 || ext[1].Flags != nbd.StateHole|nbd.StateZero {
		t.Fatalf("extents after trim: %+v", ext)
	}
}

func TestOpenErrors(t *testing.T) {
	if _, err := Open(t.TempDir(), false); err == nil {
		t.Fatal("opened a directory")
	}
	if _, err := Open("/nonexistent/disk", false); !os.IsNotExist(err) {
		t.Fatalf("missing file: %v", err)
	}
	_, p := tempDev(t, 4096)
	d, err := Open(p, true)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if _, err := d.WriteAt([]byte{1}, 0); err == nil {
		t.Fatal("write to read-only open succeeded")
	}
	if err := d.Trim(0, 4096); err != nbd.ErrPerm {
		t.Fatalf("trim read-only: %v", err)
	}
}
