package mem

import (
	"bytes"
	"slices"
	"sync"
	"testing"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

func TestSparseTerabyte(t *testing.T) {
	d := New(1<<40, false)
	if d.Allocated() != 0 {
		t.Fatalf("fresh 1 TiB device holds %d bytes", d.Allocated())
	}
	off := int64(512<<30 + 100)
	p := bytes.Repeat([]byte{0xab}, 4096)
	d.WriteAt(p, off)
	if d.Allocated() != chunkSize {
		t.Fatalf("one 4 KiB write allocated %d bytes", d.Allocated())
	}
	got := make([]byte, 8192)
	d.ReadAt(got, off-4096)
	if !bytes.Equal(got[:4096], make([]byte, 4096)) || !bytes.Equal(got[4096:], p) {
		t.Fatal("read back mismatch")
	}
	// The last byte of the device is addressable.
	d.WriteAt([]byte{1}, 1<<40-1)
	d.ReadAt(got[:1], 1<<40-1)
	if got[0] != 1 {
		t.Fatal("last byte")
	}
}

func TestTrimZeroBlockStatus(t *testing.T) {
	d := New(1<<20, false)
	d.WriteAt(bytes.Repeat([]byte{7}, 4*chunkSize), 0)
	d.Trim(0, chunkSize+100) // chunk 0 freed, 100 bytes of chunk 1 zeroed
	d.Zero(2*chunkSize, chunkSize, true, false)
	if d.Allocated() != 3*chunkSize {
		t.Fatalf("allocated %d, want 3 chunks (NO_HOLE keeps chunk 2)", d.Allocated())
	}
	got := make([]byte, 4*chunkSize)
	d.ReadAt(got, 0)
	want := bytes.Repeat([]byte{7}, 4*chunkSize)
	clear(want[:chunkSize+100])
	clear(want[2*chunkSize : 3*chunkSize])
	if !bytes.Equal(got, want) {
		t.Fatal("contents after trim/zero")
	}
	ext, _ := d.BlockStatus(0, 1<<20, nil)
	hz := uint32(nbd.StateHole | nbd.StateZero)
	wantExt := []nbd.Extent{{Length: chunkSize, Flags: hz}, {Length: 3 * chunkSize}, {Length: 12 * chunkSize, Flags: hz}}
	if !slices.Equal(ext, wantExt) {
		t.Fatalf("extents %+v, want %+v", ext, wantExt)
	}
}

func TestReadOnly(t *testing.T) {
	d := New(1<<20, true)
	if _, err := d.WriteAt([]byte{1}, 0); err != nbd.ErrPerm {
		t.Fatalf("write: %v", err)
	}
	if err := d.Trim(0, 4096); err != nbd.ErrPerm {
		t.Fatalf("trim: %v", err)
	}
}

func TestConcurrentWriters(t *testing.T) {
	d := New(64<<20, false)
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := bytes.Repeat([]byte{byte(w + 1)}, 4096)
			got := make([]byte, 4096)
			for i := range 200 {
				off := int64((i*8 + w) * 4096)
				d.WriteAt(p, off)
				d.ReadAt(got, off)
				if !bytes.Equal(got, p) {
					t.Errorf("writer %d block %d", w, i)
					return
				}
			}
		}()
	}
	wg.Wait()
}
