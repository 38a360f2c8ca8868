package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// QEMU is the system emulator the provider runs.
const QEMU = "qemu-system-x86_64"

// vmConfig is what a QEMU process of a sandbox is started with. A fork's
// QEMU must be started with its snapshot's config (the machine it was
// saved from), plus its own port and incoming state.
type vmConfig struct {
	QEMU      string `json:"qemu"`
	Kernel    string `json:"kernel"`
	Initramfs string `json:"initramfs"`
	MemMiB    int    `json:"mem_mib"`
	Accel     string `json:"accel"` // kvm or tcg
	// Port is the host's loopback port forwarded to the guest agent.
	Port int `json:"port"`
	// Gateway is the host unix socket that GatewayAddr in the guest leads
	// to (empty: none); Pipe is the command line that bridges one guest
	// connection to it (QEMU runs it per connection, on its stdio).
	Gateway string   `json:"gateway,omitempty"`
	Pipe    []string `json:"pipe,omitempty"`
	// TSCKHz, under TCG, is the host's TSC frequency, given to the guest
	// kernel (tsc_early_khz) so that it does not calibrate its TSC against
	// the emulated PIT: on a loaded host that calibration fails, the
	// kernel finds no clock source and never boots.
	TSCKHz int `json:"tsc_khz,omitempty"`
	// Disk is the read-only block image of the guest's image root (see
	// RootImage), attached as virtio-blk; empty: the initramfs is the
	// root. A fork attaches the same file, so the saved state's device
	// stays valid; Image is that image's digest.
	Disk  string `json:"disk,omitempty"`
	Image string `json:"image,omitempty"`
	// DiskID identifies the very file Disk was at boot (see fileID): a
	// block image built again for the same digest may lay its blocks out
	// otherwise, and a saved machine's page cache would then read the
	// wrong ones.
	DiskID string `json:"disk_id,omitempty"`
	// DiskManifest is Disk stored in a shared store (see storeDisks),
	// set in a snapshot's record.
	DiskManifest string `json:"disk_manifest,omitempty"`
	// Binds are host directories the guest sees read-only (see BindDisk).
	Binds []BindDisk `json:"binds,omitempty"`
	// Incoming is the command whose output is the saved state a fork
	// starts from (QEMU runs it: `stasis microvm state`, streaming it out
	// of the blob store), or empty.
	Incoming []string `json:"incoming,omitempty"`
	// IncomingStream says the saved state comes over the monitor instead
	// (QEMU starts with -incoming defer): the provider streams it out of a
	// store of its own process (Options.Blobs), through a pipe it hands
	// QEMU (see streamIncoming).
	IncomingStream bool `json:"incoming_stream,omitempty"`
}

// shellQuote quotes s for the glib shell parser QEMU uses on a guestfwd
// command.
func shellQuote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// qmpPath is a sandbox's QMP socket: in /tmp, not in the sandbox's
// directory, whose path can pass the 107 bytes a unix socket's may have.
func qmpPath(id string) string { return filepath.Join("/tmp", "stasis-qmp-"+id+".sock") }

// cmdline is the guest kernel's command line.
func (c vmConfig) cmdline() string {
	s := "console=ttyS0 quiet panic=-1 tsc=reliable"
	if c.TSCKHz > 0 {
		s += " tsc_early_khz=" + strconv.Itoa(c.TSCKHz)
	}
	// The boot script mounts bind disk i (serial bindSerial(i)) at its
	// path; checkBindPath keeps the paths free of blanks.
	for i, b := range c.Binds {
		s += fmt.Sprintf(" stasis.bind=%d:%s", i, b.Path)
	}
	return s
}

// hostTSCKHz reads the host's TSC frequency (kHz) from /proc/cpuinfo's
// "cpu MHz", trusted only with constant_tsc (a TSC that does not follow
// frequency changes); 0 when unknown.
func hostTSCKHz() int {
	b, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return 0
	}
	var mhz float64
	constant := false
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "cpu MHz":
			if mhz == 0 {
				mhz, _ = strconv.ParseFloat(strings.TrimSpace(v), 64)
			}
		case "flags":
			constant = constant || strings.Contains(" "+v+" ", " constant_tsc ")
		}
	}
	if !constant || mhz <= 0 {
		return 0
	}
	return int(mhz * 1000)
}

// args is QEMU's command line for a sandbox directory.
func (c vmConfig) args(dir string) []string {
	machine := "microvm,accel=" + c.Accel
	cpu := "max"
	if c.Accel == "kvm" {
		cpu = "host"
	}
	netdev := fmt.Sprintf("user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:%d-%s:%d", c.Port, guestIP, AgentPort)
	if c.Gateway != "" && len(c.Pipe) > 0 {
		q := make([]string, len(c.Pipe))
		for i, a := range c.Pipe {
			q[i] = shellQuote(a)
		}
		// The guestfwd option's value ends at the next comma: the command
		// line must hold none.
		netdev += ",guestfwd=tcp:" + GatewayAddr + "-cmd:" + strings.Join(q, " ")
	}
	a := []string{
		"-name", filepath.Base(dir),
		"-M", machine, "-cpu", cpu, "-smp", "1", "-m", strconv.Itoa(c.MemMiB),
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-kernel", c.Kernel, "-initrd", c.Initramfs,
		"-append", c.cmdline(),
		"-serial", "file:" + filepath.Join(dir, consoleFile),
		"-netdev", netdev, "-device", "virtio-net-device,netdev=n0",
		"-qmp", "unix:" + qmpPath(filepath.Base(dir)) + ",server=on,wait=off",
	}
	if c.Disk != "" {
		a = append(a, "-drive", "file="+c.Disk+",format=raw,if=none,id=root,readonly=on,cache=none,aio=threads",
			"-device", "virtio-blk-device,drive=root,serial="+rootSerial)
	}
	for i, b := range c.Binds {
		id := fmt.Sprintf("bind%d", i)
		a = append(a, "-drive", "file="+b.Disk+",format=raw,if=none,id="+id+",readonly=on,cache=none,aio=threads",
			"-device", "virtio-blk-device,drive="+id+",serial="+bindSerial(i))
	}
	if len(c.Incoming) > 0 {
		q := make([]string, len(c.Incoming))
		for i, arg := range c.Incoming {
			q[i] = shellQuote(arg)
		}
		a = append(a, "-incoming", "exec:"+strings.Join(q, " "))
	} else if c.IncomingStream {
		a = append(a, "-incoming", "defer")
	}
	return a
}

// qmpConn is a QMP connection: one JSON object per line each way;
// asynchronous events are skipped. (Written here rather than taken from
// go-qemu, whose qmp package pulls in a libvirt RPC client and takes no
// deadlines.)
type qmpConn struct {
	c net.Conn
	r *bufio.Reader
}

// monitor connects to a sandbox's QMP socket and negotiates capabilities,
// retrying while QEMU has not made the socket yet, until ctx ends.
func monitor(ctx context.Context, sock string) (*qmpConn, error) {
	var err error
	for {
		var c net.Conn
		var d net.Dialer
		if c, err = d.DialContext(ctx, "unix", sock); err == nil {
			m := &qmpConn{c: c, r: bufio.NewReader(c)}
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err = m.r.ReadBytes('\n'); err == nil { // the greeting
				err = qmpRun(m, "qmp_capabilities", nil, nil)
			}
			if err == nil {
				_ = c.SetDeadline(time.Time{})
				return m, nil
			}
			c.Close()
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("QEMU's monitor %s: %w (%v)", sock, ctx.Err(), err)
		case <-time.After(20 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
}

func (m *qmpConn) Close() error { return m.c.Close() }

// qmpRun runs one QMP command (within a minute) and decodes its "return"
// into out (when not nil).
func qmpRun(m *qmpConn, cmd string, args any, out any) error {
	return qmpRunFD(m, cmd, args, out, nil)
}

// qmpRunFD is qmpRun passing file f to QEMU with the command (SCM_RIGHTS),
// as getfd wants.
func qmpRunFD(m *qmpConn, cmd string, args any, out any, f *os.File) error {
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	b, err := json.Marshal(req)
	if err != nil {
		return err
	}
	_ = m.c.SetDeadline(time.Now().Add(time.Minute))
	defer m.c.SetDeadline(time.Time{})
	if f != nil {
		uc, ok := m.c.(*net.UnixConn)
		if !ok {
			return fmt.Errorf("QMP %s: passing a file needs a unix socket", cmd)
		}
		if _, _, err := uc.WriteMsgUnix(append(b, '\n'), unix.UnixRights(int(f.Fd())), nil); err != nil {
			return fmt.Errorf("QMP %s: %w", cmd, err)
		}
	} else if _, err := m.c.Write(append(b, '\n')); err != nil {
		return fmt.Errorf("QMP %s: %w", cmd, err)
	}
	for {
		line, err := m.r.ReadBytes('\n')
		if err != nil {
			return fmt.Errorf("QMP %s: %w", cmd, err)
		}
		var r struct {
			Return json.RawMessage `json:"return"`
			Error  *struct {
				Class string `json:"class"`
				Desc  string `json:"desc"`
			} `json:"error"`
			Event string `json:"event"`
		}
		if err := json.Unmarshal(line, &r); err != nil {
			return fmt.Errorf("QMP %s: %w", cmd, err)
		}
		switch {
		case r.Event != "":
			continue
		case r.Error != nil:
			return fmt.Errorf("QMP %s: %s: %s", cmd, r.Error.Class, r.Error.Desc)
		case out != nil:
			return json.Unmarshal(r.Return, out)
		default:
			return nil
		}
	}
}

// migrationStatus is query-migrate's answer, the parts used here.
type migrationStatus struct {
	Status    string `json:"status"`
	ErrorDesc string `json:"error-desc"`
	RAM       struct {
		Transferred int64 `json:"transferred"`
		Total       int64 `json:"total"`
	} `json:"ram"`
}

// waitMigration polls query-migrate until the migration completes or
// fails.
func waitMigration(ctx context.Context, m *qmpConn) (migrationStatus, error) {
	for {
		var st migrationStatus
		if err := qmpRun(m, "query-migrate", nil, &st); err != nil {
			return st, err
		}
		switch st.Status {
		case "completed":
			return st, nil
		case "failed", "cancelled":
			return st, fmt.Errorf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			_ = qmpRun(m, "migrate_cancel", nil, nil)
			return st, ctx.Err()
		case <-time.After(5 * time.Millisecond): // poll interval, bounded by ctx
		}
	}
}

// QEMUVersion runs qemu --version and returns its first line.
func QEMUVersion(qemu string) (string, error) {
	out, err := exec.Command(qemu, "--version").Output()
	if err != nil {
		return "", err
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(line), nil
}

// accelCache is HOME/accel.json: the probe's answer for one QEMU, kernel
// and host kernel.
type accelCache struct {
	Key    string    `json:"key"`
	Accel  string    `json:"accel"`
	Reason string    `json:"reason"`
	When   time.Time `json:"when"`
}

// kvmUsable says whether /dev/kvm can be opened for reading and writing.
func kvmUsable() error {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return err
	}
	return f.Close()
}

// hostRelease is the host kernel's release.
func hostRelease() string {
	b, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return strings.TrimSpace(string(b))
}

// probeKVM boots the guest under KVM with a short timeout and reports
// whether its boot script ran: /dev/kvm can exist while a vCPU never runs
// (no nested virtualisation), and only a boot tells.
func probeKVM(ctx context.Context, qemu string, k Kernel, initramfs string, timeout time.Duration) error {
	dir, err := os.MkdirTemp("", "stasis-kvm-probe-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	console := filepath.Join(dir, "console")
	cmd := exec.Command(qemu, "-M", "microvm,accel=kvm", "-cpu", "host", "-m", "128", "-smp", "1",
		"-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
		"-kernel", k.Image, "-initrd", initramfs, "-append", "console=ttyS0 quiet panic=-1",
		"-serial", "file:"+console)
	out := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	deadline := time.After(timeout)
	for {
		if b, _ := os.ReadFile(console); strings.Contains(string(b), "stasis-guest: booted") {
			_ = cmd.Process.Kill()
			<-done
			return nil
		}
		select {
		case err := <-done:
			return fmt.Errorf("QEMU exited (%v): %s", err, strings.TrimSpace(out.String()))
		case <-deadline:
			_ = cmd.Process.Kill()
			<-done
			return fmt.Errorf("the guest did not boot under KVM within %s (a vCPU that never runs: nested virtualisation is absent)", timeout)
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			<-done
			return ctx.Err()
		case <-time.After(50 * time.Millisecond): // poll interval, bounded by the deadline
		}
	}
}

// chooseAccel returns kvm or tcg and why, probing once per QEMU, kernel
// and host kernel and caching the answer in cacheFile.
func chooseAccel(ctx context.Context, cacheFile, qemu string, k Kernel, initramfs string) (string, string) {
	ver, _ := QEMUVersion(qemu)
	key := ver + "|" + k.Version + "|" + hostRelease()
	var c accelCache
	if b, err := os.ReadFile(cacheFile); err == nil && json.Unmarshal(b, &c) == nil && c.Key == key && (c.Accel == "kvm" || c.Accel == "tcg") {
		return c.Accel, c.Reason + " (cached " + c.When.Format(time.RFC3339) + ")"
	}
	c = accelCache{Key: key, When: time.Now().UTC()}
	if err := kvmUsable(); err != nil {
		c.Accel, c.Reason = "tcg", "/dev/kvm unusable: "+err.Error()
	} else if err := probeKVM(ctx, qemu, k, initramfs, 15*time.Second); err != nil {
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return "tcg", "KVM probe interrupted: " + err.Error()
		}
		c.Accel, c.Reason = "tcg", "KVM probe failed: "+err.Error()
	} else {
		c.Accel, c.Reason = "kvm", "KVM probe booted the guest"
	}
	if b, err := json.Marshal(c); err == nil {
		_ = os.WriteFile(cacheFile, b, 0o600)
	}
	return c.Accel, c.Reason
}
