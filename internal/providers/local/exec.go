package local

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"stasis/errdefs"
	"stasis/internal/fileop"
	"stasis/internal/proc"
	"stasis/sandbox"
)

// defaultPath is PATH inside a sandbox when neither the spec nor the
// request sets one.
const defaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// command builds the host command that runs argv inside the sandbox: nsenter
// into its namespaces and root, drop every capability, and start from a
// clean environment in the working directory. (nsenter's --wd=DIR would
// resolve DIR before changing root, so env -C changes directory instead.)
func (p *Provider) command(m meta, k keeperInfo, req sandbox.ExecRequest) *exec.Cmd {
	env := map[string]string{"PATH": defaultPath, "HOME": m.Home, "LANG": "C.UTF-8", "STASIS_SANDBOX": m.ID}
	for _, kv := range m.ImageEnv {
		if k, v, ok := strings.Cut(kv, "="); ok && k != "HOME" {
			env[k] = v
		}
	}
	for k, v := range m.Env {
		env[k] = v
	}
	for k, v := range req.Env {
		env[k] = v
	}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	cwd := req.Cwd
	if cwd == "" {
		cwd = "/work"
	}
	args := []string{"--target", strconv.Itoa(k.Init.PID)}
	if m.UIDBase != 0 {
		args = append(args, "--user")
	}
	args = append(args, "--mount", "--uts", "--ipc", "--net", "--pid", "--root", "--wd", "--")
	var cmdEnv []string
	if m.Image != "" {
		// The image has neither the host's setpriv nor, maybe, an env:
		// the in-sandbox binary becomes the user, with the environment
		// nsenter passes on.
		args = append(args, EnterBinary)
		args = append(args, m.enterRequest(req.User, cwd, req.Argv).Args()...)
		cmdEnv = make([]string, 0, len(keys))
		for _, k := range keys {
			cmdEnv = append(cmdEnv, k+"="+env[k])
		}
	} else {
		args = append(args, m.setprivArgs(p.tools.setpriv, req.User)...)
		args = append(args, p.tools.env, "-i", "-C", cwd)
		for _, k := range keys {
			args = append(args, k+"="+env[k])
		}
		args = append(args, req.Argv...)
	}
	cmd := exec.Command(p.tools.nsenter, args...)
	if files := m.Cgroups.procsFiles(); len(files) > 0 {
		// The command joins the sandbox's control groups before it
		// enters: a shell writes its own pid, then becomes nsenter.
		cmd = exec.Command("/bin/sh", append([]string{"-c", joinScript, "stasis-join", strings.Join(files, "\n"), p.tools.nsenter}, args...)...)
	}
	if cmdEnv != nil {
		cmd.Env = cmdEnv
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd
}

// joinScript writes the shell's pid into each cgroup.procs file named one
// a line in $1, then runs the rest of its arguments in its place.
const joinScript = `IFS='
'
for f in $1; do printf '%s\n' "$$" > "$f" || exit 125; done
unset IFS; shift
exec "$@"`

// Exec runs a command inside the sandbox.
func (p *Provider) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if len(req.Argv) == 0 {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", what(id), "no command")
	}
	m, k, err := p.sbs.Live("exec", id)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	if req.Background {
		return p.background(ctx, m, k, req)
	}
	cmd := p.command(m, k, req)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = req.Stdin, req.Stdout, req.Stderr
	if cmd.Stdout == nil {
		cmd.Stdout = io.Discard
	}
	if cmd.Stderr == nil {
		cmd.Stderr = io.Discard
	}
	if err := cmd.Start(); err != nil {
		return sandbox.ExecResult{}, fmt.Errorf("exec in %s: %w", what(id), err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var timeout <-chan time.Time
	if req.Timeout > 0 {
		t := time.NewTimer(req.Timeout)
		defer t.Stop()
		timeout = t.C
	}
	// The sandbox may expire while the command runs; the keeper then kills
	// everything in it and the command ends.
	select {
	case err := <-done:
		return result(id, cmd, err)
	case <-timeout:
		killCmd(cmd, done)
		return sandbox.ExecResult{ExitCode: -int(unix.SIGKILL)}, sandbox.Errorf(errdefs.ErrTimeout, "exec", what(id), "%q ran past its %s timeout and was killed", strings.Join(req.Argv, " "), req.Timeout)
	case <-ctx.Done():
		killCmd(cmd, done)
		return sandbox.ExecResult{}, ctx.Err()
	}
}

func result(id string, cmd *exec.Cmd, err error) (sandbox.ExecResult, error) {
	if err == nil {
		return sandbox.ExecResult{}, nil
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		ws := ee.Sys().(syscall.WaitStatus)
		if ws.Signaled() {
			return sandbox.ExecResult{ExitCode: -int(ws.Signal())}, nil
		}
		return sandbox.ExecResult{ExitCode: ws.ExitStatus()}, nil
	}
	return sandbox.ExecResult{}, fmt.Errorf("exec in %s: %w", what(id), err)
}

// killCmd kills nsenter and everything it started inside the sandbox (which
// nsenter would not pass a signal to), then reaps it.
func killCmd(cmd *exec.Cmd, done <-chan error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		tree, _ := proc.Descendants(cmd.Process.Pid)
		for _, s := range tree {
			_ = unix.Kill(s.PID, unix.SIGKILL)
		}
		_ = cmd.Process.Kill()
		select {
		case <-done:
			return
		case <-time.After(5 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return
		}
	}
}

// background starts a command in its own session inside the sandbox and
// returns its PID there. No host process stays behind: the command is a
// child of the sandbox's init once the starting shell exits.
func (p *Provider) background(ctx context.Context, m meta, k keeperInfo, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	logPath := req.LogPath
	if logPath == "" {
		logPath = "/dev/null"
	}
	r := req
	r.Argv = append([]string{"/bin/sh", "-c", `log="$1"; shift; mkdir -p -- "${log%/*}/" && setsid "$@" </dev/null >>"$log" 2>&1 & echo $!`, "stasis-bg", logPath}, req.Argv...)
	cmd := p.command(m, k, r)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return sandbox.ExecResult{}, fmt.Errorf("exec in %s: start %q in the background: %v: %s", what(m.ID), req.Argv[0], err, strings.TrimSpace(errb.String()))
	}
	pid, err := strconv.Atoi(strings.TrimSpace(out.String()))
	if err != nil {
		return sandbox.ExecResult{}, fmt.Errorf("exec in %s: background start printed %q", what(m.ID), out.String())
	}
	return sandbox.ExecResult{PID: pid}, nil
}

// hostPath maps an absolute path inside the sandbox to the writable place
// that holds it on the host, as a root to open it under and a path relative
// to that root. ok is false for paths outside /work, $HOME and /tmp.
func (p *Provider) hostPath(m meta, inside string) (root, rel string, ok bool) {
	if !path.IsAbs(inside) {
		inside = path.Join("/work", inside)
	}
	inside = path.Clean(inside)
	base := filepath.Join(p.sbDir(m.ID), rootDir)
	for _, place := range []struct{ in, host string }{{"/work", "work"}, {m.Home, "home"}, {"/tmp", "tmp"}} {
		if under(inside, place.in) {
			rel := strings.TrimPrefix(strings.TrimPrefix(inside, place.in), "/")
			if rel == "" {
				rel = "."
			}
			return filepath.Join(base, place.host), rel, true
		}
	}
	return "", "", false
}

// ReadFile reads a file as the sandbox sees it.
func (p *Provider) ReadFile(ctx context.Context, id, name string) ([]byte, error) {
	m, _, err := p.sbs.Live("read", id)
	if err != nil {
		return nil, err
	}
	if root, rel, ok := p.hostPath(m, name); ok {
		r, err := os.OpenRoot(root) // confines symlinks and ".." to the writable place
		if err != nil {
			return nil, err
		}
		defer r.Close()
		b, kind, err := readRegular(r, rel)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			return nil, sandbox.Errorf(errdefs.ErrNotFound, "read", what(id), "no file %s", name)
		case err == nil && kind == fs.ModeDir:
			return nil, sandbox.Errorf(errdefs.ErrNotFound, "read", what(id), "%s is a directory", name)
		case err == nil && kind != 0:
			return nil, sandbox.Errorf(errdefs.ErrInvalid, "read", what(id), "%s is not a regular file (%v): it is not read", name, kind)
		case err == nil:
			return b, nil
		}
		// A symlink leading out of the place: read it as the sandbox sees it.
	}
	var out, errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: m.fileArgv([]string{"cat", "--", name}, fileop.OpCat, name), Stdout: &out, Stderr: &errb})
	if err != nil {
		return nil, err
	}
	if res.ExitCode != 0 {
		return nil, sandbox.Errorf(errdefs.ErrNotFound, "read", what(id), "%s: %s", name, strings.TrimSpace(errb.String()))
	}
	return out.Bytes(), nil
}

// readRegular reads rel under r if it is a regular file; otherwise it
// returns its type. It opens without blocking and reads nothing else: a
// fifo the agent put in a file's place would hold the host's reader
// forever.
func readRegular(r *os.Root, rel string) ([]byte, fs.FileMode, error) {
	f, err := r.OpenFile(rel, os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	if t := fi.Mode().Type(); t != 0 {
		return nil, t, nil
	}
	b, err := io.ReadAll(f)
	return b, 0, err
}

// WriteFile writes a file inside /work, $HOME or /tmp, creating its parent
// directories; the rest of the sandbox is read-only.
func (p *Provider) WriteFile(ctx context.Context, id, name string, data []byte, mode fs.FileMode) error {
	m, _, err := p.sbs.Live("write", id)
	if err != nil {
		return err
	}
	root, rel, ok := p.hostPath(m, name)
	if !ok || rel == "." {
		return sandbox.Errorf(errdefs.ErrInvalid, "write", what(id), "%s is outside the writable places (/work, %s, /tmp)", name, m.Home)
	}
	r, err := os.OpenRoot(root)
	if err != nil {
		return err
	}
	defer r.Close()
	var f *os.File
	uid, gid, own := m.agentOwner()
	err = mkdirAllOwned(r, filepath.Dir(rel), uid, gid, own)
	if err == nil {
		f, err = r.OpenFile(rel, os.O_CREATE|os.O_WRONLY|os.O_TRUNC|unix.O_NOFOLLOW, mode)
	}
	if err == nil && own {
		if err = f.Chown(uid, gid); err != nil {
			f.Close()
			return err
		}
	}
	if err != nil {
		// A symlink leading out of the place (or another surprise): write
		// it from inside, where the sandbox's own view and limits apply.
		return p.writeInside(ctx, m, id, name, data, mode)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func (p *Provider) writeInside(ctx context.Context, m meta, id, name string, data []byte, mode fs.FileMode) error {
	var errb bytes.Buffer
	perm := strconv.FormatUint(uint64(mode.Perm()), 8)
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{
		Argv: m.fileArgv([]string{"/bin/sh", "-c", `mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" -- "$1"`, "write", name, perm},
			fileop.OpWrite, name, perm),
		Stdin: bytes.NewReader(data), Stderr: &errb,
	})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return sandbox.Errorf(errdefs.ErrInvalid, "write", what(id), "%s: %s", name, strings.TrimSpace(errb.String()))
	}
	return nil
}

// fileArgv is the command of a file operation inside the sandbox: on an
// image, the in-sandbox binary's (package fileop: an image need not have
// sh, cat or tar, and its own are the image's); on the host's userland,
// host is run as it is.
func (m meta) fileArgv(host []string, op string, args ...string) []string {
	if m.Image == "" {
		return host
	}
	return append([]string{EnterBinary}, fileop.Args(op, args...)...)
}

// Upload extracts a tar stream into dir inside the sandbox (the unpack runs
// inside, so it sees exactly what the sandbox sees and can write nowhere
// else).
func (p *Provider) Upload(ctx context.Context, id, dir string, tr io.Reader) error {
	m, _, err := p.sbs.Live("upload", id)
	if err != nil {
		return err
	}
	var errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{
		Argv: m.fileArgv([]string{"/bin/sh", "-c", `mkdir -p -- "$1" && exec tar -x --no-same-owner -C "$1" -f -`, "upload", dir},
			fileop.OpUnpack, dir),
		Stdin: tr, Stderr: &errb,
	})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return sandbox.Errorf(errdefs.ErrInvalid, "upload", what(id), "into %s: the unpack exited %d: %s", dir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}

// Download writes dir inside the sandbox as a tar stream.
func (p *Provider) Download(ctx context.Context, id, dir string, w io.Writer) error {
	m, _, err := p.sbs.Live("download", id)
	if err != nil {
		return err
	}
	var errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: m.fileArgv([]string{"tar", "-c", "-C", dir, "-f", "-", "."}, fileop.OpPack, dir), Stdout: w, Stderr: &errb})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return sandbox.Errorf(errdefs.ErrNotFound, "download", what(id), "%s: the pack exited %d: %s", dir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}
