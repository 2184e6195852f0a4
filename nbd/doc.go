// Package nbd is the server side of the Network Block Device protocol
// (NetworkBlockDevice/nbd doc/proto.md), in pure Go.
//
// A Server offers named Exports, each backed by one Backend shared by all
// of its connections. Connections come from listeners (unixsock.Listen,
// ListenTCP, socket activation) through Serve/ServeConn, which run the
// fixed-newstyle handshake, or from the kernel through ServeNegotiated,
// where the handshake happened out of band.
//
// The transmission phase is built around asynchronous backends: the
// connection's reader validates a request and hands it to Backend.Submit;
// the backend calls Request.Complete from whatever goroutine finishes it;
// replies are sent as soon as they are ready, in any order, several per
// sendmsg. A backend whose completions arrive on threads of its own may
// instead send a success reply from there and finish the request later
// (Request.DirectReply, Reaper). Synchronous devices (io.ReaderAt/io.WriterAt plus optional
// Flusher, Trimmer, Zeroer, ...) are adapted by Inline, NewPool and
// NewHybrid, and only what they implement is advertised.
//
// A rolling upgrade of the daemon moves live connections to a new server
// without the kernel noticing: Server.Pause stops every connection at a
// request boundary and drains it, then Paused.Release hands the sockets
// over (and Paused.Resume calls the handover off).
//
// Data safety: a FLUSH is answered only after the backend's flush
// returns, a FUA write only after the backend wrote it durably, and a
// backend error always reaches the client as an NBD error (ErrnoOf). A
// failed READ never sends data, so the error is never masked by a reply
// header sent too early.
//
// BUG(nbd): TLS (STARTTLS) is not implemented; the option is refused with
// NBD_REP_ERR_POLICY. Expose TCP listeners only on trusted networks.
//
// BUG(nbd): Extended headers (64-bit lengths) are not implemented; the
// option is refused with NBD_REP_ERR_UNSUP and clients fall back.
//
// BUG(nbd): READ replies are always one data chunk: holes are sent as
// zeroes rather than as NBD_REPLY_TYPE_OFFSET_HOLE.
package nbd
