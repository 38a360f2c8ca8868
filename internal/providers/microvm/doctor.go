package microvm

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"

	"stasis/internal/sandboxbin"
)

// Check is one line of a doctor report.
type Check struct {
	Name   string `json:"name"`
	OK     bool   `json:"ok"`
	Detail string `json:"detail"`
	// Fix is the command that makes a failed check pass.
	Fix string `json:"fix,omitempty"`
}

// Report is what `stasis sandbox doctor` prints for the microVM provider.
type Report struct {
	Checks []Check `json:"checks"`
	// Accel is kvm or tcg when everything needed to boot is there.
	Accel  string `json:"accel,omitempty"`
	Reason string `json:"accel_reason,omitempty"`
	Ready  bool   `json:"ready"`
	// Tasks are the built-in tasks the guest image can run (the caller
	// fills them in: the provider knows languages, not tasks).
	Tasks []string `json:"tasks"`
}

// Doctor checks what the provider needs, without failing at the first
// missing piece, and names the command that fixes each; when everything
// is there it builds the image and reports the accelerator (probing KVM
// once, as New does).
func Doctor(ctx context.Context, o Options) Report {
	var r Report
	add := func(c Check) { r.Checks = append(r.Checks, c) }
	const fix = "make deps-microvm"
	ok := true
	if path, err := exec.LookPath(QEMU); err != nil {
		ok = false
		add(Check{Name: "qemu", Detail: QEMU + " not found", Fix: "apt-get install qemu-system-x86 (or " + fix + ")"})
	} else {
		v, _ := QEMUVersion(path)
		add(Check{Name: "qemu", OK: true, Detail: path + ": " + v})
	}
	if o.KernelDir == "" {
		o.KernelDir = os.Getenv(KernelEnv)
	}
	if k, err := FindKernel(o.KernelDir); err != nil {
		ok = false
		add(Check{Name: "kernel", Detail: err.Error(), Fix: fix + ", then export " + KernelEnv + "=$PWD/.tools/microvm/kernel"})
	} else if err := checkModuleOrder(k); err != nil {
		ok = false
		add(Check{Name: "kernel", Detail: err.Error()})
	} else {
		add(Check{Name: "kernel", OK: true, Detail: k.Version + " (" + k.Image + ")"})
	}
	if o.Busybox == "" {
		o.Busybox = "/bin/busybox"
	}
	if err := checkStatic(o.Busybox); err != nil {
		ok = false
		add(Check{Name: "busybox", Detail: err.Error(), Fix: "apt-get install busybox-static"})
	} else {
		add(Check{Name: "busybox", OK: true, Detail: o.Busybox + " (static)"})
	}
	if o.GuestBinary == "" {
		var err error
		if o.GuestBinary, err = sandboxbin.Path(); err != nil {
			ok = false
			add(Check{Name: "guest stasis", Detail: err.Error(), Fix: "make build"})
		}
	}
	if o.GuestBinary != "" {
		if err := checkStatic(o.GuestBinary); err != nil {
			ok = false
			add(Check{Name: "guest stasis", Detail: err.Error(), Fix: "CGO_ENABLED=0 go build -o bin/stasis-sandbox ./cmd/stasis-sandbox (make build)"})
		} else {
			add(Check{Name: "guest stasis", OK: true, Detail: o.GuestBinary + " (static)"})
		}
	}
	if err := kvmUsable(); err != nil {
		add(Check{Name: "kvm", OK: true, Detail: "/dev/kvm unusable (" + err.Error() + "): TCG, software emulation, will be used"})
	} else {
		add(Check{Name: "kvm", OK: true, Detail: "/dev/kvm opens; a boot probe decides whether a vCPU really runs"})
	}
	if !ok {
		return r
	}
	if o.Home == "" {
		o.Home = filepath.Join(os.TempDir(), "stasis-doctor")
	}
	p, err := New(ctx, o)
	if err != nil {
		add(Check{Name: "provider", Detail: err.Error()})
		return r
	}
	if err := p.Prepare(ctx); err != nil {
		add(Check{Name: "guest image", Detail: err.Error()})
		return r
	}
	r.Accel, r.Reason = p.Accel()
	add(Check{Name: "accelerator", OK: true, Detail: r.Accel + ": " + r.Reason})
	r.Ready = true
	return r
}
