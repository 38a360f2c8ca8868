package microvm_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/relay"
	"stasis/internal/guestclock"
	"stasis/internal/proc"
	"stasis/internal/providers/microvm"
	"stasis/internal/stasistest"
	"stasis/sandbox"
	"stasis/sandbox/sandboxtest"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

var ctx = context.Background()

// newProvider opens a microVM provider over a fresh state directory; the
// guest runs a static stasis built from this module, the host side this
// test binary acting as stasis.
func newProvider(t testing.TB, o microvm.Options) *microvm.Provider {
	t.Helper()
	if os.Getenv(microvm.KernelEnv) == "" {
		t.Fatalf("%s is not set: run the tests with make (make deps-microvm unpacks the kernel), or point it at an unpacked linux-image-*-cloud-amd64 package", microvm.KernelEnv)
	}
	if o.Home == "" {
		o.Home = t.TempDir()
	}
	o.Exe, o.ExeEnv = stasistest.Exe(), stasistest.Env
	o.GuestBinary = stasistest.StaticBinary(t)
	if o.MemMiB == 0 {
		o.MemMiB = 128
	}
	p, err := microvm.New(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	accel, why := p.Accel()
	t.Logf("accelerator %s: %s", accel, why)
	return p
}

// hostProcesses lists host processes whose command line mentions the
// sandbox (its keeper and its QEMU, whose -name is the id).
func hostProcesses(id string) []int {
	all, _ := proc.All()
	var out []int
	for pid := range all {
		if pid == os.Getpid() {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		if bytes.Contains(b, []byte(id)) {
			out = append(out, pid)
		}
	}
	return out
}

func TestConformance(t *testing.T) { conformance(t, microvm.Options{}) }

// conformance runs the provider suite on a provider made with o, whose
// forks the suite can make fail.
func conformance(t *testing.T, o microvm.Options) {
	var mu sync.Mutex
	fail := map[string]int{}
	o.ForkHook = func(snapshot string, i int) error {
		mu.Lock()
		defer mu.Unlock()
		if k, ok := fail[snapshot]; ok && k == i {
			return errors.New("injected fork failure")
		}
		return nil
	}
	p := newProvider(t, o)
	defer p.Close()
	sandboxtest.Run(t, sandboxtest.Harness{
		Provider: p,
		FailFork: func(snapshot string, k int) func() {
			mu.Lock()
			fail[snapshot] = k
			mu.Unlock()
			return func() { mu.Lock(); delete(fail, snapshot); mu.Unlock() }
		},
		Retired:       p.Retired,
		HostProcesses: hostProcesses,
		ExpiryStep:    3 * time.Second,
	})
}

// TestConformanceWithDebianImage: the whole suite, and its image cases, on
// guests whose root is the Debian image of the Makefile (a read-only
// erofs block device under an overlay in RAM).
func TestConformanceWithDebianImage(t *testing.T) {
	var mu sync.Mutex
	fail := map[string]int{}
	p := newProvider(t, microvm.Options{MemMiB: 256, ForkHook: func(snapshot string, i int) error {
		mu.Lock()
		defer mu.Unlock()
		if k, ok := fail[snapshot]; ok && k == i {
			return errors.New("injected fork failure")
		}
		return nil
	}})
	ref := stasistest.TestImage(t)
	start := time.Now()
	im, err := p.Images().Pull(ctx, ref, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("unpacked %s in %s", ref, time.Since(start).Round(time.Millisecond))
	start = time.Now()
	disk, err := microvm.RootImage(ctx, im, microvm.RootFS)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("block image %s in %s", disk, time.Since(start).Round(time.Millisecond))
	sandboxtest.Run(t, sandboxtest.Harness{
		Provider: p,
		FailFork: func(snapshot string, k int) func() {
			mu.Lock()
			fail[snapshot] = k
			mu.Unlock()
			return func() { mu.Lock(); delete(fail, snapshot); mu.Unlock() }
		},
		Retired:       p.Retired,
		HostProcesses: hostProcesses,
		ExpiryStep:    3 * time.Second,
		Image:         ref, ImageFile: "/etc/os-release", ImageText: "ID=debian",
		HostOnly: "/usr/bin/bwrap",
	})
}

func sh(t testing.TB, p sandbox.Provider, id, script string) string {
	t.Helper()
	var out, errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errb, Timeout: time.Minute})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("%q in %s: %+v %v: %s%s", script, id, res, err, out.String(), errb.String())
	}
	return out.String()
}

// reaches says whether a wget of url in the guest succeeds (within ten
// seconds). busybox 1.35's wget crashes with -T, so the bound is
// timeout(1)'s; a crash fails the test rather than passing for a refusal.
func reaches(t *testing.T, p sandbox.Provider, id, url string) bool {
	t.Helper()
	out := strings.TrimSpace(sh(t, p, id, "timeout 10 wget -q -O - "+url+" >/dev/null 2>&1; echo $?"))
	switch out {
	case "0":
		return true
	case "139":
		t.Fatalf("wget %s crashed in the guest", url)
	}
	return false
}

func uptime(t *testing.T, p sandbox.Provider, id string) float64 {
	t.Helper()
	f, err := strconv.ParseFloat(strings.Fields(sh(t, p, id, "cat /proc/uptime"))[0], 64)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// A running process, its memory and the RAM file system continue in every
// fork; uptime continues from the snapshot; the clock can be set; the
// guest reaches the host's gateway socket and nothing else.
func TestForkContinuesProcesses(t *testing.T) {
	// Every guest reaches a gateway socket of its own, which says whose.
	gwDir := t.TempDir()
	sockets := relay.NewSandboxSocketsFunc(func(id string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprintf(w, "gateway of %s saw %s", id, r.URL.Path) })
	})
	defer sockets.Close()
	p := newProvider(t, microvm.Options{GatewayDir: gwDir, GatewayServer: sockets})
	src, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, src.ID)

	if got := sh(t, p, src.ID, "wget -q -O - http://"+microvm.GatewayAddr+"/v1/models"); got != "gateway of "+src.ID+" saw /v1/models" {
		t.Fatalf("the guest's way to the gateway: %q", got)
	}
	if fi, err := os.Stat(filepath.Join(gwDir, src.ID, microvm.GatewaySocketName)); err != nil || fi.Mode()&fs.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the guest's own gateway socket: %v %v", fi, err)
	}
	// restrict=on: the host's other loopback services are out of reach.
	other, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	port := other.Addr().(*net.TCPAddr).Port
	if reaches(t, p, src.ID, fmt.Sprintf("http://10.0.2.2:%d/", port)) {
		t.Fatalf("the guest reached the host's loopback")
	}

	// The guest's users are split: the host's commands run as the agent
	// unless they ask for stasis's user, files the host writes are the
	// agent's, and the agent cannot drive the guest agent (which runs as
	// root) from inside, by loopback or by the guest's own address, while
	// the host still does (every call of this test goes through it).
	if got := sh(t, p, src.ID, `echo "$(id -u) $(id -g) $HOME"`); got != fmt.Sprintf("%d %d %s\n", sandbox.AgentUID, sandbox.AgentUID, microvm.AgentHome) {
		t.Fatalf("the agent in the guest: %q", got)
	}
	var ctlOut bytes.Buffer
	if res, err := p.Exec(ctx, src.ID, sandbox.ExecRequest{Argv: []string{"sh", "-c", "id -u; umask 077; echo stasis > /root/secret"}, User: sandbox.UserControl, Stdout: &ctlOut}); err != nil || res.ExitCode != 0 || ctlOut.String() != "0\n" {
		t.Fatalf("stasis's user in the guest: %q %+v %v", ctlOut.String(), res, err)
	}
	if err := p.WriteFile(ctx, src.ID, "/work/from-host", []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, p, src.ID, "stat -c %u:%g /work/from-host"); got != fmt.Sprintf("%d:%d\n", sandbox.AgentUID, sandbox.AgentUID) {
		t.Fatalf("a file the host wrote belongs to %q", got)
	}
	// The control: the agent reaches a guest service of its own on
	// loopback and on the guest's address, with the same wget.
	if out := sh(t, p, src.ID, `nc -ll -p 7001 -e echo reached </dev/null >/dev/null 2>&1 & l=$!
		for a in 127.0.0.1 10.0.2.15; do
			i=0; until o=$(nc -w 5 $a 7001 </dev/null 2>/dev/null) && [ -n "$o" ]; do i=$((i+1)); [ $i -le 200 ] || exit 1; sleep 0.05; done
			echo "$o"
		done; kill $l`); out != "reached\nreached\n" {
		t.Fatalf("the control: the agent's own service on loopback: %q", out)
	}
	if out := sh(t, p, src.ID, "cat /root/secret >/dev/null 2>&1 && echo reached || echo refused"); out != "refused\n" {
		t.Fatalf("the agent read a file of stasis's user: %q", out)
	}
	for _, a := range []string{"127.0.0.1", "10.0.2.15"} {
		if reaches(t, p, src.ID, fmt.Sprintf("http://%s:%d/v1/health", a, microvm.AgentPort)) {
			t.Fatalf("the agent, from inside the guest, reached the guest agent on %s", a)
		}
	}

	// A counter in memory only (a shell variable), printed to a file.
	sh(t, p, src.ID, `setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' </dev/null >/dev/null 2>&1 &
		until [ -s /tmp/count ]; do sleep 0.05; done`)
	sh(t, p, src.ID, "echo kept > /work/file")
	up := uptime(t, p, src.ID)
	pause, err := p.GuestInfo(ctx, src.ID)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := p.Snapshot(ctx, src.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	defer p.DeleteSnapshot(ctx, snap.ID)
	if !snap.KeepsProcesses || snap.NewBytes <= 0 {
		t.Fatalf("snapshot info %+v", snap)
	}
	// QEMU's stream was understood: its memory cut by guest address.
	if si, err := p.Saved(snap.ID); err != nil || !si.ByAddress() {
		t.Fatalf("the state was not cut by guest address: %+v, %v", si, err)
	}
	forks, err := p.Fork(ctx, snap.ID, 2, sandbox.ForkSpec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range forks {
		defer p.Delete(ctx, f.ID)
	}
	for _, f := range forks {
		if got := sh(t, p, f.ID, "cat /work/file"); got != "kept\n" {
			t.Fatalf("fork %s: /work/file %q", f.ID, got)
		}
		// The counter goes on from where the snapshot left it.
		first, _ := strconv.Atoi(strings.TrimSpace(sh(t, p, f.ID, "cat /tmp/count")))
		deadline := time.Now().Add(30 * time.Second)
		for {
			n, _ := strconv.Atoi(strings.TrimSpace(sh(t, p, f.ID, "cat /tmp/count")))
			if n > first {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("fork %s: the counter stopped at %d", f.ID, n)
			}
			time.Sleep(50 * time.Millisecond) // poll interval, bounded by the deadline above
		}
		if u := uptime(t, p, f.ID); u < up {
			t.Fatalf("fork %s: uptime %.2f went back from %.2f", f.ID, u, up)
		}
		if got := sh(t, p, f.ID, "wget -q -O - http://"+microvm.GatewayAddr+"/again"); got != "gateway of "+f.ID+" saw /again" {
			t.Fatalf("fork %s: the way to the gateway: %q", f.ID, got)
		}
	}
	// The forks are separate machines.
	sh(t, p, forks[0].ID, "echo zero > /work/file")
	if got := sh(t, p, forks[1].ID, "cat /work/file"); got != "kept\n" {
		t.Fatalf("fork 1 sees fork 0's write: %q", got)
	}
	// The clock, continuous: the guest lands within 50 ms of pause_wall +
	// (uptime − pause_uptime) and never goes back past the pause, though
	// the fork's QEMU started later (its wall clock read the host's).
	f, err := p.SetClock(ctx, forks[0].ID, guestclock.Target{Continuous: true, PauseWall: pause.Wall, PauseUptime: pause.Uptime})
	if err != nil {
		t.Fatal(err)
	}
	in, err := p.GuestInfo(ctx, forks[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	want := pause.Wall + (in.Uptime - pause.Uptime)
	if off := in.Wall - want; off < -0.05 || off > 0.05 || in.Wall < pause.Wall || f.After < pause.Wall {
		t.Fatalf("guest wall %.6f after a continuous SetClock (%+v): want %.6f ± 50 ms, not before the pause's %.6f", in.Wall, f, want, pause.Wall)
	}
	t.Logf("continuous clock: %.3f ms off pause_wall + (uptime − pause_uptime); the fork's wall stepped %.3f s", (in.Wall-want)*1e3, f.After-f.Before)
	// The same through the provider's exec, as providers without an agent
	// of their own do it: the in-sandbox binary's `clock set`, as stasis's
	// user, computes the target in the guest.
	var out bytes.Buffer
	res, err := p.Exec(ctx, forks[1].ID, sandbox.ExecRequest{
		Argv: []string{"/stasis/bin/stasis", "clock", "set", "--pause-wall", strconv.FormatFloat(pause.Wall, 'f', -1, 64), "--pause-uptime", strconv.FormatFloat(pause.Uptime, 'f', -1, 64)},
		User: sandbox.UserControl, Stdout: &out, Stderr: &out,
	})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("clock set through exec: %v %+v: %s", err, res, out.Bytes())
	}
	if in, err = p.GuestInfo(ctx, forks[1].ID); err != nil {
		t.Fatal(err)
	}
	want = pause.Wall + (in.Uptime - pause.Uptime)
	if off := in.Wall - want; off < -0.05 || off > 0.05 || in.Wall < pause.Wall {
		t.Fatalf("guest wall %.6f after clock set through exec (%s): want %.6f ± 50 ms", in.Wall, out.Bytes(), want)
	}
	// The agent cannot set it.
	out.Reset()
	if res, err := p.Exec(ctx, forks[1].ID, sandbox.ExecRequest{Argv: []string{"/stasis/bin/stasis", "clock", "set", "--wall", "2000000000"}, Stderr: &out}); err != nil || res.ExitCode != 1 || !strings.Contains(out.String(), "not permitted") {
		t.Fatalf("the agent's clock set: %v %+v %s", err, res, out.Bytes())
	}
	// A deleted guest's gateway socket goes with it.
	if err := p.Delete(ctx, forks[1].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(gwDir, forks[1].ID)); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("the deleted fork's gateway directory: %v", err)
	}
}

// A killed keeper leaves its QEMU running; GC finds and ends it.
func TestGCEndsQEMUOfADeadKeeper(t *testing.T) {
	p := newProvider(t, microvm.Options{})
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, info.ID)
	var keeper, qemu int
	for _, pid := range hostProcesses(info.ID) {
		b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
		if bytes.Contains(b, []byte("keeper")) {
			keeper = pid
		} else if bytes.Contains(b, []byte(microvm.QEMU)) {
			qemu = pid
		}
	}
	if keeper == 0 || qemu == 0 {
		t.Fatalf("keeper %d, QEMU %d among %v", keeper, qemu, hostProcesses(info.ID))
	}
	if err := syscall.Kill(keeper, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := p.Get(ctx, info.ID); errors.Is(err, errdefs.ErrConflict) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the sandbox of a killed keeper still reads as running")
		}
		time.Sleep(10 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if err := syscall.Kill(qemu, 0); err != nil {
		t.Fatalf("QEMU died with its keeper (%v): GC would have nothing to do", err)
	}
	reaped, err := p.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(reaped) != 1 || reaped[0] != info.ID {
		t.Fatalf("GC reaped %v, want [%s]", reaped, info.ID)
	}
	if left := hostProcesses(info.ID); len(left) > 0 {
		t.Fatalf("processes left after GC: %v", left)
	}
}

// A QEMU killed while its state streams into the store: the snapshot
// fails, nothing is stored or left staged, and the sandbox reads as not
// running.
func TestSnapshotOfAVMKilledMidSave(t *testing.T) {
	home := t.TempDir()
	p := newProvider(t, microvm.Options{Home: home, MemMiB: 256})
	info, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, info.ID)
	// Enough state that the save takes a while (about 100 MB).
	sh(t, p, info.ID, "dd if=/dev/urandom of=/tmp/fill bs=1048576 count=96 2>/dev/null")
	var qemu int
	for _, pid := range hostProcesses(info.ID) {
		if b, _ := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline")); bytes.Contains(b, []byte(microvm.QEMU)) {
			qemu = pid
		}
	}
	if qemu == 0 {
		t.Fatalf("no QEMU among %v", hostProcesses(info.ID))
	}
	staging := filepath.Join(home, "vmblobs", ".staging")
	done := make(chan error, 1)
	go func() {
		_, err := p.Snapshot(ctx, info.ID, "")
		done <- err
	}()
	// Kill QEMU once the store has staged its first chunks.
	deadline := time.Now().Add(time.Minute)
	for {
		if ents, _ := os.ReadDir(staging); len(ents) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the store never began staging the state")
		}
		select {
		case err := <-done:
			t.Fatalf("the snapshot ended (%v) before QEMU could be killed during it", err)
		case <-time.After(2 * time.Millisecond): // poll interval, bounded by the deadline above
		}
	}
	if err := syscall.Kill(qemu, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err == nil {
		t.Fatal("the snapshot of a VM killed during its save succeeded")
	} else {
		t.Logf("the snapshot failed as it should: %v", err)
	}
	if ents, err := os.ReadDir(staging); err != nil || len(ents) != 0 {
		t.Fatalf("staging left behind: %v %v", ents, err)
	}
	var blobs []string
	_ = filepath.WalkDir(filepath.Join(home, "vmblobs"), func(path string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			blobs = append(blobs, path)
		}
		return nil
	})
	if len(blobs) != 0 {
		t.Fatalf("a failed snapshot stored %d blobs: %v", len(blobs), blobs)
	}
	if _, err := p.Get(ctx, info.ID); err == nil {
		t.Fatal("the sandbox whose QEMU was killed reads as running")
	}
}

// TestForkNeedsTheSameBlockImage: a snapshot of a guest on an image forks
// only onto the very block file it was saved with: one removed, or built
// again, is refused with the reason, and no sandbox is left.
func TestForkNeedsTheSameBlockImage(t *testing.T) {
	p := newProvider(t, microvm.Options{MemMiB: 256})
	// The small image: what matters is the block file, not what is in it.
	info, err := p.Create(ctx, sandbox.Spec{Image: stasistest.BusyboxImage(t), Expiry: time.Now().Add(5 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, info.ID)
	snap, err := p.Snapshot(ctx, info.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	defer p.DeleteSnapshot(ctx, snap.ID)
	if snap.Image != info.Image || snap.Image == "" {
		t.Errorf("snapshot image %q, sandbox's %q", snap.Image, info.Image)
	}
	im, err := p.Images().Get(info.Image)
	if err != nil {
		t.Fatal(err)
	}
	disk, err := microvm.RootImage(ctx, im, microvm.RootFS)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(disk); err != nil {
		t.Fatal(err)
	}
	spec := sandbox.ForkSpec{Expiry: time.Now().Add(5 * time.Minute)}
	if _, err := p.Fork(ctx, snap.ID, 1, spec); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "missing") {
		t.Errorf("fork without the block file: %v", err)
	}
	if _, err := microvm.RootImage(ctx, im, microvm.RootFS); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Fork(ctx, snap.ID, 1, spec); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "built again") {
		t.Errorf("fork onto a block file built again: %v", err)
	}
	l, _ := p.List(ctx, nil)
	if len(l) != 1 {
		t.Errorf("sandboxes after the refused forks: %v", l)
	}
}

// TestReadOnlyBinds: a host directory given to the guests (as OpenCode's
// npm prefix is) is there, read-only even to stasis's own user, in a guest
// on the initramfs and in one on an image, and in a fork; a fork whose
// saved machine's bind disk is gone is refused; paths the guest owns are
// refused at construction.
func TestReadOnlyBinds(t *testing.T) {
	for _, bad := range []string{"relative", "/", "/work/x", "/stasis/bin", "/tmp", "/a b", "/x/../y"} {
		o := microvm.Options{Home: t.TempDir(), Exe: stasistest.Exe(), GuestBinary: stasistest.StaticBinary(t), ReadOnlyBinds: map[string]string{t.TempDir(): bad}}
		if _, err := microvm.New(ctx, o); err == nil || !strings.Contains(err.Error(), "read-only bind") {
			t.Errorf("a bind at %q: %v", bad, err)
		}
	}
	src := t.TempDir()
	if err := os.MkdirAll(filepath.Join(src, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "sub", "hello"), []byte("bound\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	home := t.TempDir()
	p := newProvider(t, microvm.Options{Home: home, ReadOnlyBinds: map[string]string{src: "/opt/tools"}})
	check := func(id string) {
		t.Helper()
		if got := sh(t, p, id, "cat /opt/tools/sub/hello"); got != "bound\n" {
			t.Errorf("%s: the bound file reads %q", id, got)
		}
		var errb bytes.Buffer
		res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sh", "-c", "echo x > /opt/tools/sub/hello"}, User: sandbox.UserControl, Stderr: &errb, Timeout: time.Minute})
		if err != nil || res.ExitCode == 0 {
			t.Errorf("%s: stasis's user wrote into the bind: %+v %v", id, res, err)
		}
	}
	expiry := time.Now().Add(5 * time.Minute)
	bare, err := p.Create(ctx, sandbox.Spec{Expiry: expiry})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, bare.ID)
	check(bare.ID)
	onImage, err := p.Create(ctx, sandbox.Spec{Image: stasistest.BusyboxImage(t), Expiry: expiry})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Delete(ctx, onImage.ID)
	check(onImage.ID)
	snap, err := p.Snapshot(ctx, onImage.ID, "")
	if err != nil {
		t.Fatal(err)
	}
	defer p.DeleteSnapshot(ctx, snap.ID)
	forks, err := p.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: expiry})
	if err != nil {
		t.Fatal(err)
	}
	check(forks[0].ID)
	if err := p.Delete(ctx, forks[0].ID); err != nil {
		t.Fatal(err)
	}
	disks, _ := filepath.Glob(filepath.Join(home, "images", "bind-*.erofs"))
	if len(disks) != 1 {
		t.Fatalf("bind disks %v: want one, shared by every guest", disks)
	}
	if err := os.Remove(disks[0]); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: expiry}); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "missing") {
		t.Errorf("fork without its bind disk: %v", err)
	}
}
