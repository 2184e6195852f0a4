package attach

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/rbd-nbd-go/rbd-nbd-go/nbd"
)

// The CLI talks to the node's serving process over a unix socket in the
// state directory (mode 0600, so root only): one JSON request, one JSON
// response per connection.

// Request ops.
const (
	OpMap    = "map"
	OpAttach = "attach"
	OpUnmap  = "unmap"
	OpDetach = "detach"
	OpList   = "list"
	OpPing   = "ping"
)

type Request struct {
	Op     string  `json:"op"`
	Record *Record `json:"record,omitempty"`
	Target string  `json:"target,omitempty"` // device path or spec
}

// Response codes besides success.
const (
	CodeNotMapped = "not_mapped"
	CodeBusy      = "busy"
	CodeError     = "error"
)

type Response struct {
	Code   string   `json:"code,omitempty"`
	Error  string   `json:"error,omitempty"`
	PID    int      `json:"pid"`
	Record *Record  `json:"record,omitempty"`
	List   []Record `json:"list,omitempty"`
}

// SocketPath is the control socket in a state directory.
func SocketPath(stateDir string) string { return filepath.Join(stateDir, "control.sock") }

// public strips secrets before a record leaves the process.
func public(r Record) Record {
	r.Ceph.Key = ""
	r.Encryption.Passphrase = ""
	return r
}

// ServeControl answers requests on l until ctx ends.
func ServeControl(ctx context.Context, l net.Listener, m *Manager, log *slog.Logger) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go func() {
			defer c.Close()
			var req Request
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if err := json.NewDecoder(bufio.NewReader(c)).Decode(&req); err != nil {
				log.Warn("bad control request", "err", err)
				return
			}
			c.SetReadDeadline(time.Time{})
			resp := m.handle(req)
			resp.PID = os.Getpid()
			json.NewEncoder(c).Encode(resp)
		}()
	}
}

func (m *Manager) handle(req Request) Response {
	fail := func(err error) Response {
		r := Response{Code: CodeError, Error: err.Error()}
		switch {
		case errors.Is(err, ErrNotMapped):
			r.Code = CodeNotMapped
		case errors.Is(err, ErrBusy):
			r.Code = CodeBusy
		}
		return r
	}
	one := func(rec Record, err error) Response {
		if err != nil {
			return fail(err)
		}
		p := public(rec)
		return Response{Record: &p}
	}
	switch req.Op {
	case OpPing:
		return Response{}
	case OpList:
		var out []Record
		for _, r := range m.List() {
			out = append(out, public(r))
		}
		return Response{List: out}
	case OpMap, OpAttach:
		if req.Record == nil {
			return fail(errors.New("request has no device record"))
		}
		if req.Op == OpMap {
			return one(m.Map(*req.Record))
		}
		return one(m.Attach(*req.Record))
	case OpUnmap:
		return one(Record{}, m.Unmap(req.Target))
	case OpDetach:
		return one(Record{}, m.Detach(req.Target))
	}
	return fail(fmt.Errorf("unknown request %q", req.Op))
}

// ListenControl creates the control socket, 0600.
func ListenControl(stateDir string) (net.Listener, error) {
	return nbd.ListenUnix(SocketPath(stateDir))
}

// Call sends one request to the serving process of stateDir.
func Call(ctx context.Context, stateDir string, req Request) (Response, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", SocketPath(stateDir))
	if err != nil {
		return Response{}, err
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if err := json.NewEncoder(c).Encode(req); err != nil {
		return Response{}, err
	}
	var resp Response
	if err := json.NewDecoder(c).Decode(&resp); err != nil {
		return Response{}, fmt.Errorf("control socket: %w", err)
	}
	return resp, nil
}

// Err turns a failed response into an error that errors.Is recognises.
func (r Response) Err() error {
	switch r.Code {
	case "":
		return nil
	case CodeNotMapped:
		return ErrNotMapped
	case CodeBusy:
		return codeError{r.Error, ErrBusy}
	}
	return errors.New(r.Error)
}

// codeError keeps the daemon's message and matches its sentinel.
type codeError struct {
	msg    string
	target error
}

func (e codeError) Error() string        { return e.msg }
func (e codeError) Is(target error) bool { return target == e.target }
