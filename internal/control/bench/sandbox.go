package bench

import (
	"context"
	"fmt"
	"io"
	"os/exec"
	"time"

	"stasis/internal/providers/local"
	"stasis/sandbox"
)

// SandboxStartOptions configure SandboxStart.
type SandboxStartOptions struct {
	Exe  string   // the stasis binary (keepers run it)
	Env  []string // extra environment for it
	Home string   // state directory (default: a new temporary one, removed after)
	N    int      // sandboxes to time (default 50)
	// Image, when set, is also timed: each round makes a sandbox on it
	// beside the host-root one, after the image is pulled (its unpack
	// timed once). SandboxBinary is the in-sandbox binary those exec
	// through (default: sandboxbin.Path()).
	Image, SandboxBinary string
	Progress             io.Writer
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
	// With Image: ImageCreateExec is the same measure on the image,
	// ImageRatio its p50 over CreateExec's (the host-root mode, the
	// baseline of the same run), and Unpack the image's pull.
	ImageCreateExec *Latency       `json:"image_create_to_first_exec,omitempty"`
	ImageRatio      float64        `json:"image_ratio_p50,omitempty"`
	Unpack          *UnpackFigures `json:"unpack,omitempty"`
}

// UnpackFigures are one image pull's.
type UnpackFigures struct {
	Digest  string  `json:"digest"`
	Seconds float64 `json:"seconds"`
	Bytes   int64   `json:"bytes"`
	Files   int     `json:"files"`
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
	home, remove, err := dirOr(o.Home, "stasis-bench-sandbox-")
	if err != nil {
		return res, err
	}
	defer remove()
	p, err := local.New(local.Options{Home: home, Exe: o.Exe, ExeEnv: o.Env, SandboxBinary: o.SandboxBinary})
	if err != nil {
		return res, err
	}
	digest := ""
	if o.Image != "" {
		t0 := time.Now()
		im, err := p.Images().Pull(ctx, o.Image, nil)
		if err != nil {
			return res, err
		}
		res.Unpack = &UnpackFigures{Digest: im.Digest, Seconds: time.Since(t0).Seconds(), Bytes: im.Bytes, Files: im.Files}
		digest = im.Digest
	}
	var total, create, first, base, onImage []time.Duration
	for i := 0; i < o.N; i++ {
		if digest != "" {
			d, err := createExec(ctx, p, digest)
			if err != nil {
				return res, err
			}
			onImage = append(onImage, d)
		}
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
	if digest != "" {
		l := summarise(onImage)
		res.ImageCreateExec = &l
		res.ImageRatio = float64(l.P50) / float64(res.CreateExec.P50)
	}
	return res, nil
}

// createExec times one sandbox on an image from create to the end of its
// first exec of true, and deletes it.
func createExec(ctx context.Context, p *local.Provider, img string) (time.Duration, error) {
	t0 := time.Now()
	info, err := p.Create(ctx, sandbox.Spec{Image: img, Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		return 0, err
	}
	r, err := p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}})
	d := time.Since(t0)
	derr := p.Delete(ctx, info.ID)
	if err != nil {
		return 0, err
	}
	if r.ExitCode != 0 {
		return 0, fmt.Errorf("true exited %d in %s (image %s)", r.ExitCode, info.ID, img)
	}
	return d, derr
}
