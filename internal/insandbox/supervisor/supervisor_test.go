package supervisor_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"stasis/internal/insandbox/supervisor"
	"stasis/internal/proc"
	"stasis/internal/stasistest"
	"stasis/internal/testwait"
)

func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == probeArg {
		os.Exit(runProbe(os.Args[2:]))
	}
	stasistest.Main(m)
}

var ctx = context.Background()

// harness is a test's supervisor with the processes it has seen, so that
// cleanup can prove every one of them is gone.
type harness struct {
	t   *testing.T
	c   *supervisor.Child
	dir string
	mu  sync.Mutex
	ids map[proc.Identity]string
}

func start(t *testing.T, flags []string, script string, args ...string) *harness {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "session")
	argv := append([]string{"/bin/sh", "-c", script, "harness"}, args...)
	c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
		Exe: os.Args[0], Env: stasistest.Env, Dir: dir,
		Flags: append([]string{"--log-level", "warn"}, flags...), Argv: argv,
		Stdout: os.Stderr, Stderr: os.Stderr,
	})
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, c: c, dir: dir, ids: map[proc.Identity]string{}}
	h.track()
	t.Cleanup(h.cleanup)
	return h
}

// track records every process now below the supervisor.
func (h *harness) track() []proc.Stat {
	d, err := proc.Descendants(h.c.Cmd.Process.Pid)
	if err != nil {
		h.t.Fatal(err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ids[proc.Identity{PID: h.c.Cmd.Process.Pid}] = "supervisor"
	for _, s := range d {
		h.ids[proc.Identity{PID: s.PID, StartTime: s.StartTime}] = s.Comm
	}
	return d
}

// cleanup ends the supervisor if the test left it running, then checks that
// no process the test saw survives.
func (h *harness) cleanup() {
	select {
	case <-h.c.Done():
	default:
		if _, err := h.c.Stop(ctx, 30*time.Second); err != nil {
			h.t.Errorf("stop at cleanup: %v", err)
			h.c.Kill()
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var alive []string
		h.mu.Lock()
		for id, comm := range h.ids {
			if id.StartTime == 0 {
				continue
			}
			if proc.Alive(id) {
				alive = append(alive, fmt.Sprintf("%d (%s)", id.PID, comm))
			}
		}
		h.mu.Unlock()
		// Children of the test process as a whole are checked once all
		// tests are done (stasistest.Main): parallel tests share it.
		if len(alive) == 0 {
			break
		}
		if time.Now().After(deadline) {
			h.t.Errorf("processes left behind: %v", alive)
			break
		}
		time.Sleep(10 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	if h.c.Cmd.ProcessState != nil && h.c.Cmd.ProcessState.ExitCode() == 66 {
		h.t.Error("the supervisor exited 66: the race detector reported a race (see stderr)")
	}
}

func (h *harness) do(op string, seq int64) *supervisor.Response {
	h.t.Helper()
	r, err := h.c.Call(ctx, supervisor.Request{Op: op, Seq: seq})
	if err != nil {
		h.t.Fatal(err)
	}
	return r
}

func (h *harness) ok(op string, seq int64) *supervisor.Response {
	h.t.Helper()
	r := h.do(op, seq)
	if !r.OK {
		h.t.Fatalf("%s %d: %s (%s)", op, seq, r.Error, r.Code)
	}
	return r
}

func (h *harness) status() supervisor.Status { return *h.ok(supervisor.OpStatus, 0).Status }

func eventually(t *testing.T, what string, timeout time.Duration, cond func() bool) {
	t.Helper()
	testwait.Until(t, what, timeout, cond)
}

func size(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// treeScript starts a child, a grandchild (in a nested subshell), and a
// child that called setsid, each appending to its own file in $1, and then
// the main process appends too.
const treeScript = `
d="$1"
loop() { while :; do echo x >> "$d/$1"; sleep 0.01; done; }
loop child &
( ( loop grandchild ) & wait ) &
setsid sh -c 'while :; do echo x >> "$0/setsid"; sleep 0.01; done' "$d" &
loop main
`

var treeFiles = []string{"main", "child", "grandchild", "setsid"}

func growing(t *testing.T, dir string) {
	t.Helper()
	for _, f := range treeFiles {
		p := filepath.Join(dir, f)
		before := size(p)
		eventually(t, p+" grows", 10*time.Second, func() bool { return size(p) > before })
	}
}

// harnessTree lists the harness processes: everything below the supervisor
// but its direct child, the shim.
func harnessTree(t *testing.T, h *harness) []proc.Stat {
	var out []proc.Stat
	for _, s := range h.track() {
		if s.PPID != h.c.Cmd.Process.Pid {
			out = append(out, s)
		}
	}
	return out
}

func same(a, b *supervisor.Ack) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

func TestStopPauseFreezesWholeTree(t *testing.T) {
	t.Parallel()
	out := t.TempDir()
	// A generous confirm timeout: a writer can sit in D (disk sleep) for
	// seconds on a loaded machine; this test is about freezing, not timing.
	h := start(t, []string{"--mode", "stop", "--stop-confirm-timeout", "60s"}, treeScript, out)
	growing(t, out)
	tree := harnessTree(t, h)
	sids := map[int]bool{}
	for _, s := range tree {
		sids[s.SID] = true
	}
	if len(tree) < 6 || len(sids) < 2 {
		t.Fatalf("expected a tree of at least 6 processes in 2 sessions, got %d in %d", len(tree), len(sids))
	}

	a := h.ok(supervisor.OpPause, 1).Ack
	if !a.Confirmed || a.Mode != supervisor.ModeStop || a.Seq != 1 || a.Op != "pause" {
		t.Fatalf("ack %+v", a)
	}
	// Every process of the tree, setsid'd ones included, is stopped now.
	for _, s := range harnessTree(t, h) {
		states, err := proc.TaskStates(s.PID)
		if err != nil {
			continue
		}
		for _, st := range states {
			if !proc.Stopped(st) {
				t.Errorf("pid %d (%s, sid %d) in state %c after a confirmed stop pause", s.PID, s.Comm, s.SID, st)
			}
		}
	}
	sizes := map[string]int64{}
	for _, f := range treeFiles {
		sizes[f] = size(filepath.Join(out, f))
	}
	time.Sleep(200 * time.Millisecond) // observation window: a frozen tree writes nothing in it
	for _, f := range treeFiles {
		if got := size(filepath.Join(out, f)); got != sizes[f] {
			t.Errorf("%s grew from %d to %d while paused", f, sizes[f], got)
		}
	}
	if st := h.status(); st.State != "paused" || st.Seq != 1 {
		t.Fatalf("status %+v", st)
	}
	c := h.ok(supervisor.OpContinue, 1).Ack
	if !c.Confirmed || c.Relaunched == nil || *c.Relaunched {
		t.Fatalf("continue ack %+v", c)
	}
	growing(t, out)

	// The acknowledgements are on disk, as returned.
	for _, name := range []string{"1.pause.json", "1.continue.json"} {
		b, err := os.ReadFile(filepath.Join(h.dir, "acks", name))
		if err != nil {
			t.Fatal(err)
		}
		var onDisk supervisor.Ack
		if err := json.Unmarshal(b, &onDisk); err != nil {
			t.Fatal(err)
		}
		want := a
		if strings.Contains(name, "continue") {
			want = c
		}
		if onDisk.Wall != want.Wall || onDisk.Op != want.Op {
			t.Errorf("%s differs from the reply: %+v vs %+v", name, onDisk, want)
		}
	}
	rc, err := h.c.Stop(ctx, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !rc.CleanupConfirmed || rc.TimedOut || !rc.Stopped {
		t.Fatalf("receipt %+v", rc)
	}
}

func TestHoldPauseTouchesNothing(t *testing.T) {
	t.Parallel()
	out := t.TempDir()
	h := start(t, []string{"--mode", "hold"}, treeScript, out)
	growing(t, out)
	t0 := time.Now()
	a := h.ok(supervisor.OpPause, 1).Ack
	if !a.Confirmed || a.Mode != supervisor.ModeHold || a.RelayDelivered != nil {
		t.Fatalf("ack %+v", a)
	}
	t.Logf("hold acknowledged in %s", time.Since(t0))
	growing(t, out) // it keeps writing while held
	for _, s := range harnessTree(t, h) {
		if states, err := proc.TaskStates(s.PID); err == nil && strings.ContainsAny(string(states), "Tt") {
			t.Errorf("pid %d (%s) stopped during a hold pause", s.PID, s.Comm)
		}
	}
	if st := h.status(); st.State != "paused" || st.Mode != supervisor.ModeHold {
		t.Fatalf("status %+v", st)
	}
	// The hold's acknowledgement is written after the reply, and before
	// the next request is answered: it is on disk now, as it was returned.
	checkAckFile(t, h.dir, "1.pause.json", a)
	c := h.ok(supervisor.OpContinue, 1).Ack
	growing(t, out)
	// The continue's: after the reply, so poll for it.
	testwait.Until(t, "the continue's acknowledgement file", 10*time.Second, func() bool {
		_, err := os.Stat(filepath.Join(h.dir, "acks", "1.continue.json"))
		return err == nil
	})
	checkAckFile(t, h.dir, "1.continue.json", c)
}

// checkAckFile checks that the acknowledgement file name in dir's acks
// holds want.
func checkAckFile(t *testing.T, dir, name string, want *supervisor.Ack) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "acks", name))
	if err != nil {
		t.Fatal(err)
	}
	var onDisk supervisor.Ack
	if err := json.Unmarshal(b, &onDisk); err != nil {
		t.Fatal(err)
	}
	if onDisk.Wall != want.Wall || onDisk.Op != want.Op || onDisk.Seq != want.Seq || onDisk.Mode != want.Mode {
		t.Errorf("%s differs from the reply: %+v vs %+v", name, onDisk, *want)
	}
}

// dstateSource stays in uninterruptible sleep: the parent waits in vfork
// while its child sleeps before exec; SIGSTOP cannot stop it.
const dstateSource = `#include <unistd.h>
int main(void) {
	pid_t p = vfork();
	if (p == 0) { sleep(3600); _exit(0); }
	return 0;
}
`

func buildDState(t *testing.T) string {
	t.Helper()
	if _, err := exec.LookPath("gcc"); err != nil {
		t.Fatalf("gcc is needed to build the D-state helper (make test installs it): %v", err)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "dstate.c")
	if err := os.WriteFile(src, []byte(dstateSource), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "dstate")
	if out, err := exec.Command("gcc", "-O0", "-o", bin, src).CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	return bin
}

func TestUninterruptibleSleepIsNotConfirmedAndRelaunches(t *testing.T) {
	t.Parallel()
	bin := buildDState(t)
	out := filepath.Join(t.TempDir(), "log")
	h := start(t, []string{"--mode", "stop", "--stop-confirm-timeout", "500ms",
		"--resume-cmd", fmt.Sprintf("echo resumed >> %s; exec sleep 60", out)},
		`echo started >> "$1"; exec "$2"`, out, bin)
	var dpid int
	eventually(t, "the helper is in D state", 10*time.Second, func() bool {
		for _, s := range harnessTree(t, h) {
			if s.State == 'D' {
				dpid = s.PID
				return true
			}
		}
		return false
	})
	first := h.status().HarnessPID
	t0 := time.Now()
	a := h.ok(supervisor.OpPause, 1).Ack
	took := time.Since(t0)
	if a.Confirmed {
		t.Fatalf("a tree with a D-state process was confirmed stopped: %+v", a)
	}
	if !strings.Contains(a.Note, fmt.Sprintf("pid %d", dpid)) || !strings.Contains(a.Note, "state D") {
		t.Errorf("note does not name the D-state process %d: %q", dpid, a.Note)
	}
	if took < 500*time.Millisecond || took > 10*time.Second {
		t.Errorf("unconfirmed pause answered after %s; the confirm timeout is 500ms", took)
	}
	// The tree is gone while paused.
	if n := len(harnessTree(t, h)); n != 0 {
		t.Fatalf("%d harness processes alive after an unconfirmed pause", n)
	}
	st := h.status()
	if st.State != "paused" || st.Confirmed == nil || *st.Confirmed {
		t.Fatalf("status %+v", st)
	}
	// Repeating the pause returns the same acknowledgement.
	if again := h.ok(supervisor.OpPause, 1).Ack; again.Wall != a.Wall || again.Confirmed {
		t.Fatalf("repeat %+v vs %+v", again, a)
	}
	c := h.ok(supervisor.OpContinue, 1).Ack
	if c.Relaunched == nil || !*c.Relaunched || !c.Confirmed {
		t.Fatalf("continue ack %+v", c)
	}
	eventually(t, "the resume command ran", 10*time.Second, func() bool {
		b, _ := os.ReadFile(out)
		return strings.Contains(string(b), "resumed")
	})
	st = h.status()
	if st.Relaunches != 1 || st.HarnessPID == first || st.State != "running" {
		t.Fatalf("status after relaunch %+v", st)
	}
	h.track()
	rc, err := h.c.Stop(ctx, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if rc.Relaunches != 1 || !rc.CleanupConfirmed {
		t.Fatalf("receipt %+v", rc)
	}
}

func TestDeadlineCreditsPausedTime(t *testing.T) {
	for _, mode := range []string{"stop", "hold"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			out := filepath.Join(t.TempDir(), "log")
			h := start(t, []string{"--mode", mode, "--deadline", "2s", "--grace", "1s"},
				`trap 'echo term >> "$1"; exit 143' TERM; while :; do echo x >> "$1"; sleep 0.02; done`, out)
			started := time.Now()
			eventually(t, "the harness writes", 5*time.Second, func() bool { return size(out) > 0 })
			h.ok(supervisor.OpPause, 1)
			time.Sleep(3 * time.Second) // the pause under test lasts 3 s; longer than the whole budget
			st := h.status()
			if st.State != "paused" || st.DeadlineLeft == nil || *st.DeadlineLeft <= 0 {
				t.Fatalf("after a 3 s pause with a 2 s deadline: %+v", st)
			}
			h.ok(supervisor.OpContinue, 1)
			before := size(out)
			eventually(t, "the harness runs after the continue", 5*time.Second, func() bool { return size(out) > before })
			if st := h.status(); st.State != "running" {
				t.Fatalf("status after continue %+v", st)
			}
			if err := h.c.Wait(15 * time.Second); err == nil {
				t.Fatal("supervisor exited 0 after a timeout; want 124")
			}
			elapsed := time.Since(started)
			rc, err := supervisor.ReadReceipt(h.dir)
			if err != nil {
				t.Fatal(err)
			}
			if !rc.TimedOut || rc.PausedTotal < 3 || !rc.CleanupConfirmed {
				t.Fatalf("receipt %+v", rc)
			}
			if elapsed < 5*time.Second {
				t.Fatalf("timed out after %s; budget 2 s plus 3 s paused", elapsed)
			}
			if code := h.c.Cmd.ProcessState.ExitCode(); code != 124 {
				t.Fatalf("supervisor exit code %d, want 124", code)
			}
			b, _ := os.ReadFile(out)
			if !strings.Contains(string(b), "term") {
				t.Fatal("the harness did not get SIGTERM before the kill")
			}
		})
	}
}

func TestIdentityAndFiles(t *testing.T) {
	t.Parallel()
	h := start(t, nil, "exec sleep 60")
	// The status may come before the supervisor has launched the harness.
	var st supervisor.Status
	eventually(t, "the harness runs", 10*time.Second, func() bool { st = h.status(); return st.HarnessPID != 0 })
	want, err := proc.IdentityOf(h.c.Cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	if st.Identity != want {
		t.Fatalf("status identity %v, /proc says %v", st.Identity, want)
	}
	var info supervisor.Info
	b, err := os.ReadFile(filepath.Join(h.dir, supervisor.InfoFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &info); err != nil || info.Identity != want || info.Mode != supervisor.ModeStop {
		t.Fatalf("supervisor.json %+v %v", info, err)
	}
	fi, err := os.Stat(filepath.Join(h.dir, supervisor.SocketFile))
	if err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("control socket %v %v", fi.Mode(), err)
	}
	hs, err := proc.ReadStat(st.HarnessPID)
	if err != nil || hs.SID != st.HarnessPID || hs.PGID != st.HarnessPID {
		t.Fatalf("harness %+v must lead its own session and group (%v)", hs, err)
	}
	a := h.ok(supervisor.OpPause, 5).Ack
	if a.Identity != want || a.Wall <= 0 || a.Uptime <= 0 {
		t.Fatalf("ack %+v", a)
	}
	up, _ := proc.Uptime()
	if a.Uptime > up || up-a.Uptime > 60 {
		t.Fatalf("ack uptime %v, /proc/uptime %v", a.Uptime, up)
	}
	if d := float64(time.Now().UnixNano())/1e9 - a.Wall; d < 0 || d > 60 {
		t.Fatalf("ack wall %v is %v s from now", a.Wall, d)
	}
}

func TestSequenceNumbersOverTheSocket(t *testing.T) {
	t.Parallel()
	h := start(t, nil, "exec sleep 60")
	expectRefused := func(op string, seq int64, says string) {
		t.Helper()
		before := h.status()
		r := h.do(op, seq)
		if r.OK || r.Code != supervisor.CodeRefused || !strings.Contains(r.Error, says) || r.Status == nil {
			t.Fatalf("%s %d: %+v, want refused saying %q", op, seq, r, says)
		}
		if after := h.status(); after.State != before.State || after.Seq != before.Seq {
			t.Fatalf("a refused request changed the state: %+v -> %+v", before, after)
		}
	}
	expectRefused("continue", 1, "no pause is in force")
	p2 := h.ok("pause", 2).Ack
	if again := h.ok("pause", 2).Ack; !same(again, p2) {
		t.Fatalf("repeated pause differs: %+v vs %+v", again, p2)
	}
	expectRefused("pause", 3, "pause 2 is in force")
	expectRefused("pause", 1, "pause 2 is in force")
	expectRefused("continue", 1, "the pause in force is 2")
	c2 := h.ok("continue", 2).Ack
	if again := h.ok("continue", 2).Ack; !same(again, c2) {
		t.Fatal("repeated continue differs")
	}
	expectRefused("pause", 2, "above the last one (2)")
	expectRefused("pause", 1, "above the last one (2)")
	expectRefused("continue", 3, "no pause is in force")
	h.ok("pause", 10)
	h.ok("continue", 10)
}

func rawRequest(t *testing.T, dir string, payload []byte) (supervisor.Response, error) {
	c, err := net.Dial("unix", filepath.Join(dir, supervisor.SocketFile))
	if err != nil {
		return supervisor.Response{}, err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(payload); err != nil {
		return supervisor.Response{}, err
	}
	_ = c.(*net.UnixConn).CloseWrite()
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		return supervisor.Response{}, err
	}
	var r supervisor.Response
	return r, json.Unmarshal(line, &r)
}

func TestMalformedRequestsNeverCrashIt(t *testing.T) {
	t.Parallel()
	h := start(t, nil, "exec sleep 60")
	inputs := [][]byte{
		[]byte("\n"), []byte("{\n"), []byte("not json\n"), []byte(`{"op":"pause","seq":-1}` + "\n"),
		[]byte(`{"op":"pause","seq":"x"}` + "\n"), []byte(`{"op":"explode"}` + "\n"), []byte(`{"op":"pause"`),
		[]byte(strings.Repeat("A", 100000)), {0, 1, 2, 255, '\n'}, []byte(`{"op":"continue","seq":1e400}` + "\n"),
	}
	rng := rand.New(rand.NewSource(1))
	for i := 0; i < 200; i++ {
		b := make([]byte, rng.Intn(300))
		rng.Read(b)
		inputs = append(inputs, append(b, '\n'))
	}
	for _, in := range inputs {
		r, err := rawRequest(t, h.dir, in)
		if err != nil {
			continue // the supervisor may close on garbage; it must still be up below
		}
		if r.OK {
			t.Fatalf("input %.40q accepted: %+v", in, r)
		}
		if r.Code != supervisor.CodeInvalid || r.Error == "" {
			t.Fatalf("input %.40q: %+v", in, r)
		}
	}
	if st := h.status(); st.State != "running" || st.Seq != 0 {
		t.Fatalf("state changed by malformed input: %+v", st)
	}
}

func TestOtherUIDIsRefused(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to act as another uid; CI runs as root")
	}
	t.Parallel()
	base, err := os.MkdirTemp("", "stasis-peer-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(base)
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(base, "s")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
		Exe: os.Args[0], Env: stasistest.Env, Dir: dir,
		Flags: []string{"--log-level", "error"}, Argv: []string{"sleep", "60"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if _, err := c.Stop(ctx, 30*time.Second); err != nil {
			t.Error(err)
		}
	}()
	sock := filepath.Join(dir, supervisor.SocketFile)
	// Open the socket's file mode so that only the peer check stands in the way.
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	type result struct {
		line string
		err  error
	}
	done := make(chan result)
	go func() {
		// This goroutine's thread alone takes uid 65534 and is then thrown
		// away (the goroutine ends locked), so no other thread is affected.
		runtime.LockOSThread()
		if _, _, e := unix.RawSyscall(unix.SYS_SETRESUID, ^uintptr(0), 65534, ^uintptr(0)); e != 0 {
			done <- result{err: e}
			return
		}
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			done <- result{err: err}
			return
		}
		defer unix.Close(fd)
		if err := unix.Connect(fd, &unix.SockaddrUnix{Name: sock}); err != nil {
			done <- result{err: err}
			return
		}
		_, _ = unix.Write(fd, []byte(`{"op":"pause","seq":1}`+"\n"))
		buf := make([]byte, 4096)
		n, _ := unix.Read(fd, buf)
		done <- result{line: string(buf[:max(n, 0)])}
	}()
	r := <-done
	if r.err != nil {
		t.Fatal(r.err)
	}
	var resp supervisor.Response
	if err := json.Unmarshal([]byte(r.line), &resp); err != nil {
		t.Fatalf("reply %q: %v", r.line, err)
	}
	if resp.OK || resp.Code != supervisor.CodeDenied {
		t.Fatalf("a peer of another uid got %+v", resp)
	}
	st, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpStatus})
	if err != nil || st.Status.State != "running" || st.Status.Seq != 0 {
		t.Fatalf("state after the denied request: %+v %v", st, err)
	}
}

func TestSupervisorKilledLeavesNothing(t *testing.T) {
	t.Parallel()
	out := t.TempDir()
	h := start(t, nil, treeScript, out)
	growing(t, out)
	tree := h.track()
	if len(tree) < 7 { // shim + at least 6 harness processes
		t.Fatalf("tree too small: %d", len(tree))
	}
	// Pause it first: a stopped tree must be cleaned up too.
	h.ok(supervisor.OpPause, 1)
	h.c.Kill()
	eventually(t, "every harness process is gone after SIGKILL to the supervisor", 15*time.Second, func() bool {
		for _, s := range tree {
			if proc.Alive(proc.Identity{PID: s.PID, StartTime: s.StartTime}) {
				return false
			}
		}
		return true
	})
}

func TestHarnessExitEndsSupervisor(t *testing.T) {
	t.Parallel()
	out := t.TempDir()
	// The harness leaves a setsid'd daemon behind and exits 3.
	h := start(t, nil, `setsid sh -c 'while :; do sleep 0.05; done' & echo $! > "$1/daemon"; exit 3`, out)
	if err := h.c.Wait(15 * time.Second); err == nil {
		t.Fatal("supervisor exited 0; want the harness's 3")
	}
	if code := h.c.Cmd.ProcessState.ExitCode(); code != 3 {
		t.Fatalf("exit code %d, want 3", code)
	}
	rc, err := supervisor.ReadReceipt(h.dir)
	if err != nil {
		t.Fatal(err)
	}
	if rc.ReturnCode == nil || *rc.ReturnCode != 3 || !rc.CleanupConfirmed || rc.TimedOut || rc.Error != "" {
		t.Fatalf("receipt %+v", rc)
	}
	// status and stop answer from the receipt; pause is refused.
	r, err := supervisor.Call(ctx, h.dir, supervisor.Request{Op: supervisor.OpStatus})
	if err != nil || r.Status.State != "exited" {
		t.Fatalf("%+v %v", r, err)
	}
	r, err = supervisor.Call(ctx, h.dir, supervisor.Request{Op: supervisor.OpPause, Seq: 1})
	if err != nil || r.OK || r.Code != supervisor.CodeRefused || !strings.Contains(r.Error, "exited") {
		t.Fatalf("%+v %v", r, err)
	}
	b, _ := os.ReadFile(filepath.Join(out, "daemon"))
	var pid int
	fmt.Sscan(string(b), &pid)
	if pid == 0 {
		t.Fatal("daemon pid not recorded")
	}
	if _, err := proc.ReadStat(pid); err == nil {
		t.Fatalf("the setsid'd daemon %d outlived its supervisor", pid)
	}
}

func TestSecondSupervisorInSameDirIsRefused(t *testing.T) {
	t.Parallel()
	h := start(t, nil, "exec sleep 60")
	cmd := exec.Command(os.Args[0], "supervise", "--dir", h.dir, "--", "true")
	cmd.Env = append(os.Environ(), stasistest.Env[0])
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), "served by a running supervisor") {
		t.Fatalf("second supervisor: %v\n%s", err, out)
	}
	if st := h.status(); st.State != "running" {
		t.Fatalf("%+v", st)
	}
}

// TestLongSessionPath uses a session directory whose socket path is beyond
// the kernel's 108-byte limit for unix socket addresses.
func TestLongSessionPath(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), strings.Repeat("d", 60), strings.Repeat("e", 60))
	c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
		Exe: os.Args[0], Env: stasistest.Env, Dir: dir,
		Flags: []string{"--log-level", "error"}, Argv: []string{"sleep", "60"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(filepath.Join(dir, supervisor.SocketFile)) <= 108 {
		t.Fatal("the path is not long enough to test anything")
	}
	if _, err := c.Do(ctx, supervisor.Request{Op: supervisor.OpPause, Seq: 1}); err != nil {
		t.Fatal(err)
	}
	rc, err := c.Stop(ctx, 30*time.Second)
	if err != nil || !rc.CleanupConfirmed {
		t.Fatalf("%+v %v", rc, err)
	}
}

// TestSIGTERMToSupervisorEndsGracefully: SIGTERM to the supervisor ends the
// harness as a stop request does; a harness that ignores SIGTERM is killed
// after the grace period.
func TestSIGTERMToSupervisorEndsGracefully(t *testing.T) {
	t.Parallel()
	out := filepath.Join(t.TempDir(), "log")
	h := start(t, []string{"--grace", "500ms"}, `trap 'echo ignored-term >> "$1"' TERM; echo ready >> "$1"; while :; do sleep 0.05; done`, out)
	eventually(t, "the harness set its trap", 10*time.Second, func() bool { return size(out) > 0 })
	h.track()
	t0 := time.Now()
	if err := h.c.Cmd.Process.Signal(unix.SIGTERM); err != nil {
		t.Fatal(err)
	}
	_ = h.c.Wait(15 * time.Second)
	if took := time.Since(t0); took < 500*time.Millisecond {
		t.Fatalf("ended after %s, before the 500ms grace period", took)
	}
	rc, err := supervisor.ReadReceipt(h.dir)
	if err != nil {
		t.Fatal(err)
	}
	if !rc.Stopped || rc.TimedOut || !rc.CleanupConfirmed || rc.ReturnCode == nil || *rc.ReturnCode != -9 {
		t.Fatalf("receipt %+v", rc)
	}
	eventually(t, "the harness saw SIGTERM", 5*time.Second, func() bool {
		b, _ := os.ReadFile(out)
		return strings.Contains(string(b), "ignored-term")
	})
}

func TestHarnessThatCannotStart(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "s")
	cmd := exec.Command(os.Args[0], "supervise", "--dir", dir, "--log-level", "error", "--", "/nonexistent/harness")
	cmd.Env = append(os.Environ(), stasistest.Env[0])
	out, err := cmd.CombinedOutput()
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != 1 || !strings.Contains(string(out), "/nonexistent/harness") {
		t.Fatalf("exit %v, output %s", err, out)
	}
	rc, err := supervisor.ReadReceipt(dir)
	if err != nil {
		t.Fatal(err)
	}
	if rc.ReturnCode != nil || !strings.Contains(rc.Error, "/nonexistent/harness") || !rc.CleanupConfirmed {
		t.Fatalf("receipt %+v", rc)
	}
	if kids, _ := proc.Descendants(os.Getpid()); len(kids) != 0 {
		// Other parallel tests may have children; only a shim would be ours.
		for _, k := range kids {
			if k.Comm == "stasis-shim" && k.PPID == 1 {
				t.Fatalf("orphaned shim %d", k.PID)
			}
		}
	}
}

// TestRestartInUsedDirectory: a new supervisor in a directory left by a
// finished one moves the earlier run's files aside instead of losing them.
func TestRestartInUsedDirectory(t *testing.T) {
	t.Parallel()
	h := start(t, nil, "exit 0")
	if err := h.c.Wait(15 * time.Second); err != nil {
		t.Fatal(err)
	}
	old, err := supervisor.ReadReceipt(h.dir)
	if err != nil {
		t.Fatal(err)
	}
	// Earlier runs, more than are kept: the oldest go.
	base := time.Now().Add(-time.Hour)
	for i := range supervisor.KeptRuns + 3 {
		d := filepath.Join(h.dir, supervisor.RunsDir, fmt.Sprintf("older-%02d", i))
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
		at := base.Add(time.Duration(i) * time.Minute)
		if err := os.Chtimes(d, at, at); err != nil {
			t.Fatal(err)
		}
	}
	c, err := supervisor.Spawn(ctx, supervisor.SpawnOptions{
		Exe: os.Args[0], Env: stasistest.Env, Dir: h.dir,
		Flags: []string{"--log-level", "error"}, Argv: []string{"sleep", "60"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Stop(ctx, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	moved := filepath.Join(h.dir, supervisor.RunsDir, fmt.Sprintf("%d-%d", old.Identity.PID, old.Identity.StartTime), supervisor.ReceiptFile)
	if _, err := os.Stat(moved); err != nil {
		t.Fatalf("earlier receipt not kept: %v", err)
	}
	ents, err := os.ReadDir(filepath.Join(h.dir, supervisor.RunsDir))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if len(names) != supervisor.KeptRuns || slices.Contains(names, "older-03") || !slices.Contains(names, "older-04") {
		t.Fatalf("runs kept: %v; want the %d newest (the one just moved aside, older-04 to older-10)", names, supervisor.KeptRuns)
	}
}

// TestStopPauseCatchesVforkChildren pauses a shell that runs external
// commands back to back (dash starts them with vfork) many times: a SIGSTOP
// that lands between a vfork and its exec must not leave the parent in D
// and the pause unconfirmed.
func TestStopPauseCatchesVforkChildren(t *testing.T) {
	t.Parallel()
	h := start(t, []string{"--mode", "stop", "--stop-confirm-timeout", "10s"}, `while :; do /bin/true; done`)
	for i := int64(1); i <= 100; i++ {
		if a := h.ok(supervisor.OpPause, i).Ack; !a.Confirmed {
			t.Fatalf("pause %d not confirmed: %s", i, a.Note)
		}
		h.ok(supervisor.OpContinue, i)
	}
}

// cgroup2Mount is where a cgroup v2 file system is mounted here ("" when
// none is).
func cgroup2Mount(t *testing.T) string {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 2 && f[2] == "cgroup2" {
			return f[1]
		}
	}
	return ""
}

// TestHoldFreezeFreezesWholeTree: in hold+freeze mode the whole harness
// tree (a setsid child too) is in the harness's control group from its
// start, a pause freezes it (the kernel says frozen, and no process shows
// a stop: the freeze is invisible), the acknowledgement says frozen, the
// continue thaws it, and the group is gone once the supervisor is.
func TestHoldFreezeFreezesWholeTree(t *testing.T) {
	t.Parallel()
	root := cgroup2Mount(t)
	if root == "" {
		t.Skip("no cgroup v2 file system on this machine: hold+freeze cannot run here")
	}
	out := t.TempDir()
	h := start(t, []string{"--mode", "hold", "--freeze", "--cgroup-root", root}, treeScript, out)
	growing(t, out)
	own, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", h.c.Cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	var rel string
	for _, line := range strings.Split(string(own), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			rel = p
		}
	}
	group := filepath.Join(root, rel, fmt.Sprintf("stasis-harness-%d", h.c.Cmd.Process.Pid))
	events := func() string {
		b, _ := os.ReadFile(filepath.Join(group, "cgroup.events"))
		return string(b)
	}
	a := h.ok(supervisor.OpPause, 1).Ack
	if !a.Confirmed || !a.Frozen || a.Mode != supervisor.ModeHoldFreeze {
		t.Fatalf("ack %+v", a)
	}
	if !strings.Contains(events(), "frozen 1") {
		t.Fatalf("cgroup.events after the pause: %q", events())
	}
	procs, err := os.ReadFile(filepath.Join(group, "cgroup.procs"))
	if err != nil {
		t.Fatal(err)
	}
	in := map[string]bool{}
	for _, p := range strings.Fields(string(procs)) {
		in[p] = true
	}
	tree := harnessTree(t, h)
	if len(tree) < 4 {
		t.Fatalf("harness tree %+v: want the script and its children", tree)
	}
	for _, s := range tree {
		if !in[strconv.Itoa(s.PID)] {
			t.Errorf("pid %d (%s) is outside the harness's control group", s.PID, s.Comm)
		}
		if states, err := proc.TaskStates(s.PID); err == nil && strings.ContainsAny(string(states), "Tt") {
			t.Errorf("pid %d (%s) shows a stop during a freeze", s.PID, s.Comm)
		}
	}
	if st := h.status(); st.State != "paused" || !st.Frozen {
		t.Fatalf("status %+v", st)
	}
	c := h.ok(supervisor.OpContinue, 1).Ack
	if !c.Confirmed || c.Frozen || *c.Relaunched {
		t.Fatalf("continue %+v", c)
	}
	if !strings.Contains(events(), "frozen 0") {
		t.Fatalf("cgroup.events after the continue: %q", events())
	}
	growing(t, out)
	// A stop during a freeze still ends the tree.
	h.ok(supervisor.OpPause, 2)
	if _, err := h.c.Stop(ctx, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(group); !os.IsNotExist(err) {
		t.Errorf("the harness's control group outlived the supervisor: %v", err)
	}
}
