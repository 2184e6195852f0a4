package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rbd-nbd-go/rbd-nbd-go/ceph"
	"github.com/rbd-nbd-go/rbd-nbd-go/control"
	"github.com/rbd-nbd-go/rbd-nbd-go/devspec"
	"github.com/rbd-nbd-go/rbd-nbd-go/internal/progress"
)

// mapOpts are rbd-nbd's map/attach options, with its names, plus ours.
// Those that say how to map fill a control.MapOptions, the type every
// client sends; the timeouts are integer seconds on the command line,
// as rbd-nbd takes them, and become its durations in record.
type mapOpts struct {
	opts                       control.MapOptions
	device                     string
	ioTimeout, reattachTimeout int
	resendInterval             int
	cookie                     string
	showCookie                 bool
	nbdsMax, maxPart           int
	tryNetlink                 bool
	encFormat, encPassFile     string
}

func addMapFlags(f *pflag.FlagSet, o *mapOpts) {
	def := control.CLIDefaults()
	f.StringVar(&o.device, "device", "", "use this /dev/nbdN (default: let the kernel pick)")
	f.BoolVar(&o.opts.ReadOnly, "read-only", false, "map read-only")
	f.BoolVar(&o.opts.Exclusive, "exclusive", false, "take the RBD exclusive lock and keep it")
	f.BoolVar(&o.opts.NoTrim, "notrim", false, "do not pass discards (TRIM) to the image")
	f.IntVar(&o.ioTimeout, "io-timeout", int(def.IOTimeout/time.Second), "seconds before the kernel aborts a request (0: never)")
	f.IntVar(&o.ioTimeout, "timeout", int(def.IOTimeout/time.Second), "old name of --io-timeout")
	f.IntVar(&o.reattachTimeout, "reattach-timeout", int(def.ReattachTimeout/time.Second),
		"seconds I/O waits for a restarted server before failing")
	f.IntVar(&o.resendInterval, "resend-interval", 0,
		"with --io-timeout 0 and 1 connection: seconds after which the kernel resends a request whose server restarted (0: 30)")
	f.StringVar(&o.cookie, "cookie", "", "backend identifier checked on reattach (default: random UUID)")
	f.BoolVar(&o.showCookie, "show-cookie", false, "print the cookie after the device path")
	f.IntVar(&o.nbdsMax, "nbds_max", 0, "nbd module parameter, if this command loads the module")
	f.IntVar(&o.maxPart, "max_part", 0, "nbd module parameter, if this command loads the module")
	f.BoolVar(&o.tryNetlink, "try-netlink", false, "accepted for compatibility: netlink is always tried first")
	f.BoolVar(&o.opts.Quiesce, "quiesce", false, "freeze the filesystem on the device around RBD snapshots")
	f.StringVar(&o.opts.QuiesceHook, "quiesce-hook", "", "run HOOK DEVICE quiesce|unquiesce instead of fsfreeze")
	f.StringVar(&o.encFormat, "encryption-format", "", "luks, luks1 or luks2: open with librbd client-side encryption")
	f.StringVar(&o.encPassFile, "encryption-passphrase-file", "", "file holding the encryption passphrase")
	f.IntVar(&o.opts.Connections, "connections", def.Connections, "sockets (kernel queues) per device")
	f.Uint64Var(&o.opts.BlockSize, "block-size", def.BlockSize, "logical block size: 512, 1024, 2048 or 4096")
	f.IntVar(&o.opts.MaxSectorsKB, "max-sectors-kb", def.MaxSectorsKB, "largest request the kernel sends, in KiB (queue/max_sectors_kb)")
	f.MarkHidden("timeout")
}

var devRE = regexp.MustCompile(`^/dev/nbd([0-9]+)$`)

func deviceIndex(dev string) (int, error) {
	m := devRE.FindStringSubmatch(dev)
	if m == nil {
		return 0, fmt.Errorf("bad device %q: want /dev/nbdN", dev)
	}
	return strconv.Atoi(m[1])
}

// record builds the daemon's device record. It does not validate it:
// control.Client does, once, before it asks the daemon (which checks
// again on receipt).
func (o *mapOpts) record(g *globalOpts, spec string) (control.Record, error) {
	rec := control.Record{Index: control.AnyIndex, Spec: spec, Cookie: o.cookie, MapOptions: o.opts}
	rec.IOTimeout = time.Duration(o.ioTimeout) * time.Second
	rec.ReattachTimeout = time.Duration(o.reattachTimeout) * time.Second
	rec.ResendInterval = time.Duration(o.resendInterval) * time.Second
	rec.Quiesce = o.opts.Quiesce || o.opts.QuiesceHook != ""
	if o.device != "" {
		idx, err := deviceIndex(o.device)
		if err != nil {
			return rec, err
		}
		rec.Index = idx
	}
	if o.ioTimeout < 0 || o.reattachTimeout < 0 || o.resendInterval < 0 {
		// Caught here: a negative --reattach-timeout would read as
		// "unset" once it is a Duration of the record.
		return rec, errors.New("timeouts cannot be negative")
	}
	var err error
	if rec.Ceph, err = g.daemonCeph(); err != nil {
		return rec, err
	}
	if o.encFormat != "" || o.encPassFile != "" {
		if o.encPassFile == "" {
			return rec, errors.New("--encryption-format needs --encryption-passphrase-file")
		}
		b, err := os.ReadFile(o.encPassFile)
		if err != nil {
			return rec, fmt.Errorf("passphrase file: %w", unwrapPath(err))
		}
		rec.Encryption = ceph.Encryption{Format: o.encFormat, Passphrase: strings.TrimRight(string(b), "\n")}
		if rec.Encryption.Format == "" {
			rec.Encryption.Format = "luks"
		}
	}
	return rec, nil
}

func newUUID() string {
	var b [16]byte
	rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:])
}

func newMap(g *globalOpts) *cobra.Command {
	var o mapOpts
	cmd := &cobra.Command{
		Use:   "map [options] pool/[namespace/]image[@snap] | mem:SIZE | file:PATH",
		Short: "Map a device to /dev/nbdX and print its path",
		Long: `Map an RBD image (or mem:SIZE, file:PATH) to a kernel NBD device, served
by this node's rbd-nbd-go daemon (started on first use; one process serves
every device and shares one RADOS connection per cluster identity). Prints
the device path once the device is live.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			rec, err := o.record(g, args[0])
			if err != nil {
				return err
			}
			if rec.Cookie == "" {
				rec.Cookie = newUUID()
			}
			return deviceCall(g, o, control.OpMap, rec)
		},
	}
	addMapFlags(cmd.Flags(), &o)
	return cmd
}

func newAttach(g *globalOpts) *cobra.Command {
	var o mapOpts
	cmd := &cobra.Command{
		Use:   "attach --device /dev/nbdN [--cookie C] [options] SPEC",
		Short: "Serve an existing /dev/nbdN again (after detach or a restart)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.device == "" {
				return errors.New("attach needs --device /dev/nbdN")
			}
			// No random cookie here: it must match the device's.
			rec, err := o.record(g, args[0])
			if err != nil {
				return err
			}
			return deviceCall(g, o, control.OpAttach, rec)
		},
	}
	addMapFlags(cmd.Flags(), &o)
	return cmd
}

func deviceCall(g *globalOpts, o mapOpts, op string, rec control.Record) error {
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	c := g.client(o.nbdsMax, o.maxPart)
	call := c.Map
	if op == control.OpAttach {
		call = c.Attach
	}
	// A map waits for the cluster (and, the first time, the daemon's
	// start): a person sees that it is still going, a script nothing.
	stop := progress.Waiting(os.Stderr, progress.StderrIsTerminal(), op+" "+rec.Spec+": waiting for the node daemon", 2*time.Second)
	got, err := call(ctx, rec)
	stop()
	if err != nil {
		g.logOutcome(op, rec.Spec, err)
		return err
	}
	out := got.Device()
	if o.showCookie {
		out += " " + got.Cookie
	}
	g.logOutcome(op, rec.Spec+" "+out, nil)
	fmt.Println(out)
	return nil
}

// callTimeout bounds one CLI call to the daemon, a start with its
// reattaches included.
const callTimeout = 5 * time.Minute

func targetCmd(g *globalOpts, use, short, op string) *cobra.Command {
	return &cobra.Command{
		Use:   use + " /dev/nbdN | SPEC",
		Short: short,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			target := args[0]
			if strings.HasPrefix(target, "/dev/") {
				if _, err := deviceIndex(target); err != nil {
					return err
				}
			} else if _, err := devspec.Parse(target); err != nil {
				return err
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			c := g.client(0, 0)
			call := c.Unmap
			if op == control.OpDetach {
				call = c.Detach
			}
			err := call(ctx, target)
			g.logOutcome(op, target, err)
			if errors.Is(err, control.ErrNotMapped) {
				// Ceph's exact words: ceph-csi treats them as success.
				return &exitError{code: exitNotMapped, msg: fmt.Sprintf("rbd-nbd: %s is not mapped", target)}
			}
			return err
		},
	}
}

func newUnmap(g *globalOpts) *cobra.Command {
	return targetCmd(g, "unmap", "Flush and remove a mapped device", control.OpUnmap)
}

func newDetach(g *globalOpts) *cobra.Command {
	return targetCmd(g, "detach", "Stop serving a device but keep it, waiting for attach", control.OpDetach)
}

// mapped is one line of list-mapped, with rbd-nbd's JSON field names.
type mapped struct {
	ID        int    `json:"id"`
	Pool      string `json:"pool"`
	Namespace string `json:"namespace"`
	Image     string `json:"image"`
	Snap      string `json:"snap"`
	Device    string `json:"device"`
	Cookie    string `json:"cookie"`
}

func toMapped(pid int, r control.Record) mapped {
	m := mapped{ID: pid, Device: r.Device(), Cookie: r.Cookie, Snap: "-", Image: r.Spec}
	if sp, err := devspec.Parse(r.Spec); err == nil && sp.IsRBD() {
		is := sp.Image
		m.Pool, m.Namespace, m.Image = is.Pool, is.Namespace, is.Image
		if is.Snap != "" {
			m.Snap = is.Snap
		}
	}
	return m
}

func newListMapped(g *globalOpts) *cobra.Command {
	var format string
	var pretty bool
	cmd := &cobra.Command{
		Use:   "list-mapped [--format plain|json] [--pretty-format]",
		Short: "List mapped devices",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if format != "plain" && format != "json" {
				return fmt.Errorf("bad --format %q: want plain or json", format)
			}
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			ls, err := g.client(0, 0).List(ctx)
			if err != nil {
				return err
			}
			list := []mapped{}
			for _, r := range ls.Devices {
				if !r.Detached {
					list = append(list, toMapped(ls.PID, r))
				}
			}
			if format == "json" {
				enc := json.NewEncoder(os.Stdout)
				if pretty {
					enc.SetIndent("", "    ")
				}
				return enc.Encode(list)
			}
			if len(list) == 0 {
				return nil
			}
			tw := tabwriter.NewWriter(os.Stdout, 0, 8, 2, ' ', 0)
			fmt.Fprintln(tw, "id\tpool\tnamespace\timage\tsnap\tdevice\tcookie")
			for _, m := range list {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", m.ID, m.Pool, m.Namespace, m.Image, m.Snap, m.Device, m.Cookie)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().StringVar(&format, "format", "plain", "plain or json")
	cmd.Flags().BoolVar(&pretty, "pretty-format", false, "indent JSON")
	return cmd
}

// logOutcome appends one line to --log-file, as rbd-nbd's per-volume
// log would get. Never the key: records are not logged.
func (g *globalOpts) logOutcome(op, what string, err error) {
	if g.logFile == "" {
		return
	}
	f, ferr := os.OpenFile(g.logFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if ferr != nil {
		return
	}
	defer f.Close()
	res := "ok"
	if err != nil {
		res = "error: " + err.Error()
	}
	fmt.Fprintf(f, "%s rbd-nbd-go %s %s: %s\n", time.Now().Format(time.RFC3339), op, what, res)
}
