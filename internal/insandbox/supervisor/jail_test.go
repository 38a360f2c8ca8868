package supervisor_test

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"

	"stasis/internal/insandbox/supervisor"
	"stasis/internal/stasistest"
)

// probeArg, as the first argument, makes the test binary the hostile
// harness of TestJailedHarnessIsRefused (see runProbe) instead of running
// tests or acting as stasis.
const probeArg = "__jail-probe"

// probeResult is what the probe harness tried and what it got: "" for
// success, else the error.
type probeResult struct {
	UID, GID   int
	Groups     []int
	CapEff     string // /proc/self/status
	NoNewPrivs string
	Seccomp    string
	ShimComm   string // the parent, to show the probe found the right processes
	SupComm    string
	SupPID     int

	ReadToken       string // read the relay's credentials
	DialUpstream    string // connect to the gateway's socket past the relay
	DialRelay       string // connect to its own relay (the harness may)
	DialControl     string // connect to the supervisor's control socket
	CtlPause        string // `stasis ctl pause 1` as the harness
	CtlContinue     string // `stasis ctl continue 1`
	PtraceSup       string // PTRACE_SEIZE the supervisor
	PtraceShim      string // PTRACE_SEIZE the shim
	PtraceChild     string // PTRACE_SEIZE a child of its own
	SupMem          string // open /proc/SUPERVISOR/mem
	VMReadSup       string // process_vm_readv from the supervisor
	VMReadSelf      string // process_vm_readv from itself
	PidfdGetfdChild string // take a child's fd 0 by pidfd_getfd
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// runProbe is the hostile harness: os.Args[2] is where it writes what it
// got (result.json), then the session directory, the token file, the
// gateway's socket and the relay's. It tries each attack once, writes the
// result and then waits to be ended, so the test can look at its
// supervisor afterwards. Under the jail every attack must fail; run as the
// supervisor's own user (the control) the same attacks succeed, which
// shows that the probe can tell.
func runProbe(args []string) int {
	if len(args) != 5 {
		fmt.Fprintln(os.Stderr, "probe: want OUT DIR TOKEN UPSTREAM RELAY")
		return 2
	}
	out, dir, token, upstream, relaySock := args[0], args[1], args[2], args[3], args[4]
	var r probeResult
	r.UID, r.GID = os.Getuid(), os.Getgid()
	r.Groups, _ = os.Getgroups()
	status, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "CapEff":
			r.CapEff = strings.TrimSpace(v)
		case "NoNewPrivs":
			r.NoNewPrivs = strings.TrimSpace(v)
		case "Seccomp":
			r.Seccomp = strings.TrimSpace(v)
		}
	}
	shim := os.Getppid()
	r.ShimComm = comm(shim)
	r.SupPID = ppid(shim)
	r.SupComm = comm(r.SupPID)

	_, err := os.ReadFile(token)
	r.ReadToken = errString(err)
	r.DialUpstream = dial(upstream)
	r.DialRelay = dial(relaySock)
	r.DialControl = dial(filepath.Join(dir, supervisor.SocketFile))
	self, _ := os.Executable()
	ctl := func(op string) string {
		c := exec.Command(self, "ctl", "--dir", dir, op, "1")
		b, err := c.CombinedOutput()
		if err != nil {
			return fmt.Sprintf("%v: %s", err, strings.TrimSpace(string(b)))
		}
		return ""
	}
	r.CtlPause = ctl("pause")
	r.CtlContinue = ctl("continue")

	// ptrace is per thread: keep this goroutine on one.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r.PtraceSup = errString(seizeAndDetach(r.SupPID))
	r.PtraceShim = errString(seizeAndDetach(shim))
	child := exec.Command("sleep", "300")
	if err := child.Start(); err != nil {
		r.PtraceChild = "start a child: " + err.Error()
	} else {
		r.PtraceChild = errString(seizeAndDetach(child.Process.Pid))
		r.PidfdGetfdChild = errString(pidfdGetfd(child.Process.Pid, 0))
		_ = child.Process.Kill()
		_ = child.Wait()
	}
	f, err := os.Open(fmt.Sprintf("/proc/%d/mem", r.SupPID))
	r.SupMem = errString(err)
	if f != nil {
		f.Close()
	}
	r.VMReadSup = errString(vmRead(r.SupPID, mappedAddr(r.SupPID)))
	var word uint64 = 0x5354415349530a
	r.VMReadSelf = errString(vmRead(os.Getpid(), uintptr(unsafe.Pointer(&word))))

	b, _ := json.Marshal(r)
	if err := os.WriteFile(filepath.Join(out, "result.json.tmp"), b, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		return 1
	}
	if err := os.Rename(filepath.Join(out, "result.json.tmp"), filepath.Join(out, "result.json")); err != nil {
		fmt.Fprintln(os.Stderr, "probe:", err)
		return 1
	}
	// A harness that lasts: the test ends it through its supervisor.
	time.Sleep(5 * time.Minute)
	return 0
}

func comm(pid int) string {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
	return strings.TrimSpace(string(b))
}

func ppid(pid int) int {
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "PPid:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}

func dial(path string) string {
	c, err := net.Dial("unix", path)
	if err != nil {
		return err.Error()
	}
	c.Close()
	return ""
}

// seizeAndDetach attaches to pid without stopping it and, if that worked,
// interrupts, waits for the stop and detaches again, so a successful
// attempt (the control run) leaves the process as it was.
func seizeAndDetach(pid int) error {
	if err := unix.PtraceSeize(pid); err != nil {
		return err
	}
	if err := unix.PtraceInterrupt(pid); err != nil {
		return fmt.Errorf("seized, but PTRACE_INTERRUPT: %w", err)
	}
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, unix.WALL, nil); err != nil {
		return fmt.Errorf("seized, but wait: %w", err)
	}
	if err := unix.PtraceDetach(pid); err != nil {
		return fmt.Errorf("seized, but PTRACE_DETACH: %w", err)
	}
	return nil
}

func pidfdGetfd(pid, fd int) error {
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fmt.Errorf("pidfd_open: %w", err)
	}
	defer unix.Close(pfd)
	got, err := unix.PidfdGetfd(pfd, fd, 0)
	if err != nil {
		return err
	}
	unix.Close(got)
	return nil
}

// mappedAddr is the start of pid's first readable mapping, or an
// arbitrary address when its maps cannot be read (then process_vm_readv
// is refused before the address matters).
func mappedAddr(pid int) uintptr {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return 0x400000
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 || !strings.HasPrefix(f[1], "r") {
			continue
		}
		start, _, _ := strings.Cut(f[0], "-")
		if a, err := strconv.ParseUint(start, 16, 64); err == nil {
			return uintptr(a)
		}
	}
	return 0x400000
}

func vmRead(pid int, addr uintptr) error {
	buf := make([]byte, 8)
	local := []unix.Iovec{{Base: &buf[0], Len: 8}}
	remote := []unix.RemoteIovec{{Base: addr, Len: 8}}
	n, err := unix.ProcessVMReadv(pid, local, remote, 0)
	if err != nil {
		return err
	}
	if n != 8 {
		return fmt.Errorf("read %d bytes", n)
	}
	return nil
}

// TestJailedHarnessIsRefused runs a real supervisor (hold mode, hosting
// the relay, its token file and the gateway's socket root's and closed)
// whose harness is a hostile probe, twice: jailed as uid/gid 1000 (what
// every sandbox with users does), where driving the supervisor by ctl,
// reading the token, connecting to the gateway's socket past the relay,
// ptrace, process_vm_readv, /proc/PID/mem and pidfd_getfd all fail and
// the supervisor's sequence stays at 0; and, as the control, as the
// supervisor's own user (root), where the same attempts succeed.
func TestJailedHarnessIsRefused(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to start a harness as another user; CI runs as root")
	}
	t.Cleanup(func() { stasistest.NoChildrenLeft(t) })
	base, err := os.MkdirTemp("", "stasis-jail-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	// The probe is this test binary, where uid 1000 can run it (the build
	// directory is root's, mode 0700).
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(base, "probe")
	copyFile(t, os.Args[0], bin, 0o755)
	secret := filepath.Join(base, "secret")
	if err := os.Mkdir(secret, 0o755); err != nil {
		t.Fatal(err)
	}
	token := filepath.Join(secret, "token.json")
	if err := os.WriteFile(token, []byte(`{"episode":"ep-jail","token":"sk-not-for-the-agent","attempt":0}`), 0o600); err != nil {
		t.Fatal(err)
	}
	upstream := filepath.Join(secret, "gw.sock")
	gw, err := net.Listen("unix", upstream)
	if err != nil {
		t.Fatal(err)
	}
	defer gw.Close()
	if err := os.Chmod(upstream, 0o600); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := gw.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()

	run := func(name string, jailed bool) (probeResult, supervisor.Status) {
		t.Helper()
		work := filepath.Join(base, name)
		out := filepath.Join(work, "out")
		if err := os.MkdirAll(out, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(work, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(out, 1000, 1000); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(work, "session")
		relaySock := filepath.Join(work, "relay.sock")
		flags := []string{"--log-level", "warn", "--mode", "hold",
			"--relay-listen", "unix:" + relaySock, "--relay-upstream", "unix://" + upstream, "--relay-token-file", token}
		if jailed {
			flags = append(flags, "--harness-uid", "1000", "--harness-gid", "1000")
		}
		var logs strings.Builder
		c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
			Exe: os.Args[0], Env: stasistest.Env, Dir: dir, Flags: flags,
			Argv:   []string{bin, probeArg, out, dir, token, upstream, relaySock},
			Stdout: &logs, Stderr: &logs,
		})
		if err != nil {
			t.Fatal(err)
		}
		defer func() {
			if _, err := c.Stop(ctx, 30*time.Second); err != nil {
				t.Errorf("%s: stop: %v", name, err)
			}
		}()
		var b []byte
		eventually(t, name+": the probe's result", 60*time.Second, func() bool {
			b, err = os.ReadFile(filepath.Join(out, "result.json"))
			return err == nil
		})
		var r probeResult
		if err := json.Unmarshal(b, &r); err != nil {
			t.Fatalf("%s: %v: %s", name, err, b)
		}
		st, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpStatus})
		if err != nil {
			t.Fatalf("%s: status: %v\n%s", name, err, logs.String())
		}
		if r.SupPID != c.Cmd.Process.Pid || r.ShimComm != "stasis-shim" {
			t.Fatalf("%s: the probe found supervisor %d (%s) and shim %q, want %d: %+v", name, r.SupPID, r.SupComm, r.ShimComm, c.Cmd.Process.Pid, r)
		}
		return r, *st.Status
	}

	// The control: the same probe as the supervisor's own user.
	ctl, st := run("control", false)
	t.Logf("control: %+v", ctl)
	for what, got := range map[string]string{
		"read the token": ctl.ReadToken, "dial the gateway": ctl.DialUpstream, "dial its relay": ctl.DialRelay,
		"dial the control socket": ctl.DialControl, "ctl pause": ctl.CtlPause, "ctl continue": ctl.CtlContinue,
		"ptrace the supervisor": ctl.PtraceSup, "ptrace the shim": ctl.PtraceShim, "ptrace its child": ctl.PtraceChild,
		"open the supervisor's mem": ctl.SupMem, "process_vm_readv the supervisor": ctl.VMReadSup,
		"process_vm_readv itself": ctl.VMReadSelf, "pidfd_getfd from its child": ctl.PidfdGetfdChild,
	} {
		if got != "" {
			t.Errorf("control (not jailed): %s failed (%s): the probe cannot tell a refusal from its own failure", what, got)
		}
	}
	if st.State != "running" || st.Seq != 1 {
		t.Errorf("control: the unjailed probe's pause and continue left %+v, want running at sequence 1", st)
	}

	// Jailed.
	j, st := run("jailed", true)
	t.Logf("jailed: %+v", j)
	if j.UID != 1000 || j.GID != 1000 || len(j.Groups) != 0 || j.CapEff != "0000000000000000" || j.NoNewPrivs != "1" || j.Seccomp != "2" {
		t.Errorf("jailed identity: uid %d gid %d groups %v CapEff %s NoNewPrivs %s Seccomp %s, want 1000, 1000, none, none, 1, 2",
			j.UID, j.GID, j.Groups, j.CapEff, j.NoNewPrivs, j.Seccomp)
	}
	if j.DialRelay != "" {
		t.Errorf("jailed: the harness cannot reach its own relay: %s", j.DialRelay)
	}
	eperm, eacces := unix.EPERM.Error(), unix.EACCES.Error()
	for _, c := range []struct{ what, got, want string }{
		{"read the token", j.ReadToken, eacces},
		{"dial the gateway past the relay", j.DialUpstream, eacces},
		{"dial the control socket", j.DialControl, eacces},
		{"ctl pause", j.CtlPause, "exit status"},
		{"ctl continue", j.CtlContinue, "exit status"},
		{"ptrace the supervisor", j.PtraceSup, eperm},
		{"ptrace the shim", j.PtraceShim, eperm},
		{"ptrace its own child", j.PtraceChild, eperm},
		{"pidfd_getfd from its own child", j.PidfdGetfdChild, eperm},
		{"open the supervisor's mem", j.SupMem, eacces},
		{"process_vm_readv the supervisor", j.VMReadSup, eperm},
		{"process_vm_readv itself", j.VMReadSelf, eperm},
	} {
		if c.got == "" || !strings.Contains(c.got, c.want) {
			t.Errorf("jailed: %s: got %q, want a refusal (%s)", c.what, c.got, c.want)
		}
	}
	if st.State != "running" || st.Seq != 0 {
		t.Errorf("jailed: the supervisor after the probe's ctl: %+v, want running at sequence 0", st)
	}
}

func copyFile(t *testing.T, from, to string, mode os.FileMode) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// seccompData encodes the kernel's struct seccomp_data (nr, arch,
// instruction pointer, six arguments) for x/net/bpf's VM, which loads
// words big-endian where the kernel loads them in host order: each field
// the filter reads is a whole word, so writing them big-endian gives the
// values the kernel would see.
func seccompData(nr, arch uint32) []byte {
	b := make([]byte, 64)
	binary.BigEndian.PutUint32(b[0:], nr)
	binary.BigEndian.PutUint32(b[4:], arch)
	return b
}

// TestHarnessFilterDecisions runs the harness filter on the calls that
// matter for each ABI a process of this architecture can use: the denied
// calls fail with EPERM on the native and on the compat ABI (a filter on
// native numbers alone would let int 0x80's ptrace through), x32 calls
// are refused, and ordinary calls are allowed on both.
func TestHarnessFilterDecisions(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the system call numbers below are x86's")
	}
	prog, err := supervisor.HarnessFilter()
	if err != nil {
		t.Fatal(err)
	}
	vm, err := bpf.NewVM(prog)
	if err != nil {
		t.Fatal(err)
	}
	const (
		auditX8664 = 0xc000003e
		auditI386  = 0x40000003
		x32Bit     = 0x40000000
		allow      = unix.SECCOMP_RET_ALLOW
		eperm      = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
	)
	for _, c := range []struct {
		what     string
		nr, arch uint32
		want     []uint32 // any of these
	}{
		{"native ptrace", unix.SYS_PTRACE, auditX8664, []uint32{eperm}},
		{"native process_vm_readv", unix.SYS_PROCESS_VM_READV, auditX8664, []uint32{eperm}},
		{"native process_vm_writev", unix.SYS_PROCESS_VM_WRITEV, auditX8664, []uint32{eperm}},
		{"native pidfd_getfd", unix.SYS_PIDFD_GETFD, auditX8664, []uint32{eperm}},
		{"native kcmp", unix.SYS_KCMP, auditX8664, []uint32{eperm}},
		{"native read", unix.SYS_READ, auditX8664, []uint32{allow}},
		{"native clone", unix.SYS_CLONE, auditX8664, []uint32{allow}},
		{"native execve", unix.SYS_EXECVE, auditX8664, []uint32{allow}},
		{"i386 ptrace (int 0x80)", 26, auditI386, []uint32{eperm}},
		{"i386 process_vm_readv", 347, auditI386, []uint32{eperm}},
		{"i386 process_vm_writev", 348, auditI386, []uint32{eperm}},
		{"i386 kcmp", 349, auditI386, []uint32{eperm}},
		{"i386 pidfd_getfd", 438, auditI386, []uint32{eperm}},
		{"i386 read", 3, auditI386, []uint32{allow}},
		{"i386 exit", 1, auditI386, []uint32{allow}},
		{"x32 ptrace", x32Bit | 521, auditX8664, nil},
		{"x32 read", x32Bit | unix.SYS_READ, auditX8664, nil},
	} {
		got, err := vm.Run(seccompData(c.nr, c.arch))
		if err != nil {
			t.Fatalf("%s: %v", c.what, err)
		}
		g := uint32(got)
		if c.want == nil {
			if g == allow {
				t.Errorf("%s: allowed, want refused", c.what)
			}
			continue
		}
		ok := false
		for _, w := range c.want {
			ok = ok || g == w
		}
		if !ok {
			t.Errorf("%s: filter returns %#x, want %#x", c.what, g, c.want)
		}
	}
}
