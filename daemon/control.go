package daemon

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/attach"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
)

// Serve answers control requests on l until ctx ends: one JSON request,
// one JSON response per connection. serving, if not nil, is called as a
// map or attach request starts and what it returns once it is over.
func Serve(ctx context.Context, l net.Listener, m *attach.Manager, log *slog.Logger, serving func() (done func())) error {
	return serve(ctx, l, m, log, serving, nil, "")
}

// serve is Serve behind a handover's gate: while one runs, and after it
// succeeded, requests other than ping are answered ErrHandingOver, which
// the client retries until the new daemon answers them.
//
// instance is told with every answer (control.Response.Instance).
func serve(ctx context.Context, l net.Listener, m *attach.Manager, log *slog.Logger, serving func() (done func()), gate *controlGate, instance string) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	var delay time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// Out of descriptors or memory for a moment: no device's
			// I/O goes through here, and stopping would drop every
			// device's sockets. Wait and accept again, as net/http does.
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			log.Warn("control socket: accept failed, trying again", "err", err, "in", delay)
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(delay):
			}
			continue
		}
		delay = 0
		go func() {
			defer c.Close()
			var req control.Request
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if err := json.NewDecoder(bufio.NewReader(c)).Decode(&req); err != nil {
				log.Warn("bad control request", "err", err)
				return
			}
			c.SetReadDeadline(time.Time{})
			if gate != nil && req.Op != control.OpPing {
				if !gate.enter() {
					json.NewEncoder(c).Encode(control.Failure(control.ErrHandingOver))
					return
				}
				defer gate.leave()
			}
			if serving != nil && (req.Op == control.OpMap || req.Op == control.OpAttach) {
				defer serving()()
			}
			resp := handle(m, req)
			resp.PID, resp.Instance = os.Getpid(), instance
			json.NewEncoder(c).Encode(resp)
		}()
	}
}

func handle(m *attach.Manager, req control.Request) control.Response {
	one := func(rec control.Record, err error) control.Response {
		if err != nil {
			return control.Failure(err)
		}
		p := rec.Public()
		return control.Response{Record: &p}
	}
	switch req.Op {
	case control.OpPing:
		return control.Response{}
	case control.OpList:
		var out []control.Record
		for _, r := range m.List() {
			out = append(out, r.Public())
		}
		return control.Response{List: out}
	case control.OpMap, control.OpAttach:
		if req.Record == nil {
			return control.Failure(errors.New("request has no device record"))
		}
		// Whoever the client is, its request is checked here too: the
		// daemon's one check of a map or attach, which the manager
		// relies on.
		if err := req.Record.Validate(); err != nil {
			return control.Failure(err)
		}
		if req.Op == control.OpMap {
			return one(m.Map(*req.Record))
		}
		return one(m.Attach(*req.Record))
	case control.OpUnmap:
		return one(control.Record{}, m.UnmapCookie(req.Target, req.Cookie))
	case control.OpDetach:
		return one(control.Record{}, m.Detach(req.Target))
	case control.OpStats:
		return control.Response{Stats: m.Stats()}
	case control.OpStatus:
		st, err := m.Status(req.Target, req.Usage)
		if err != nil {
			return control.Failure(err)
		}
		st.Record = st.Record.Public()
		return control.Response{Status: &st}
	}
	return control.Failure(fmt.Errorf("unknown request %q", req.Op))
}
