package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"time"

	"stasis/sandbox"
	"stasis/sandbox/local"
)

// SandboxStartOptions configure SandboxStart.
type SandboxStartOptions struct {
	Exe      string   // the stasis binary (keepers run it)
	Env      []string // extra environment for it
	Home     string   // state directory (default: a new temporary one, removed after)
	N        int      // sandboxes to time (default 50)
	Progress io.Writer
}

// SandboxStartResult is the create-to-first-exec latency of local
// sandboxes, beside bubblewrap running `true` directly in the same run.
type SandboxStartResult struct {
	N          int     `json:"n"`
	CreateExec Latency `json:"create_to_first_exec"`
	Create     Latency `json:"create"`
	FirstExec  Latency `json:"first_exec"`
	// Bwrap is `bwrap --ro-bind / / --unshare-all true` as one process: the
	// floor of starting namespaces at all.
	Bwrap Latency `json:"baseline_bwrap_true"`
}

// SandboxStart creates N local sandboxes one after another and times each
// from the start of Create to the end of its first Exec (`true`).
func SandboxStart(ctx context.Context, o SandboxStartOptions) (SandboxStartResult, error) {
	if o.N <= 0 {
		o.N = 50
	}
	if o.Progress == nil {
		o.Progress = io.Discard
	}
	res := SandboxStartResult{N: o.N}
	home := o.Home
	if home == "" {
		d, err := os.MkdirTemp("", "stasis-bench-sandbox-")
		if err != nil {
			return res, err
		}
		defer os.RemoveAll(d)
		home = d
	}
	p, err := local.New(local.Options{Home: home, Exe: o.Exe, ExeEnv: o.Env})
	if err != nil {
		return res, err
	}
	var total, create, first, base []time.Duration
	for i := 0; i < o.N; i++ {
		t0 := time.Now()
		info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)})
		if err != nil {
			return res, err
		}
		t1 := time.Now()
		r, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}})
		t2 := time.Now()
		derr := p.Delete(ctx, info.ID)
		if err != nil {
			return res, err
		}
		if r.ExitCode != 0 {
			return res, fmt.Errorf("true exited %d in %s", r.ExitCode, info.ID)
		}
		if derr != nil {
			return res, derr
		}
		total, create, first = append(total, t2.Sub(t0)), append(create, t1.Sub(t0)), append(first, t2.Sub(t1))
		t0 = time.Now()
		out, err := exec.CommandContext(ctx, "bwrap", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-all", "--die-with-parent", "true").CombinedOutput()
		if err != nil {
			return res, fmt.Errorf("baseline bwrap: %v: %s", err, out)
		}
		base = append(base, time.Since(t0))
		if (i+1)%10 == 0 {
			fmt.Fprintf(o.Progress, "sandbox start: %d/%d\n", i+1, o.N)
		}
	}
	res.CreateExec, res.Create, res.FirstExec, res.Bwrap = summarise(total), summarise(create), summarise(first), summarise(base)
	return res, nil
}
