package agent_test

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"stasis/errdefs"
	"stasis/internal/proc"
	"stasis/internal/providers/microvm/agent"
	"stasis/internal/stasistest"
	"stasis/internal/testwait"
	"stasis/sandbox"
)

func TestMain(m *testing.M) { stasistest.Main(m) }

// syncBuffer is a bytes.Buffer safe for a writer and a poller at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// start runs an agent on a loopback port until the test ends, and returns
// a client for it. Its log is shown when the test fails.
func start(t *testing.T) *agent.Client {
	t.Helper()
	c, _ := startConfig(t, agent.Config{})
	return c
}

// startConfig is start with a configuration; it also returns the log.
func startConfig(t *testing.T, cfg agent.Config) (*agent.Client, *syncBuffer) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	logs := &syncBuffer{}
	log := slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	done := make(chan error, 1)
	cfg.Log = log
	go func() { done <- agent.ServeConfig(ctx, ln, cfg) }()
	c := agent.New("http://" + ln.Addr().String())
	t.Cleanup(func() {
		c.CloseIdle()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
		if t.Failed() {
			t.Logf("agent log:\n%s", logs.String())
		}
	})
	return c, logs
}

// waitFor polls cond until it holds, failing the test after 20 seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testwait.Until(t, what, 20*time.Second, cond)
}

// gone reports whether a process no longer runs (a zombie counts as gone
// when it is not ours to reap).
func gone(pid int) bool {
	st, err := proc.ReadStat(pid)
	return errors.Is(err, proc.ErrNoProcess) || (err == nil && st.State == 'Z' && st.PPID != os.Getpid())
}

// killIfOurs kills a process at the end of the test if it is still a child
// of the test process (the agent runs in it), so a failed test leaves
// nothing behind.
func killIfOurs(t *testing.T, pid int) {
	t.Cleanup(func() {
		if st, err := proc.ReadStat(pid); err == nil && st.PPID == os.Getpid() && st.State != 'Z' {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	})
}

func readPIDs(path string) []int {
	b, _ := os.ReadFile(path)
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			pids = append(pids, n)
		}
	}
	return pids
}

// sh runs a shell script in dir with extra arguments ($1, $2, ...).
func sh(script, dir string, args ...string) sandbox.ExecRequest {
	return sandbox.ExecRequest{Argv: append([]string{"/bin/sh", "-c", script, "sh"}, args...), Cwd: dir, Timeout: time.Minute}
}

func TestStreamsOutputAsItComes(t *testing.T) {
	t.Parallel()
	c := start(t)
	dir := t.TempDir()
	flag := filepath.Join(dir, "go-on")
	out := &syncBuffer{}
	type result struct {
		res sandbox.ExecResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		req := sh(`echo first; while [ ! -e "$1" ]; do sleep 0.01; done; echo second`, dir, flag)
		req.Stdout = out
		res, err := c.Exec(context.Background(), req)
		done <- result{res, err}
	}()
	// The first line arrives while the command still waits for the file.
	waitFor(t, "the first line", func() bool { return out.String() == "first\n" })
	if err := os.WriteFile(flag, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	r := <-done
	if r.err != nil || r.res.ExitCode != 0 || out.String() != "first\nsecond\n" {
		t.Fatalf("exec: %+v %v %q", r.res, r.err, out.String())
	}
}

func TestExitCodesAndStderr(t *testing.T) {
	t.Parallel()
	c := start(t)
	dir := t.TempDir()
	ctx := context.Background()
	if err := os.WriteFile(filepath.Join(dir, "not-executable"), []byte("#!/bin/sh\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		req            sandbox.ExecRequest
		code           int
		stdout, stderr string
	}{
		{sh(`echo out; echo err >&2; exit 7`, dir), 7, "out\n", "err\n"},
		{sh(`exit 0`, dir), 0, "", ""},
		{sandbox.ExecRequest{Argv: []string{"false"}, Cwd: dir}, 1, "", ""},
		{sh(`kill -TERM $$`, dir), -int(unix.SIGTERM), "", ""},
		{sh(`kill -KILL $$`, dir), -int(unix.SIGKILL), "", ""},
		{sandbox.ExecRequest{Argv: []string{"no-such-command-anywhere"}, Cwd: dir}, 127, "", "stasis agent: no-such-command-anywhere: command not found\n"},
		{sandbox.ExecRequest{Argv: []string{"./not-executable"}, Cwd: dir}, 126, "", ""},
		{sandbox.ExecRequest{Argv: []string{"true"}, Cwd: filepath.Join(dir, "missing")}, 125, "", ""},
	} {
		var out, errb bytes.Buffer
		tc.req.Stdout, tc.req.Stderr = &out, &errb
		res, err := c.Exec(ctx, tc.req)
		if err != nil || res.ExitCode != tc.code || out.String() != tc.stdout || (tc.stderr != "" && errb.String() != tc.stderr) {
			t.Errorf("%q: %+v %v stdout %q stderr %q; want exit %d, %q, %q", tc.req.Argv, res, err, out.String(), errb.String(), tc.code, tc.stdout, tc.stderr)
		}
		if tc.code >= 125 && errb.Len() == 0 {
			t.Errorf("%q: exit %d with no message on stderr", tc.req.Argv, tc.code)
		}
	}
	// No command is invalid, before and at the agent.
	if _, err := c.Exec(ctx, sandbox.ExecRequest{}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("exec of nothing: %v", err)
	}
	if _, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"true"}, Env: map[string]string{"A=B": "x"}, Cwd: dir}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("exec with a bad variable name: %v", err)
	}
}

func TestTimeoutKillsTheProcessGroup(t *testing.T) {
	t.Parallel()
	c := start(t)
	dir := t.TempDir()
	pids := filepath.Join(dir, "pids")
	// A grandchild in the command's process group, and one in a session of
	// its own (it still holds the output pipe).
	req := sh(`sleep 1000 & echo $! >> "$1"; setsid sleep 1001 & echo $! >> "$1"; echo $$ >> "$1"; wait`, dir, pids)
	req.Timeout = 1500 * time.Millisecond
	t0 := time.Now()
	res, err := c.Exec(context.Background(), req)
	took := time.Since(t0)
	got := readPIDs(pids)
	for _, pid := range got {
		killIfOurs(t, pid)
	}
	if !errors.Is(err, errdefs.ErrTimeout) || res.ExitCode != -int(unix.SIGKILL) {
		t.Fatalf("exec past its timeout: %+v %v", res, err)
	}
	if took < req.Timeout || took > req.Timeout+10*time.Second {
		t.Fatalf("exec with a %s timeout returned after %s", req.Timeout, took)
	}
	if len(got) != 3 {
		t.Fatalf("the script wrote pids %v before its timeout (a loaded machine?)", got)
	}
	for _, pid := range got {
		waitFor(t, "process "+strconv.Itoa(pid)+" to be killed", func() bool { return gone(pid) })
	}
}

func TestCancelKillsTheCommand(t *testing.T) {
	t.Parallel()
	c := start(t)
	dir := t.TempDir()
	pids := filepath.Join(dir, "pids")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(ctx, sh(`echo $$ >> "$1"; sleep 1000 & echo $! >> "$1"; wait`, dir, pids))
		done <- err
	}()
	waitFor(t, "the pids", func() bool { return len(readPIDs(pids)) == 2 })
	got := readPIDs(pids)
	for _, pid := range got {
		killIfOurs(t, pid)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled exec: %v", err)
	}
	for _, pid := range got {
		waitFor(t, "process "+strconv.Itoa(pid)+" to be killed", func() bool { return gone(pid) })
	}

	// The same while stdin is still streaming (the body has not ended).
	pidFile := filepath.Join(dir, "pid2")
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	defer pw.Close()
	go func() {
		req := sh(`echo $$ > "$1"; exec sleep 1000`, dir, pidFile)
		req.Stdin = pr
		_, err := c.Exec(ctx, req)
		done <- err
	}()
	if _, err := pw.Write([]byte("some input\n")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the pid", func() bool { return len(readPIDs(pidFile)) == 1 })
	pid := readPIDs(pidFile)[0]
	killIfOurs(t, pid)
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled exec: %v", err)
	}
	waitFor(t, "process "+strconv.Itoa(pid)+" to be killed", func() bool { return gone(pid) })

	// The same when the caller's stdout fails: Exec returns at once.
	pidFile = filepath.Join(dir, "pid3")
	req := sh(`echo $$ > "$1"; echo output; exec sleep 1000`, dir, pidFile)
	req.Stdout = failingWriter{}
	if _, err := c.Exec(context.Background(), req); err == nil || !strings.Contains(err.Error(), "broken writer") {
		t.Fatalf("exec with a failing stdout: %v", err)
	}
	pid = readPIDs(pidFile)[0]
	killIfOurs(t, pid)
	waitFor(t, "process "+strconv.Itoa(pid)+" to be killed", func() bool { return gone(pid) })
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("broken writer") }

func TestShutdownKillsForegroundCommands(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	served := make(chan error, 1)
	go func() { served <- agent.Serve(ctx, ln, nil) }()
	c := agent.New("http://" + ln.Addr().String())
	defer c.CloseIdle()
	dir := t.TempDir()
	pids := filepath.Join(dir, "pids")
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(context.Background(), sh(`echo $$ > "$1"; exec sleep 1000`, dir, pids))
		done <- err
	}()
	waitFor(t, "the pid", func() bool { return len(readPIDs(pids)) == 1 })
	pid := readPIDs(pids)[0]
	killIfOurs(t, pid)
	stop()
	if err := <-served; err != nil {
		t.Fatalf("Serve after its context ended: %v", err)
	}
	if err := <-done; err == nil {
		t.Fatal("exec went on after the agent stopped")
	}
	if !gone(pid) { // Serve returned after its handlers, which reaped it
		t.Fatalf("process %d outlived the agent", pid)
	}
	if err := c.Health(context.Background()); err == nil {
		t.Fatal("a stopped agent answered")
	}
}

func TestBackground(t *testing.T) {
	t.Parallel()
	c := start(t)
	dir := t.TempDir()
	logPath := filepath.Join(dir, "logs", "deeper", "bg.log") // directories missing
	flag := filepath.Join(dir, "go-on")
	req := sh(`echo started; echo on-stderr >&2; while [ ! -e "$1" ]; do sleep 0.01; done; echo finished`, dir, flag)
	req.Background, req.LogPath = true, logPath
	req.Stdout = &bytes.Buffer{} // ignored
	res, err := c.Exec(context.Background(), req)
	if err != nil || res.PID <= 0 {
		t.Fatalf("background exec: %+v %v", res, err)
	}
	killIfOurs(t, res.PID)
	log := func() string { b, _ := os.ReadFile(logPath); return string(b) }
	waitFor(t, "the log", func() bool { return log() == "started\non-stderr\n" })
	st, err := proc.ReadStat(res.PID)
	if err != nil || st.SID != res.PID || st.PGID != res.PID || st.PPID != os.Getpid() {
		t.Fatalf("background process %d: %+v %v; want its own session, a child of the agent", res.PID, st, err)
	}
	if err := os.WriteFile(flag, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	// It ends and the agent reaps it: no zombie stays.
	waitFor(t, "the background process to be reaped", func() bool {
		_, err := proc.ReadStat(res.PID)
		return errors.Is(err, proc.ErrNoProcess)
	})
	if got := log(); got != "started\non-stderr\nfinished\n" {
		t.Fatalf("log %q", got)
	}

	// Output is appended; with no log it goes nowhere; a relative log is
	// relative to cwd.
	res, err = c.Exec(context.Background(), sandbox.ExecRequest{Argv: []string{"echo", "again"}, Cwd: dir, Background: true, LogPath: "logs/deeper/bg.log"})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the appended line", func() bool { return log() == "started\non-stderr\nfinished\nagain\n" })
	res, err = c.Exec(context.Background(), sandbox.ExecRequest{Argv: []string{"echo", "lost"}, Cwd: dir, Background: true})
	if err != nil || res.PID <= 0 {
		t.Fatalf("background exec without a log: %+v %v", res, err)
	}
	waitFor(t, "the second background process to be reaped", func() bool {
		_, err := proc.ReadStat(res.PID)
		return errors.Is(err, proc.ErrNoProcess)
	})
	if _, err := c.Exec(context.Background(), sandbox.ExecRequest{Argv: []string{"no-such-command-anywhere"}, Cwd: dir, Background: true}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("background exec of a missing command: %v", err)
	}
}

func TestStdinAndEnv(t *testing.T) {
	t.Parallel()
	c := start(t)
	dir := t.TempDir()
	ctx := context.Background()
	var out bytes.Buffer
	req := sh(`cat; echo "$X"; pwd; exit 7`, dir)
	req.Env, req.Stdin, req.Stdout = map[string]string{"X": "req"}, strings.NewReader("input\n"), &out
	res, err := c.Exec(ctx, req)
	if err != nil || res.ExitCode != 7 || out.String() != "input\nreq\n"+dir+"\n" {
		t.Fatalf("exec: %+v %v %q", res, err, out.String())
	}

	// Stdin streams: the command answers a line before the next is sent.
	pr, pw := io.Pipe()
	echo := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"cat"}, Cwd: dir, Stdin: pr, Stdout: echo})
		done <- err
	}()
	if _, err := pw.Write([]byte("ping\n")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the echo of the first line", func() bool { return echo.String() == "ping\n" })
	if _, err := pw.Write([]byte("pong\n")); err != nil {
		t.Fatal(err)
	}
	pw.Close()
	if err := <-done; err != nil || echo.String() != "ping\npong\n" {
		t.Fatalf("streamed stdin: %v %q", err, echo.String())
	}

	// The environment is the base plus the request's, nothing of the agent's.
	env := func(vars map[string]string) []string {
		var out bytes.Buffer
		if _, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"env"}, Env: vars, Cwd: dir, Stdout: &out}); err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(strings.TrimSpace(out.String()), "\n")
		slices.Sort(lines)
		return lines
	}
	path := "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	if got, want := env(nil), []string{"HOME=/root", path}; !slices.Equal(got, want) {
		t.Fatalf("base environment %q, want %q", got, want)
	}
	if got, want := env(map[string]string{"X": "a b", "HOME": "/h"}), []string{"HOME=/h", path, "X=a b"}; !slices.Equal(got, want) {
		t.Fatalf("environment %q, want %q", got, want)
	}
}

func TestFiles(t *testing.T) {
	t.Parallel()
	c := start(t)
	dir := t.TempDir()
	ctx := context.Background()
	p := filepath.Join(dir, "a", "b", "f.txt")
	if err := c.WriteFile(ctx, p, []byte("written"), 0o640); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode() != 0o640 {
		t.Fatalf("written file: %v %v", fi.Mode(), err)
	}
	if b, err := c.ReadFile(ctx, p); err != nil || string(b) != "written" {
		t.Fatalf("read back %q %v", b, err)
	}
	// Overwrite: new content and mode, no temporary file left.
	if err := c.WriteFile(ctx, p, []byte("again"), 0o755|fs.ModeSetuid); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode() != 0o755|fs.ModeSetuid {
		t.Fatalf("rewritten file: %v %v", fi.Mode(), err)
	}
	if names, _ := os.ReadDir(filepath.Dir(p)); len(names) != 1 {
		t.Fatalf("directory holds %v after writes", names)
	}
	// A long name still leaves room for the temporary file's.
	long := filepath.Join(dir, strings.Repeat("n", 250))
	if err := c.WriteFile(ctx, long, []byte("l"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Empty data.
	if err := c.WriteFile(ctx, filepath.Join(dir, "empty"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := c.ReadFile(ctx, filepath.Join(dir, "empty")); err != nil || len(b) != 0 {
		t.Fatalf("empty file: %q %v", b, err)
	}
	// A symlink writes the file it points to.
	link := filepath.Join(dir, "link")
	if err := os.Symlink("a/b/f.txt", link); err != nil {
		t.Fatal(err)
	}
	if err := c.WriteFile(ctx, link, []byte("through"), 0o644); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(p); string(b) != "through" {
		t.Fatalf("write through a symlink: target holds %q", b)
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		t.Fatalf("the symlink was replaced: %v %v", fi, err)
	}
	// Missing files and directories are not found; writing over a
	// directory or under a file is invalid.
	for _, missing := range []string{filepath.Join(dir, "none"), filepath.Join(p, "under-a-file"), dir} {
		if _, err := c.ReadFile(ctx, missing); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("read %s: %v, want ErrNotFound", missing, err)
		}
	}
	for _, bad := range []string{dir, filepath.Join(p, "under-a-file")} {
		if err := c.WriteFile(ctx, bad, []byte("x"), 0o644); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("write %s: %v, want ErrInvalid", bad, err)
		}
	}
}

// entry describes one thing in a tree, for comparing trees.
type entry struct {
	Mode  fs.FileMode
	MTime time.Time
	Data  string // file content or symlink target
}

func tree(t *testing.T, dir string) map[string]entry {
	t.Helper()
	out := map[string]entry{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		e := entry{Mode: fi.Mode()}
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			e.Data, err = os.Readlink(p)
		case fi.Mode().IsRegular():
			var b []byte
			b, err = os.ReadFile(p)
			e.Data, e.MTime = string(b), fi.ModTime()
		default:
			e.MTime = fi.ModTime()
		}
		out[rel] = e
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func inode(t *testing.T, p string) uint64 {
	t.Helper()
	fi, err := os.Lstat(p)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Sys().(*syscall.Stat_t).Ino
}

func TestTarRoundTrip(t *testing.T) {
	t.Parallel()
	c := start(t)
	ctx := context.Background()
	src := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "d", "empty"), 0o755))
	must(os.WriteFile(filepath.Join(src, "d", "f"), []byte("file f"), 0o644))
	must(os.WriteFile(filepath.Join(src, "run.sh"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	must(os.WriteFile(filepath.Join(src, "secret"), []byte("s"), 0o600))
	must(os.Link(filepath.Join(src, "d", "f"), filepath.Join(src, "d", "hard")))
	must(os.Symlink("f", filepath.Join(src, "d", "rel-link")))
	must(os.Symlink("/nonexistent/elsewhere", filepath.Join(src, "abs-link")))
	// Modes and times last: a write into a directory changes its time.
	for i, p := range []string{"d/f", "run.sh", "secret", "d/empty", "d", "."} {
		mt := time.Date(2021, 3, 4, 5, 6, 7, 123456789, time.UTC).Add(time.Duration(i) * time.Hour)
		must(os.Chtimes(filepath.Join(src, p), mt, mt))
	}
	must(os.Chmod(filepath.Join(src, "d"), 0o750))
	must(os.Chmod(filepath.Join(src, "d", "empty"), 0o700))

	var tb bytes.Buffer
	must(c.Download(ctx, src, &tb))
	names := map[string]byte{}
	tr := tar.NewReader(bytes.NewReader(tb.Bytes()))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(err)
		names[h.Name] = h.Typeflag
	}
	for name, typ := range map[string]byte{"./": tar.TypeDir, "./d/": tar.TypeDir, "./d/f": tar.TypeReg, "./run.sh": tar.TypeReg, "./d/rel-link": tar.TypeSymlink} {
		if names[name] != typ {
			t.Errorf("downloaded tar: %q has type %q, want %q (all: %q)", name, names[name], typ, names)
		}
	}
	if names["./d/hard"] != tar.TypeLink && names["./d/f"] != tar.TypeLink {
		t.Errorf("downloaded tar keeps no hard link: %q", names)
	}

	dst := filepath.Join(t.TempDir(), "new", "dst") // made by the upload
	must(c.Upload(ctx, dst, bytes.NewReader(tb.Bytes())))
	want, got := tree(t, src), tree(t, dst)
	for name, w := range want {
		g, ok := got[name]
		if !ok || g.Mode != w.Mode || g.Data != w.Data || !g.MTime.Equal(w.MTime) {
			t.Errorf("%s: uploaded %+v, want %+v", name, g, w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("uploaded tree has %d entries, want %d", len(got), len(want))
	}
	if inode(t, filepath.Join(dst, "d", "f")) != inode(t, filepath.Join(dst, "d", "hard")) {
		t.Error("the hard link became a copy")
	}
	// Uploading again over the tree replaces files and links in place.
	must(c.Upload(ctx, dst, bytes.NewReader(tb.Bytes())))
	if got := tree(t, dst); len(got) != len(want) {
		t.Errorf("second upload: %d entries, want %d", len(got), len(want))
	}

	if err := c.Download(ctx, filepath.Join(src, "none"), io.Discard); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("download of a missing directory: %v", err)
	}
	if err := c.Download(ctx, filepath.Join(src, "secret"), io.Discard); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("download of a file: %v", err)
	}
}

func tarOf(t *testing.T, hs ...*tar.Header) []byte {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, h := range hs {
		if h.Typeflag == tar.TypeReg {
			h.Size = int64(len("pwned"))
		}
		if h.Mode == 0 {
			h.Mode = 0o644
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			_, _ = tw.Write([]byte("pwned"))
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return b.Bytes()
}

func TestUploadRefusesEscapes(t *testing.T) {
	t.Parallel()
	c := start(t)
	ctx := context.Background()
	base := t.TempDir()
	dst := filepath.Join(base, "dst")
	outside := filepath.Join(base, "outside")
	if err := os.MkdirAll(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dst, 0o755); err != nil {
		t.Fatal(err)
	}
	// A symlink already in the directory, leading out of it.
	if err := os.Symlink(outside, filepath.Join(dst, "old-link")); err != nil {
		t.Fatal(err)
	}
	reg := func(name string) *tar.Header { return &tar.Header{Name: name, Typeflag: tar.TypeReg} }
	sym := func(name, target string) *tar.Header {
		return &tar.Header{Name: name, Typeflag: tar.TypeSymlink, Linkname: target}
	}
	cases := map[string][]byte{
		"dot-dot":           tarOf(t, reg("../outside/pwned")),
		"dot-dot-inside":    tarOf(t, reg("a/../../outside/pwned")),
		"absolute":          tarOf(t, reg(filepath.Join(outside, "pwned"))),
		"symlink-absolute":  tarOf(t, sym("esc", outside), reg("esc/pwned")),
		"symlink-relative":  tarOf(t, sym("esc2", "../outside"), reg("esc2/pwned")),
		"symlink-dir-chain": tarOf(t, &tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755}, sym("d/up", ".."), sym("d/up2", "up/.."), reg("d/up2/outside/pwned")),
		"existing-symlink":  tarOf(t, reg("old-link/pwned")),
		"hardlink-dot-dot":  tarOf(t, &tar.Header{Name: "hl", Typeflag: tar.TypeLink, Linkname: "../outside/target"}),
		"hardlink-absolute": tarOf(t, &tar.Header{Name: "hl", Typeflag: tar.TypeLink, Linkname: filepath.Join(outside, "target")}),
		"hardlink-via-link": tarOf(t, &tar.Header{Name: "hl", Typeflag: tar.TypeLink, Linkname: "old-link/target"}),
		"not-a-tar":         bytes.Repeat([]byte("garbage!"), 200),
		"truncated":         tarOf(t, reg("ok"))[:300],
	}
	if err := os.WriteFile(filepath.Join(outside, "target"), []byte("keep"), 0o644); err != nil {
		t.Fatal(err)
	}
	for name, b := range cases {
		err := c.Upload(ctx, dst, bytes.NewReader(b))
		if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: upload %v, want ErrInvalid", name, err)
		} else if !strings.Contains(err.Error(), "upload") {
			t.Errorf("%s: unclear error %q", name, err)
		} else {
			t.Logf("%s: %v", name, err)
		}
	}
	// Nothing outside dst changed.
	if names, _ := os.ReadDir(outside); len(names) != 1 || names[0].Name() != "target" {
		t.Fatalf("outside holds %v", names)
	}
	if b, _ := os.ReadFile(filepath.Join(outside, "target")); string(b) != "keep" {
		t.Fatalf("outside/target holds %q", b)
	}
	if names, _ := os.ReadDir(base); len(names) != 2 {
		t.Fatalf("base holds %v", names)
	}
	// Uploading into a file is invalid.
	if err := c.Upload(ctx, filepath.Join(outside, "target"), bytes.NewReader(tarOf(t, reg("x")))); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("upload into a file: %v", err)
	}
}

func TestInfoAndHealth(t *testing.T) {
	t.Parallel()
	c := start(t)
	ctx := context.Background()
	if err := c.Health(ctx); err != nil {
		t.Fatal(err)
	}
	in, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(in.WallTime()); d < -5*time.Second || d > 5*time.Second {
		t.Errorf("wall %v is %s off the host's", in.WallTime(), d)
	}
	up, err := proc.Uptime()
	if err != nil {
		t.Fatal(err)
	}
	if in.Uptime <= 0 || in.Uptime > up || up-in.Uptime > 5 {
		t.Errorf("uptime %v, host's %v", in.Uptime, up)
	}
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if in.BootID == "" || in.BootID != strings.TrimSpace(string(boot)) {
		t.Errorf("boot id %q, want %q", in.BootID, boot)
	}
	if in.PID != os.Getpid() {
		t.Errorf("pid %d, want %d", in.PID, os.Getpid())
	}
	// An agent that is not there is an error, soon.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	if err := agent.New("http://" + addr).Health(ctx); err == nil {
		t.Error("health of no agent succeeded")
	}
}

// TestUsersSplit runs the agent with the guest's users split, as a guest
// does: a command runs as the agent (no groups, its HOME) unless it asks
// for stasis's user; the files the host writes are the agent's, and none
// reaches a file of stasis's, through a symlink the agent planted either;
// a background command's log is opened as its user.
func TestUsersSplit(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run commands as another user; CI runs as root")
	}
	t.Parallel()
	const uid = 1000
	base, err := os.MkdirTemp("", "stasis-agent-users-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	work, home, secret := filepath.Join(base, "work"), filepath.Join(base, "home"), filepath.Join(base, "secret")
	for _, d := range []string{work, home, secret} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{work, home} {
		if err := os.Chown(d, uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	token := filepath.Join(secret, "token.json")
	if err := os.WriteFile(token, []byte("stasis's"), 0o600); err != nil {
		t.Fatal(err)
	}
	c, _ := startConfig(t, agent.Config{Users: &agent.Users{UID: uid, GID: uid, Home: home}})
	ctx := context.Background()
	run := func(user sandbox.User, script string) (string, int) {
		t.Helper()
		var out bytes.Buffer
		res, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script}, Cwd: work, User: user, Stdout: &out, Stderr: &out})
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(out.String()), res.ExitCode
	}
	ids := `echo "$(id -u) $(id -g) $HOME"; grep -E '^(Groups|CapEff):' /proc/self/status | tr -s '\t ' ' '`
	if got, _ := run(sandbox.UserAgent, ids); got != fmt.Sprintf("%d %d %s\nGroups: \nCapEff: 0000000000000000", uid, uid, home) {
		t.Errorf("as the agent: %q", got)
	}
	if got, _ := run(sandbox.UserControl, `echo "$(id -u) $HOME"`); got != "0 /root" {
		t.Errorf("as stasis's user: %q", got)
	}
	if got, code := run(sandbox.UserAgent, "cat "+token); code == 0 {
		t.Errorf("the agent read stasis's token: %q", got)
	}
	if _, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"true"}, User: "root"}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("an unknown user: %v, want ErrInvalid", err)
	}

	// Files the host writes are the agent's.
	owner := func(p string) (uint32, uint32) {
		t.Helper()
		fi, err := os.Lstat(p)
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		return st.Uid, st.Gid
	}
	f := filepath.Join(work, "new", "f.txt")
	if err := c.WriteFile(ctx, f, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{f, filepath.Dir(f)} {
		if u, g := owner(p); u != uid || g != uid {
			t.Errorf("%s belongs to %d:%d, want the agent's", p, u, g)
		}
	}
	if err := c.Upload(ctx, filepath.Join(work, "up"), bytes.NewReader(tarOf(t,
		&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755}, &tar.Header{Name: "d/f", Typeflag: tar.TypeReg}))); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"up", "up/d", "up/d/f"} {
		if u, g := owner(filepath.Join(work, p)); u != uid || g != uid {
			t.Errorf("uploaded %s belongs to %d:%d, want the agent's", p, u, g)
		}
	}

	// Nothing the host writes for the agent reaches stasis's files.
	evil := filepath.Join(work, "evil")
	if err := os.Symlink(token, evil); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(evil, uid, uid); err != nil {
		t.Fatal(err)
	}
	if err := c.WriteFile(ctx, evil, []byte("forged"), 0o644); err == nil {
		t.Errorf("a write through the agent's symlink to stasis's token succeeded")
	}
	if err := c.WriteFile(ctx, filepath.Join(secret, "planted"), []byte("x"), 0o644); err == nil {
		t.Errorf("a write into stasis's directory succeeded")
	}
	if err := c.Upload(ctx, secret, bytes.NewReader(tarOf(t, &tar.Header{Name: "planted", Typeflag: tar.TypeReg}))); err == nil {
		t.Errorf("an upload into stasis's directory succeeded")
	}
	if err := c.Upload(ctx, work, bytes.NewReader(tarOf(t, &tar.Header{Name: "evil", Typeflag: tar.TypeReg}))); err != nil {
		t.Logf("upload over the agent's symlink: %v", err) // replacing the agent's own link is allowed; its target must not change
	}
	if _, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"true"}, Background: true, LogPath: filepath.Join(work, "up", "log")}); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(token, filepath.Join(work, "log-link")); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"echo", "appended"}, Background: true, LogPath: filepath.Join(work, "log-link")}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("a background command's log through the agent's symlink to stasis's token: %v, want ErrInvalid", err)
	}
	if b, err := os.ReadFile(token); err != nil || string(b) != "stasis's" {
		t.Errorf("stasis's token now holds %q (%v)", b, err)
	}
	if names, _ := os.ReadDir(secret); len(names) != 1 {
		t.Errorf("stasis's directory holds %v", names)
	}
	// stasis's own commands still write where the agent cannot.
	if _, code := run(sandbox.UserControl, "echo ok > "+filepath.Join(secret, "control")); code != 0 {
		t.Errorf("stasis's user could not write its own directory")
	}
}

// TestHostOnlyRefusesTheGuest: with HostOnly, a connection from the
// agent's own machine (here loopback, in a guest also its own address) is
// closed unanswered, and logged.
func TestHostOnlyRefusesTheGuest(t *testing.T) {
	t.Parallel()
	c, logs := startConfig(t, agent.Config{HostOnly: true})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.Health(ctx); err == nil {
		t.Fatal("a loopback client was answered")
	}
	var out bytes.Buffer
	if _, err := c.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", "echo ran"}, Stdout: &out}); err == nil || out.Len() > 0 {
		t.Fatalf("a loopback client's exec: %v %q", err, out.String())
	}
	waitFor(t, "the refusal logged", func() bool { return strings.Contains(logs.String(), "refused a connection from inside the guest") })
}
