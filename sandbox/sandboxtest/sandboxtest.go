// Package sandboxtest is the conformance suite every sandbox provider
// passes: sandboxtest.Run(t, harness). It checks the contract of
// sandbox.Provider as a caller sees it: isolation of forks, what survives a
// snapshot, stale handles, all-or-nothing forks, idempotent deletes, the
// absolute expiry, and never-reused snapshot ids.
package sandboxtest

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
)

// Harness hands the suite a provider and the hooks it needs.
type Harness struct {
	Provider sandbox.Provider
	// FailFork makes the k-th sandbox (0-based) of forks of this snapshot
	// fail, and only those (other subtests fork at the same time); the
	// returned function undoes it. Required.
	FailFork func(snapshot string, k int) (undo func())
	// Retired reports how many times the provider retired a sandbox; nil
	// skips that check (a remote provider counts delete calls instead).
	Retired func(id string) int
	// HostProcesses lists the host processes that still belong to a
	// sandbox; nil when the host cannot see them.
	HostProcesses func(id string) []int
	// ExpiryStep is the shortest lease the suite gives (default 2s).
	ExpiryStep time.Duration
	// Image, when set, is the image reference every sandbox of the suite
	// is made from, and the image cases run: ImageFile (a path) holds
	// ImageText in the image, and HostOnly is a path the host has and the
	// image lacks, which no sandbox may see.
	Image                string
	ImageFile, ImageText string
	HostOnly             string
	// Skip names subtests that do not apply to the provider, each with
	// the reason (a simulated provider runs no real processes, so
	// ProcessesAcrossSnapshot and ExpiryKillsEvenAStoppedProcess, which
	// look into /proc, say why they are left out).
	Skip map[string]string
}

// Run runs the suite. Subtests run in parallel; every sandbox and snapshot
// a subtest makes is deleted before it ends.
func Run(t *testing.T, h Harness) {
	if h.ExpiryStep == 0 {
		h.ExpiryStep = 2 * time.Second
	}
	s := &suite{h: h, p: h.Provider}
	run := func(name string, f func(*testing.T)) {
		t.Run(name, func(t *testing.T) {
			if why, ok := h.Skip[name]; ok {
				t.Skip(why)
			}
			f(t)
		})
	}
	run("CreateExecFiles", s.createExecFiles)
	run("SnapshotAndForkIsolation", s.forkIsolation)
	run("ProcessesAcrossSnapshot", s.processes)
	run("StaleHandles", s.staleHandles)
	run("PartialForkIsNoFork", s.partialFork)
	run("ExpiryKillsEvenAStoppedProcess", s.expiry)
	run("SetExpiry", s.setExpiry)
	run("SnapshotIDsNeverReused", s.snapshotIDs)
	run("TypedErrors", s.typedErrors)
	if h.Image != "" {
		run("ImageFilesReadOnly", s.imageFiles)
		run("ImageKeptBySnapshotAndFork", s.imageFork)
		run("ImageShared", s.imageShared)
	}
}

type suite struct {
	h Harness
	p sandbox.Provider
}

var ctx = context.Background()

// create makes a sandbox that is deleted when the test ends.
func (s *suite) create(t *testing.T, spec sandbox.Spec) sandbox.Info {
	t.Helper()
	if spec.Expiry.IsZero() {
		spec.Expiry = time.Now().Add(10 * time.Minute)
	}
	if spec.Labels == nil {
		spec.Labels = map[string]string{}
	}
	spec.Labels["sandboxtest"] = t.Name()
	if spec.Image == "" {
		spec.Image = s.h.Image
	}
	info, err := s.p.Create(ctx, spec)
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	s.cleanup(t, info.ID)
	return info
}

func (s *suite) cleanup(t *testing.T, id string) {
	t.Cleanup(func() {
		if err := s.p.Delete(ctx, id); err != nil {
			t.Errorf("delete %s at cleanup: %v", id, err)
		}
		if s.h.HostProcesses != nil {
			if left := s.h.HostProcesses(id); len(left) > 0 {
				t.Errorf("sandbox %s left host processes %v", id, left)
			}
		}
	})
}

func (s *suite) snapshot(t *testing.T, id string) sandbox.SnapshotInfo {
	t.Helper()
	snap, err := s.p.Snapshot(ctx, id, "")
	if err != nil {
		t.Fatalf("snapshot %s: %v", id, err)
	}
	t.Cleanup(func() {
		if err := s.p.DeleteSnapshot(ctx, snap.ID); err != nil {
			t.Errorf("delete snapshot %s at cleanup: %v", snap.ID, err)
		}
	})
	return snap
}

func (s *suite) fork(t *testing.T, snap string, n int) []sandbox.Info {
	t.Helper()
	infos, err := s.p.Fork(ctx, snap, n, sandbox.ForkSpec{Labels: map[string]string{"sandboxtest": t.Name()}, Expiry: time.Now().Add(10 * time.Minute)})
	if err != nil {
		t.Fatalf("fork %s ×%d: %v", snap, n, err)
	}
	if len(infos) != n {
		t.Fatalf("fork made %d sandboxes, want %d", len(infos), n)
	}
	for _, in := range infos {
		s.cleanup(t, in.ID)
	}
	return infos
}

// sh runs a shell command and returns its stdout, failing on a non-zero exit.
func (s *suite) sh(t *testing.T, id, script string) string {
	t.Helper()
	out, code, errOut := s.run(t, id, script)
	if code != 0 {
		t.Fatalf("in %s: %q exited %d: %s", id, script, code, errOut)
	}
	return out
}

func (s *suite) run(t *testing.T, id, script string) (string, int, string) {
	t.Helper()
	var out, errb bytes.Buffer
	res, err := s.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, Stdout: &out, Stderr: &errb, Timeout: time.Minute})
	if err != nil {
		t.Fatalf("exec in %s: %v", id, err)
	}
	return out.String(), res.ExitCode, errb.String()
}

func (s *suite) read(t *testing.T, id, path string) (string, bool) {
	t.Helper()
	b, err := s.p.ReadFile(ctx, id, path)
	if errors.Is(err, errdefs.ErrNotFound) {
		return "", false
	}
	if err != nil {
		t.Fatalf("read %s in %s: %v", path, id, err)
	}
	return string(b), true
}

func (s *suite) createExecFiles(t *testing.T) {
	t.Parallel()
	info := s.create(t, sandbox.Spec{
		Files:  map[string][]byte{"/work/seed.txt": []byte("seeded\n")},
		Env:    map[string]string{"SANDBOXTEST_VAR": "from-spec"},
		Labels: map[string]string{"kind": "exec"},
	})
	if info.State != sandbox.StateRunning || info.Provider != s.p.Name() {
		t.Fatalf("created %+v", info)
	}
	if out := s.sh(t, info.ID, `echo "$SANDBOXTEST_VAR"; cat /work/seed.txt; pwd`); out != "from-spec\nseeded\n/work\n" {
		t.Fatalf("exec output %q", out)
	}
	s.execs(t, info.ID)
	s.files(t, info.ID)
	s.tars(t, info.ID)
	// Get and List.
	got, err := s.p.Get(ctx, info.ID)
	if err != nil || got.ID != info.ID || got.Labels["kind"] != "exec" {
		t.Fatalf("get %+v %v", got, err)
	}
	list, err := s.p.List(ctx, map[string]string{"kind": "exec", "sandboxtest": t.Name()})
	if err != nil || len(list) != 1 || list[0].ID != info.ID {
		t.Fatalf("list by label: %+v %v", list, err)
	}
	if list, _ := s.p.List(ctx, map[string]string{"kind": "no-such-label-value"}); len(list) != 0 {
		t.Fatalf("list matched a label no sandbox has: %+v", list)
	}
}

// execs checks that exit codes, stdin, request env and cwd pass through,
// and that a foreground timeout kills the command.
func (s *suite) execs(t *testing.T, id string) {
	t.Helper()
	var out bytes.Buffer
	res, err := s.p.Exec(ctx, id, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", `cat; echo "$X"; pwd; exit 7`}, Env: map[string]string{"X": "req"}, Cwd: "/tmp",
		Stdin: strings.NewReader("input\n"), Stdout: &out,
	})
	if err != nil || res.ExitCode != 7 || out.String() != "input\nreq\n/tmp\n" {
		t.Fatalf("exec: %+v %v %q", res, err, out.String())
	}
	// A foreground timeout kills the command.
	t0 := time.Now()
	_, err = s.p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"sleep", "30"}, Timeout: 300 * time.Millisecond})
	if !errors.Is(err, errdefs.ErrTimeout) || time.Since(t0) > 20*time.Second {
		t.Fatalf("timeout: %v after %s", err, time.Since(t0))
	}
}

// files checks WriteFile and ReadFile.
func (s *suite) files(t *testing.T, id string) {
	t.Helper()
	if err := s.p.WriteFile(ctx, id, "/work/dir/f.txt", []byte("written"), 0o640); err != nil {
		t.Fatal(err)
	}
	if got := s.sh(t, id, `cat /work/dir/f.txt; stat -c %a /work/dir/f.txt`); got != "written640\n" {
		t.Fatalf("written file seen as %q", got)
	}
	if got, ok := s.read(t, id, "/work/dir/f.txt"); !ok || got != "written" {
		t.Fatalf("read back %q %v", got, ok)
	}
	if _, ok := s.read(t, id, "/work/none"); ok {
		t.Fatal("a missing file was read")
	}
}

// tars checks Upload and Download of tar streams.
func (s *suite) tars(t *testing.T, id string) {
	t.Helper()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	for name, body := range map[string]string{"a.txt": "A", "sub/b.txt": "B"} {
		_ = tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(body)), Typeflag: tar.TypeReg})
		_, _ = tw.Write([]byte(body))
	}
	_ = tw.Close()
	if err := s.p.Upload(ctx, id, "/work/up", &tb); err != nil {
		t.Fatal(err)
	}
	if got := s.sh(t, id, `cat /work/up/a.txt /work/up/sub/b.txt`); got != "AB" {
		t.Fatalf("uploaded files read %q", got)
	}
	var dl bytes.Buffer
	if err := s.p.Download(ctx, id, "/work/up", &dl); err != nil {
		t.Fatal(err)
	}
	names := map[string]string{}
	tr := tar.NewReader(&dl)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(tr)
		names[strings.TrimPrefix(h.Name, "./")] = string(b)
	}
	if names["a.txt"] != "A" || names["sub/b.txt"] != "B" {
		t.Fatalf("downloaded %v", names)
	}
}

func (s *suite) forkIsolation(t *testing.T) {
	t.Parallel()
	src := s.create(t, sandbox.Spec{})
	s.sh(t, src.ID, `echo before > /work/before; mkdir -p /work/d/empty; echo h > "$HOME/h"; echo t > /tmp/t`)
	snap := s.snapshot(t, src.ID)
	s.sh(t, src.ID, `echo after > /work/after; echo changed > /work/before`)
	forks := s.fork(t, snap.ID, 2)
	for _, f := range forks {
		if f.Source != snap.ID && f.Source != "" {
			t.Errorf("fork %s source %q, want %s", f.ID, f.Source, snap.ID)
		}
		out := s.sh(t, f.ID, `cat /work/before; cat "$HOME/h" /tmp/t; test -d /work/d/empty && echo dir; test -e /work/after && echo LEAK || true`)
		if out != "before\nh\nt\ndir\n" {
			t.Fatalf("fork %s sees %q", f.ID, out)
		}
	}
	// Forks are independent of each other and of their source.
	s.sh(t, forks[0].ID, `echo mine > /work/only0`)
	s.sh(t, src.ID, `echo src > /work/onlysrc`)
	for _, id := range []string{forks[1].ID, src.ID} {
		if _, ok := s.read(t, id, "/work/only0"); ok {
			t.Fatalf("a write in fork 0 shows in %s", id)
		}
	}
	for _, f := range forks {
		if _, ok := s.read(t, f.ID, "/work/onlysrc"); ok {
			t.Fatalf("a write in the source after the fork shows in %s", f.ID)
		}
	}
	// The snapshot stays usable after its source is gone when the provider says so.
	if s.p.Capabilities().SnapshotOutlivesSource {
		if err := s.p.Delete(ctx, src.ID); err != nil {
			t.Fatal(err)
		}
		again := s.fork(t, snap.ID, 1)
		if out := s.sh(t, again[0].ID, `cat /work/before`); out != "before\n" {
			t.Fatalf("fork after the source's deletion sees %q", out)
		}
	}
}

func (s *suite) processes(t *testing.T) {
	t.Parallel()
	src := s.create(t, sandbox.Spec{})
	// A sleep of an unlikely length marks the process; the check compares
	// its whole command line, which the checking shell's own never equals.
	secs := fmt.Sprint(900000 + time.Now().UnixNano()%99999)
	res, err := s.p.Exec(ctx, src.ID, sandbox.ExecRequest{Argv: []string{"sleep", secs}, Background: true})
	if err != nil || res.PID <= 0 {
		t.Fatalf("background exec: %+v %v", res, err)
	}
	alive := fmt.Sprintf(`[ "$(tr '\0' ' ' < /proc/%d/cmdline 2>/dev/null)" = "sleep %s " ] && echo alive || echo gone`, res.PID, secs)
	// The pid may still be running setsid for a moment before it execs sleep.
	deadline := time.Now().Add(10 * time.Second)
	for out := s.sh(t, src.ID, alive); out != "alive\n"; out = s.sh(t, src.ID, alive) {
		if time.Now().After(deadline) {
			t.Fatalf("background process not running in its sandbox: %q", out)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
	snap := s.snapshot(t, src.ID)
	f := s.fork(t, snap.ID, 1)[0]
	want := "gone\n"
	if s.p.Capabilities().KeepsProcesses {
		want = "alive\n"
	}
	if out := s.sh(t, f.ID, alive); out != want {
		t.Fatalf("keeps_processes=%v but the process is %q in the fork", s.p.Capabilities().KeepsProcesses, out)
	}
	if out := s.sh(t, src.ID, alive); out != "alive\n" {
		t.Fatalf("the snapshot disturbed the source's process: %q", out)
	}
}

func (s *suite) staleHandles(t *testing.T) {
	t.Parallel()
	info := s.create(t, sandbox.Spec{})
	snap := s.snapshot(t, info.ID)
	if err := s.p.Delete(ctx, info.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.p.Delete(ctx, info.ID); err != nil {
		t.Fatalf("a second delete must succeed (idempotent): %v", err)
	}
	if s.h.Retired != nil {
		if n := s.h.Retired(info.ID); n != 1 {
			t.Fatalf("sandbox retired %d times, want exactly once", n)
		}
	}
	checks := map[string]error{}
	_, checks["get"] = s.p.Get(ctx, info.ID)
	_, checks["exec"] = s.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}})
	_, checks["read"] = s.p.ReadFile(ctx, info.ID, "/work/x")
	checks["write"] = s.p.WriteFile(ctx, info.ID, "/work/x", nil, 0o644)
	_, checks["snapshot"] = s.p.Snapshot(ctx, info.ID, "")
	checks["set-expiry"] = s.p.SetExpiry(ctx, info.ID, time.Now().Add(time.Hour))
	for op, err := range checks {
		if !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("%s on a deleted sandbox: %v, want ErrNotFound", op, err)
		}
	}
	if err := s.p.DeleteSnapshot(ctx, snap.ID); err != nil {
		t.Fatal(err)
	}
	if err := s.p.DeleteSnapshot(ctx, snap.ID); err != nil {
		t.Fatalf("a second snapshot delete must succeed: %v", err)
	}
	if _, err := s.p.GetSnapshot(ctx, snap.ID); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("get of a deleted snapshot: %v", err)
	}
	if _, err := s.p.Fork(ctx, snap.ID, 1, sandbox.ForkSpec{Expiry: time.Now().Add(time.Hour)}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("fork of a deleted snapshot: %v", err)
	}
}

func (s *suite) partialFork(t *testing.T) {
	t.Parallel()
	src := s.create(t, sandbox.Spec{})
	snap := s.snapshot(t, src.ID)
	label := map[string]string{"partial": t.Name()}
	undo := s.h.FailFork(snap.ID, 1)
	_, err := s.p.Fork(ctx, snap.ID, 3, sandbox.ForkSpec{Labels: label, Expiry: time.Now().Add(time.Hour)})
	undo()
	if err == nil {
		t.Fatal("a fork whose second sandbox fails reported success")
	}
	left, err := s.p.List(ctx, label)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range left {
		s.cleanup(t, l.ID)
	}
	if len(left) != 0 {
		t.Fatalf("a failed fork left %d sandboxes", len(left))
	}
	// The snapshot is still good.
	s.fork(t, snap.ID, 2)
}

func (s *suite) waitExpired(t *testing.T, id string, by time.Time) {
	t.Helper()
	for {
		_, err := s.p.Get(ctx, id)
		if errors.Is(err, errdefs.ErrExpired) || errors.Is(err, errdefs.ErrNotFound) {
			return
		}
		if err != nil {
			t.Fatalf("get while waiting for expiry: %v", err)
		}
		if time.Now().After(by) {
			t.Fatalf("sandbox %s still running after its expiry", id)
		}
		time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
	}
}

// shorten moves a sandbox's expiry to one step from now (creating it with a
// short lease instead would race with a slow create on a loaded machine).
func (s *suite) shorten(t *testing.T, id string) time.Time {
	t.Helper()
	expiry := time.Now().Add(s.h.ExpiryStep)
	if err := s.p.SetExpiry(ctx, id, expiry); err != nil {
		t.Fatal(err)
	}
	return expiry
}

func (s *suite) expiry(t *testing.T) {
	t.Parallel()
	info := s.create(t, sandbox.Spec{})
	// A process stopped with SIGSTOP (as a paused supervisor's harness is)
	// must die at the expiry too.
	// Stop it only once it has exec'd its loop: stopped between fork and
	// exec, it would keep the shell's saved copy of the exec's output pipe
	// open, and the exec would never end. The loop's shell writes its own
	// pid ($! may name a setsid that forked and exited), whole (a rename).
	s.sh(t, info.ID, `{ setsid sh -c 'echo $$ > /work/stopped.tmp && mv /work/stopped.tmp /work/stopped.pid; while :; do sleep 0.1; done' & } </dev/null >/dev/null 2>&1
		i=0
		until [ -s /work/stopped.pid ]; do i=$((i+1)); [ $i -lt 3000 ] || exit 1; sleep 0.01; done
		kill -STOP $(cat /work/stopped.pid)`)
	expiry := s.shorten(t, info.ID)
	s.waitExpired(t, info.ID, expiry.Add(10*time.Second))
	if time.Now().Before(expiry) {
		t.Fatalf("expired before its expiry %s", expiry)
	}
	if _, err := s.p.Exec(ctx, info.ID, sandbox.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, errdefs.ErrExpired) && !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("exec after expiry: %v", err)
	}
	if s.h.HostProcesses != nil {
		deadline := time.Now().Add(10 * time.Second)
		for len(s.h.HostProcesses(info.ID)) > 0 {
			if time.Now().After(deadline) {
				t.Fatalf("processes %v outlived the expiry", s.h.HostProcesses(info.ID))
			}
			time.Sleep(20 * time.Millisecond) // poll interval, bounded by the deadline above
		}
	}
}

func (s *suite) setExpiry(t *testing.T) {
	t.Parallel()
	// Shorten, then extend again: the sandbox outlives the short lease.
	ext := s.create(t, sandbox.Spec{})
	first := s.shorten(t, ext.ID)
	if err := s.p.SetExpiry(ctx, ext.ID, time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	// Shorten: a sandbox due in an hour, moved to one step from now, expires.
	short := s.create(t, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	soon := s.shorten(t, short.ID)
	s.waitExpired(t, short.ID, soon.Add(10*time.Second))
	for time.Now().Before(first.Add(time.Second)) {
		time.Sleep(20 * time.Millisecond) // let the extended sandbox pass its short lease
	}
	if got, err := s.p.Get(ctx, ext.ID); err != nil || got.State != sandbox.StateRunning {
		t.Fatalf("extended sandbox after its first expiry: %+v %v", got, err)
	}
	if err := s.p.SetExpiry(ctx, ext.ID, time.Now().Add(-time.Second)); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("an expiry in the past: %v, want ErrInvalid", err)
	}
}

func (s *suite) snapshotIDs(t *testing.T) {
	t.Parallel()
	info := s.create(t, sandbox.Spec{})
	seen := map[string]bool{}
	for i := 0; i < 6; i++ {
		s.sh(t, info.ID, fmt.Sprintf("echo %d > /work/n", i%2)) // identical contents twice over
		snap, err := s.p.Snapshot(ctx, info.ID, "")
		if err != nil {
			t.Fatal(err)
		}
		if seen[snap.ID] {
			t.Fatalf("snapshot id %s handed out twice", snap.ID)
		}
		seen[snap.ID] = true
		if i%2 == 0 { // delete some: their ids must not come back either
			if err := s.p.DeleteSnapshot(ctx, snap.ID); err != nil {
				t.Fatal(err)
			}
		} else {
			id := snap.ID
			t.Cleanup(func() { _ = s.p.DeleteSnapshot(ctx, id) })
		}
	}
}

func (s *suite) typedErrors(t *testing.T) {
	t.Parallel()
	if _, err := s.p.Get(ctx, "no-such-sandbox"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("get unknown: %v", err)
	}
	if _, err := s.p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(-time.Minute)}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("create with a past expiry: %v", err)
	}
	if _, err := s.p.GetSnapshot(ctx, "no-such-snapshot"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("get unknown snapshot: %v", err)
	}
	info := s.create(t, sandbox.Spec{})
	snap := s.snapshot(t, info.ID)
	if _, err := s.p.Fork(ctx, snap.ID, 0, sandbox.ForkSpec{Expiry: time.Now().Add(time.Hour)}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("fork of 0: %v", err)
	}
	if _, err := s.p.Exec(ctx, info.ID, sandbox.ExecRequest{}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("exec of nothing: %v", err)
	}
}

// imageFiles: a file of the image is there; the agent cannot write it;
// what stasis's own user writes over it (a microVM's overlay in RAM takes
// it; a local sandbox's read-only root does not) changes neither the
// image nor another sandbox's view of it; a path only the host has is not
// there.
func (s *suite) imageFiles(t *testing.T) {
	t.Parallel()
	info := s.create(t, sandbox.Spec{})
	other := s.create(t, sandbox.Spec{})
	if info.Image == "" {
		t.Errorf("the sandbox's info names no image: %+v", info)
	}
	if got, ok := s.read(t, info.ID, s.h.ImageFile); !ok || !strings.Contains(got, s.h.ImageText) {
		t.Errorf("%s from the image: %q (found %v), want it to hold %q", s.h.ImageFile, got, ok, s.h.ImageText)
	}
	for _, u := range []sandbox.User{sandbox.UserAgent, sandbox.UserControl} {
		var out, errb bytes.Buffer
		res, err := s.p.Exec(ctx, info.ID, sandbox.ExecRequest{User: u, Stdout: &out, Stderr: &errb, Timeout: time.Minute,
			Argv: []string{"/bin/sh", "-c", `echo stasis-wrote-this >> "$1" || exit 3; echo written`, "sh", s.h.ImageFile}})
		if err != nil {
			t.Fatal(err)
		}
		if u == sandbox.UserAgent && (res.ExitCode == 0 || strings.Contains(out.String(), "written")) {
			t.Errorf("the agent wrote to the image's %s", s.h.ImageFile)
		}
	}
	if got, ok := s.read(t, other.ID, s.h.ImageFile); !ok || strings.Contains(got, "stasis-wrote-this") {
		t.Errorf("another sandbox's %s of the image: %q (found %v)", s.h.ImageFile, got, ok)
	}
	if fresh := s.create(t, sandbox.Spec{}); true {
		if got, _ := s.read(t, fresh.ID, s.h.ImageFile); strings.Contains(got, "stasis-wrote-this") {
			t.Errorf("the image itself changed: a new sandbox's %s is %q", s.h.ImageFile, got)
		}
	}
	if s.h.HostOnly != "" {
		out, code, _ := s.run(t, info.ID, `ls -ld "`+s.h.HostOnly+`" 2>&1; exit 0`)
		_ = code
		if !strings.Contains(out, "No such file") && !strings.Contains(out, "not found") && !strings.Contains(out, "cannot access") {
			t.Errorf("the host's %s shows in a sandbox with an image: %s", s.h.HostOnly, out)
		}
	}
	if out := s.sh(t, info.ID, `echo w > /work/w && cat /work/w && echo t > /tmp/t && cat /tmp/t`); out != "w\nt\n" {
		t.Errorf("the writable places with an image: %q", out)
	}
}

// imageFork: a snapshot and its forks keep the image under the writable
// places.
func (s *suite) imageFork(t *testing.T) {
	t.Parallel()
	src := s.create(t, sandbox.Spec{})
	s.sh(t, src.ID, `echo mine > /work/mine`)
	snap := s.snapshot(t, src.ID)
	forks := s.fork(t, snap.ID, 2)
	for _, f := range forks {
		if f.Image != src.Image {
			t.Errorf("fork %s: image %q, its source's %q", f.ID, f.Image, src.Image)
		}
		if got, _ := s.read(t, f.ID, s.h.ImageFile); !strings.Contains(got, s.h.ImageText) {
			t.Errorf("fork %s: the image's %s: %q", f.ID, s.h.ImageFile, got)
		}
		if got, _ := s.read(t, f.ID, "/work/mine"); got != "mine\n" {
			t.Errorf("fork %s: /work/mine: %q", f.ID, got)
		}
	}
}

// imageShared: two sandboxes of one image see the same file system (one
// copy, not one each).
func (s *suite) imageShared(t *testing.T) {
	t.Parallel()
	a, b := s.create(t, sandbox.Spec{}), s.create(t, sandbox.Spec{})
	if a.Image != b.Image || a.Image == "" {
		t.Errorf("images %q and %q", a.Image, b.Image)
	}
	q := `stat -c '%d:%i' "` + s.h.ImageFile + `"`
	if x, y := s.sh(t, a.ID, q), s.sh(t, b.ID, q); x != y {
		t.Errorf("%s is %s in one sandbox and %s in the other: not one copy", s.h.ImageFile, x, y)
	}
}
