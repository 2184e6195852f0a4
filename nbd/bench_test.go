package nbd

import (
	"io"
	"testing"
)

// benchPipelined drives one connection at queue depth `depth` with
// fixed-size reads or writes. The client side is preallocated too, so
// -benchmem's allocs/op is the server's: the claim is 0 in steady state.
func benchPipelined(b *testing.B, cmd uint16, size, depth int) { benchWith(b, cmd, size, depth, nil) }

// benchWith is benchPipelined with an export's Stats (nil: off).
func benchWith(b *testing.B, cmd uint16, size, depth int, st *Stats) {
	s := NewServer(Config{})
	s.AddExport(Export{Backend: Inline(newFlat(64 << 20)), Stats: st})
	c := connect(b, s)
	c.open("", false)
	var reqs []byte
	replyLen := simpleReplySize
	if cmd == cmdRead {
		replyLen += size
	}
	var payload []byte
	if cmd == cmdWrite {
		payload = make([]byte, size)
	}
	for i := range depth {
		reqs = append(reqs, reqBytes(cmd, 0, uint64(i), uint64(i*size), uint32(size), payload)...)
	}
	replies := make([]byte, depth*replyLen)
	round := func() {
		if _, err := c.c.Write(reqs); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c.c, replies); err != nil {
			b.Fatal(err)
		}
	}
	for range 50 { // warm the pools
		round()
	}
	b.SetBytes(int64(size))
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i += depth {
		round()
	}
	b.StopTimer()
	if be.Uint32(replies) != magicSimpleReply || be.Uint32(replies[4:]) != 0 {
		b.Fatalf("bad reply % x", replies[:16])
	}
}

func BenchmarkRead4K(b *testing.B)       { benchPipelined(b, cmdRead, 4096, 32) }
func BenchmarkWrite4K(b *testing.B)      { benchPipelined(b, cmdWrite, 4096, 32) }
func BenchmarkRead4KQD1(b *testing.B)    { benchPipelined(b, cmdRead, 4096, 1) }
func BenchmarkRead1M(b *testing.B)       { benchPipelined(b, cmdRead, 1<<20, 8) }
func BenchmarkWrite1M(b *testing.B)      { benchPipelined(b, cmdWrite, 1<<20, 8) }
func BenchmarkWrite4KQD128(b *testing.B) { benchPipelined(b, cmdWrite, 4096, 128) }

// With Stats on: still 0 allocs/op, and the ns/op beside BenchmarkRead4K
// and BenchmarkWrite4K is what counting costs.
func BenchmarkRead4KStats(b *testing.B)  { benchWith(b, cmdRead, 4096, 32, NewStats()) }
func BenchmarkWrite4KStats(b *testing.B) { benchWith(b, cmdWrite, 4096, 32, NewStats()) }
