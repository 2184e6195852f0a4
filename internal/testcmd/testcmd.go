// Package testcmd runs the external programs tests depend on (NBD clients,
// the ceph and rbd tools, the dev-cluster script) so that none can hang a
// test run: exec.CommandContext alone kills only the process it started,
// and a child that process forked (fio's job processes, a daemon a script
// starts) keeps the output pipes open, so Wait blocks for good. A CI run
// once sat 30 minutes in go test's timeout that way.
package testcmd

import (
	"context"
	"os/exec"
	"syscall"
	"time"
)

// pipeGrace is how long Wait keeps reading output after the command ends
// or is killed, before it gives up on pipes a leftover child holds.
const pipeGrace = 5 * time.Second

// Command is exec.CommandContext in a process group of its own: when ctx
// ends, the whole group is killed, and Wait returns at most pipeGrace
// after the command itself has gone.
func Command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = pipeGrace
	return cmd
}
