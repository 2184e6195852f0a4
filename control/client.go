package control

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"
)

// ErrNoDaemon: nothing serves this node and no device is recorded.
var ErrNoDaemon = errors.New("no rbd-nbd-go daemon is running")

// Client talks to the node daemon of one state directory.
type Client struct {
	StateDir string
	// Start says how to start the daemon when a call finds none.
	Start StartOptions
}

// Map makes a new device for rec and returns its record (without
// secrets). It starts the daemon if none is running.
func (c *Client) Map(ctx context.Context, rec Record) (Record, error) {
	return c.device(ctx, OpMap, rec)
}

// Attach serves an existing /dev/nbdN again (rec.Index names it).
func (c *Client) Attach(ctx context.Context, rec Record) (Record, error) {
	if rec.Index < 0 {
		return Record{}, errors.New("attach needs a device")
	}
	return c.device(ctx, OpAttach, rec)
}

func (c *Client) device(ctx context.Context, op string, rec Record) (Record, error) {
	// The client side's one check, so a bad request fails before a
	// daemon is started for it; callers (the CLI, the CSI node) build
	// records without checking them.
	if err := rec.Validate(); err != nil {
		return Record{}, err
	}
	resp, err := c.Call(ctx, Request{Op: op, Record: &rec}, true)
	if err == nil {
		err = resp.Err()
	}
	if err != nil {
		return Record{}, err
	}
	if resp.Record == nil {
		return Record{}, errors.New("the daemon answered without a device record")
	}
	return *resp.Record, nil
}

// Unmap flushes and removes a device, by path (/dev/nbdN) or spec.
// ErrNotMapped when nothing serves it.
func (c *Client) Unmap(ctx context.Context, target string) error {
	return c.target(ctx, Request{Op: OpUnmap, Target: target})
}

// UnmapCookie unmaps target only if the device still carries cookie:
// ErrNotMapped if it does not (another volume took its index).
func (c *Client) UnmapCookie(ctx context.Context, target, cookie string) error {
	return c.target(ctx, Request{Op: OpUnmap, Target: target, Cookie: cookie})
}

// Detach stops serving a device but leaves it in the kernel.
func (c *Client) Detach(ctx context.Context, target string) error {
	return c.target(ctx, Request{Op: OpDetach, Target: target})
}

func (c *Client) target(ctx context.Context, req Request) error {
	resp, err := c.Call(ctx, req, false)
	if errors.Is(err, ErrNoDaemon) {
		return ErrNotMapped
	}
	if err != nil {
		return err
	}
	return resp.Err()
}

// Listing is every device the daemon has, and the daemon's pid.
type Listing struct {
	PID     int
	Devices []Record
}

// List returns the devices; with no daemon and nothing recorded, none.
func (c *Client) List(ctx context.Context) (Listing, error) {
	resp, err := c.Call(ctx, Request{Op: OpList}, false)
	if errors.Is(err, ErrNoDaemon) {
		return Listing{}, nil
	}
	if err == nil {
		err = resp.Err()
	}
	return Listing{PID: resp.PID, Devices: resp.List}, err
}

// Stats reads every device's counters; none without a daemon.
func (c *Client) Stats(ctx context.Context) ([]DeviceStats, error) {
	resp, err := c.Call(ctx, Request{Op: OpStats}, false)
	if errors.Is(err, ErrNoDaemon) {
		return nil, nil
	}
	if err == nil {
		err = resp.Err()
	}
	return resp.Stats, err
}

// Status reports how a device (path or spec) is doing, with its
// allocated bytes if usage is set; ErrNotMapped if the daemon does not
// have it.
func (c *Client) Status(ctx context.Context, target string, usage bool) (Status, error) {
	resp, err := c.Call(ctx, Request{Op: OpStatus, Target: target, Usage: usage}, false)
	if errors.Is(err, ErrNoDaemon) {
		return Status{}, ErrNotMapped
	}
	if err == nil {
		err = resp.Err()
	}
	if err == nil && resp.Status == nil {
		err = errors.New("the daemon answered without a status")
	}
	if err != nil {
		return Status{}, err
	}
	return *resp.Status, nil
}

// Ping reports whether a daemon answers, without starting one.
func (c *Client) Ping(ctx context.Context) error {
	_, err := c.Instance(ctx)
	return err
}

// Instance is the answering daemon's instance word.
func (c *Client) Instance(ctx context.Context) (string, error) {
	resp, err := c.call(ctx, Request{Op: OpPing})
	return resp.Instance, err
}

// WaitTakenOver waits, until ctx ends, for the daemon instance to stop
// answering: taken over by a newer daemon, or gone. A node plugin being
// stopped calls it: its daemon dies with its pod, and in an upgrade the
// new pod's daemon may not have taken the devices over yet. Only a
// socket nobody listens on counts as gone: a call that fails otherwise
// (a busy daemon, a slow node) must not end the wait early and take the
// devices' server down while a new daemon is coming.
func (c *Client) WaitTakenOver(ctx context.Context, instance string) error {
	for {
		cur, err := c.Instance(ctx)
		if err == nil && cur != instance || err != nil && absent(err) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Call sends req to the daemon. When none answers it starts one if
// start is set or devices are recorded (a restarted node's devices
// need their server back); otherwise it returns ErrNoDaemon.
func (c *Client) Call(ctx context.Context, req Request, start bool) (Response, error) {
	resp, err := c.call(ctx, req)
	if err == nil || !absent(err) {
		return resp, err
	}
	if !start && !hasRecords(c.StateDir) {
		return resp, ErrNoDaemon
	}
	if _, err := c.start(ctx, false); err != nil {
		return resp, err
	}
	return c.call(ctx, req)
}

func absent(err error) bool {
	return errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED)
}

// handoverWait bounds how long a request is retried while the daemon
// hands its devices over: the new daemon answers on the same socket
// within a second or two, or the handover is given up well before this.
const handoverWait = 30 * time.Second

// call sends one request, bounded by ctx, and sends it again while the
// daemon answers that it is handing over, so that an upgrade of the
// daemon is not seen by callers.
func (c *Client) call(ctx context.Context, req Request) (Response, error) {
	deadline := time.Now().Add(handoverWait)
	for {
		resp, err := c.callOnce(ctx, req)
		if err != nil || resp.Code != CodeHandingOver || time.Now().After(deadline) {
			return resp, err
		}
		select {
		case <-ctx.Done():
			return resp, nil
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// callOnce sends one request, bounded by ctx.
func (c *Client) callOnce(ctx context.Context, req Request) (Response, error) {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", SocketPath(c.StateDir))
	if err != nil {
		return Response{}, err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	if err := json.NewEncoder(conn).Encode(req); err != nil {
		return Response{}, ctxErr(ctx, err)
	}
	var resp Response
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		return Response{}, fmt.Errorf("control socket: %w", ctxErr(ctx, err))
	}
	return resp, nil
}

// ctxErr prefers the context's reason over the closed socket it caused.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}
