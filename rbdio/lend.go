package rbdio

/*
#include "lend.h"
*/
import "C"

import (
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// Large reads are lent, not copied (see lend.cc): librbd leaves the data
// in the buffers it received them into, and the NBD server sends those
// and hands them back when done. Below lendMin a copy is cheaper than the
// bufferlist and the extra C call to free it.
const (
	lendMin     = 64 << 10
	maxLendSegs = 16 // more segments than this: copy instead
)

// openView makes the C++ view of the image that lent reads go through;
// without one (a librbd whose Image is not what lend.cc expects), reads
// are copied as before.
func (i *cImage) openView() {
	i.view = C.nbdgo_cxx_image(i.p)
}

func (i *cImage) closeView() {
	if i.view != nil {
		C.nbdgo_cxx_image_free(i.view)
		i.view = nil
	}
}

func freeBL(bl *C.struct_nbdgo_bl) { C.nbdgo_bl_free(bl) }

// blLoan lends a bufferlist's segments to the NBD server. Loans are
// pooled per image: in steady state a lent read allocates nothing in Go.
type blLoan struct {
	bl   *C.struct_nbdgo_bl
	iov  [maxLendSegs]C.struct_iovec
	segs [][]byte
	pool *loanPool
}

// loanPool recycles loans and counts them: what was lent, and what is
// still out (must be none once the server has let go).
type loanPool struct {
	sync.Pool
	lent, out atomic.Int64
}

var _ nbd.Loan = (*blLoan)(nil)

func (l *blLoan) Segments() [][]byte { return l.segs }

func (l *blLoan) Release() {
	C.nbdgo_bl_free(l.bl)
	l.bl = nil
	clear(l.segs)
	l.segs = l.segs[:0]
	l.pool.out.Add(-1)
	l.pool.Put(l)
}

func newLoanPool() *loanPool {
	p := &loanPool{}
	p.New = func() any { return &blLoan{segs: make([][]byte, 0, maxLendSegs), pool: p} }
	return p
}

// lendOrCopy gives r the data of bl, a finished read of r.Length bytes:
// lent when it can be, else copied into r.Data (zero-filled past a short
// bufferlist: reads over holes may stop short) and freed.
func lendOrCopy(r *nbd.Request, bl *C.struct_nbdgo_bl, pool *loanPool) {
	l := pool.Get().(*blLoan)
	var total C.uint64_t
	n := int(C.nbdgo_bl_segments(bl, &l.iov[0], maxLendSegs, &total))
	if n < 0 || uint64(total) != uint64(r.Length) {
		pool.Put(l)
		if len(r.Data) > 0 {
			C.nbdgo_bl_copy(bl, (*C.char)(unsafe.Pointer(&r.Data[0])), C.uint64_t(len(r.Data)))
		}
		C.nbdgo_bl_free(bl)
		return
	}
	l.bl = bl
	for k := range n {
		l.segs = append(l.segs, unsafe.Slice((*byte)(l.iov[k].iov_base), int(l.iov[k].iov_len)))
	}
	pool.lent.Add(1)
	pool.out.Add(1)
	r.Lend(l)
}
