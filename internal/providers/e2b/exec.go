package e2b

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"stasis/errdefs"
	"stasis/internal/fileop"
	"stasis/internal/providers/e2b/internal/wire"
	"stasis/sandbox"
)

// stdinChunk is the most stdin one SendInput carries.
const stdinChunk = 256 << 10

// Exec runs a command through envd's process service. A foreground
// command's output streams to req.Stdout and req.Stderr as it comes; its
// stdin is fed with SendInput and closed with CloseStdin; a timeout is sent
// as the call's deadline (envd kills the process when it passes) and the
// provider kills it too (SendSignal) when its own timer fires first. A
// background command is started in its own session by a launcher that
// returns its PID at once.
func (p *Provider) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if len(req.Argv) == 0 {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", what(id), "no command")
	}
	st, err := p.running(ctx, "exec", id)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	if req.Background {
		return p.background(ctx, st, req)
	}
	return p.foreground(ctx, st, req)
}

func (p *Provider) config(argv []string, env map[string]string, cwd string) wire.ProcessConfig {
	if cwd == "" {
		cwd = p.o.Workdir
	} else if !path.IsAbs(cwd) {
		cwd = path.Join(p.o.Workdir, cwd)
	}
	return wire.ProcessConfig{Cmd: argv[0], Args: argv[1:], Envs: env, Cwd: &cwd}
}

func (p *Provider) foreground(ctx context.Context, st sbState, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	f := &fgExec{p: p, ctx: ctx, st: st, req: req, stdout: req.Stdout, stderr: req.Stderr, withStdin: req.Stdin != nil}
	if f.stdout == nil {
		f.stdout = io.Discard
	}
	if f.stderr == nil {
		f.stderr = io.Discard
	}
	f.runCtx, f.cancel = context.WithCancel(ctx)
	defer f.cancel()
	if req.Timeout > 0 {
		t := time.AfterFunc(req.Timeout, func() { f.timedOut.Store(true); f.cancel() })
		defer t.Stop()
	}
	start := wire.StartRequest{Process: p.config(req.Argv, req.Env, req.Cwd), Stdin: &f.withStdin}
	stream, err := p.startProcess(f.runCtx, "exec", st, start, req.Timeout.Milliseconds())
	if err != nil {
		if f.timedOut.Load() {
			return sandbox.ExecResult{ExitCode: -int(syscall.SIGKILL)}, f.timeoutErr()
		}
		return sandbox.ExecResult{}, err
	}
	defer stream.Close()
	for {
		ev, end, err := stream.next()
		if err != nil {
			return f.broken(err)
		}
		if end != nil {
			return f.finish(end)
		}
		f.event(ev)
	}
}

// fgExec is a command run in the foreground, as its output stream goes.
type fgExec struct {
	p              *Provider
	ctx, runCtx    context.Context
	cancel         context.CancelFunc // ends runCtx
	st             sbState
	req            sandbox.ExecRequest
	stdout, stderr io.Writer
	withStdin      bool

	timedOut, pumpFailed atomic.Bool
	pumpErr              error // set before pumpFailed

	pid   uint32
	res   sandbox.ExecResult
	ended bool
}

func (f *fgExec) timeoutErr() error {
	return sandbox.Errorf(errdefs.ErrTimeout, "exec", what(f.st.id), "%q ran past its %s timeout and was killed", strings.Join(f.req.Argv, " "), f.req.Timeout)
}

// kill ends the process when the call gives up on it.
func (f *fgExec) kill() {
	if f.pid == 0 {
		return
	}
	kctx, kcancel := context.WithTimeout(context.WithoutCancel(f.ctx), 10*time.Second)
	defer kcancel()
	_ = f.p.unary(kctx, "exec", f.st, "SendSignal", wire.SendSignalRequest{Process: wire.ProcessSelector{PID: &f.pid}, Signal: wire.SignalKill}, idempotent)
}

// broken is the result of a stream that broke with err.
func (f *fgExec) broken(err error) (sandbox.ExecResult, error) {
	id := f.st.id
	switch {
	case f.timedOut.Load():
		f.kill()
		return sandbox.ExecResult{ExitCode: -int(syscall.SIGKILL)}, f.timeoutErr()
	case f.pumpFailed.Load():
		f.kill()
		return sandbox.ExecResult{}, fmt.Errorf("exec %s: feeding %q its stdin failed, so it was killed: %w", what(id), f.req.Argv[0], f.pumpErr)
	case f.ctx.Err() != nil:
		f.kill()
		return sandbox.ExecResult{}, f.ctx.Err()
	}
	if serr := f.p.stillRunning(f.ctx, "exec", f.st); serr != nil {
		return sandbox.ExecResult{}, serr
	}
	return sandbox.ExecResult{}, fmt.Errorf("exec %s: %q: the output stream broke: %v; the command may still run (pid %d)", what(id), f.req.Argv[0], err, f.pid)
}

// finish is the result of the stream's end.
func (f *fgExec) finish(end *wire.EndStream) (sandbox.ExecResult, error) {
	id := f.st.id
	if e := end.Error; e != nil {
		switch {
		case e.Code == "deadline_exceeded" || f.timedOut.Load():
			f.kill()
			return sandbox.ExecResult{ExitCode: -int(syscall.SIGKILL)}, f.timeoutErr()
		case e.Code == "invalid_argument" || e.Code == "not_found":
			return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", what(id), "envd cannot run %q: %s", f.req.Argv[0], e.Message)
		}
		if serr := f.p.stillRunning(f.ctx, "exec", f.st); serr != nil {
			return sandbox.ExecResult{}, serr
		}
		return sandbox.ExecResult{}, fmt.Errorf("exec %s: %q: envd: %s: %s", what(id), f.req.Argv[0], e.Code, e.Message)
	}
	if !f.ended {
		return sandbox.ExecResult{}, fmt.Errorf("exec %s: %q: envd closed the stream without the process's end", what(id), f.req.Argv[0])
	}
	return f.res, nil
}

// event takes one event of the stream: the start (the stdin pump starts),
// output, or the process's end.
func (f *fgExec) event(ev *wire.ProcessEvent) {
	switch {
	case ev.Start != nil:
		f.pid = ev.Start.PID
		if f.withStdin {
			// Not waited for: a stdin that never ends must not hold
			// the call once the command has ended.
			pid := f.pid
			go func() {
				if err := f.p.pump(f.runCtx, f.st, pid, f.req.Stdin); err != nil && f.runCtx.Err() == nil {
					f.pumpErr = err
					f.pumpFailed.Store(true)
					f.cancel()
				}
			}()
		}
	case ev.Data != nil:
		// A caller's writer that fails does not stop the command;
		// the rest of its output is dropped.
		if len(ev.Data.Stdout) > 0 {
			if _, err := f.stdout.Write(ev.Data.Stdout); err != nil {
				f.stdout = io.Discard
			}
		}
		if len(ev.Data.Stderr) > 0 {
			if _, err := f.stderr.Write(ev.Data.Stderr); err != nil {
				f.stderr = io.Discard
			}
		}
	case ev.End != nil:
		f.ended = true
		f.res = sandbox.ExecResult{ExitCode: exitCode(*ev.End)}
	}
}

// pump feeds stdin to a process and closes its stdin at EOF. A process that
// ended before reading it all is not an error.
func (p *Provider) pump(ctx context.Context, st sbState, pid uint32, r io.Reader) error {
	buf := make([]byte, stdinChunk)
	sel := wire.ProcessSelector{PID: &pid}
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			err := p.unary(ctx, "exec", st, "SendInput", wire.SendInputRequest{Process: sel, Input: wire.ProcessInput{Stdin: buf[:n]}}, unapplied)
			if connectCode(err) == "not_found" {
				return nil // it ended
			}
			if err != nil {
				return err
			}
		}
		if rerr != nil {
			err := p.unary(ctx, "exec", st, "CloseStdin", wire.CloseStdinRequest{Process: sel}, idempotent)
			if connectCode(err) == "not_found" {
				err = nil
			}
			if rerr != io.EOF {
				return fmt.Errorf("reading the command's stdin: %w", rerr)
			}
			return err
		}
	}
}

// exitCode is the contract's exit code: the status, or minus the signal
// number when a signal ended the process (envd reports -1 and Go's
// "signal: NAME").
func exitCode(e wire.EndEvent) int {
	if e.Exited {
		return int(e.ExitCode)
	}
	if name, ok := strings.CutPrefix(e.Status, "signal: "); ok {
		for sig := syscall.Signal(1); sig < 65; sig++ {
			if sig.String() == name {
				return -int(sig)
			}
		}
	}
	return int(e.ExitCode)
}

// background starts a command in its own session, output to req.LogPath
// (its directory made), and returns its PID as the sandbox sees it. The
// launcher ends at once; the command is not envd's child, so no stream
// stays open for it.
func (p *Provider) background(ctx context.Context, st sbState, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	logPath := req.LogPath
	if logPath == "" {
		logPath = "/dev/null"
	}
	const launcher = `log=$1; shift
mkdir -p -- "$(dirname -- "$log")" || exit 1
setsid "$@" </dev/null >>"$log" 2>&1 &
echo $!`
	r := req
	r.Argv = append([]string{"/bin/sh", "-c", launcher, "stasis-bg", logPath}, req.Argv...)
	r.Background, r.Stdin, r.Timeout = false, nil, time.Minute
	var out, errb bytes.Buffer
	r.Stdout, r.Stderr = &out, &errb
	res, err := p.foreground(ctx, st, r)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	pid, perr := strconv.Atoi(strings.TrimSpace(out.String()))
	if res.ExitCode != 0 || perr != nil || pid <= 0 {
		return sandbox.ExecResult{}, fmt.Errorf("exec %s: start %q in the background: the launcher exited %d, printed %q: %s", what(st.id), req.Argv[0], res.ExitCode, out.String(), strings.TrimSpace(errb.String()))
	}
	return sandbox.ExecResult{PID: pid}, nil
}

// run runs a short command and returns its stdout, failing on a non-zero
// exit with the kind given and its stderr.
func (p *Provider) run(ctx context.Context, op, id string, kind error, stdin io.Reader, argv ...string) (string, error) {
	var out, errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: argv, Stdin: stdin, Stdout: &out, Stderr: &errb, Cwd: "/"})
	if err != nil {
		return "", err
	}
	if res.ExitCode != 0 {
		return out.String(), sandbox.Errorf(kind, op, what(id), "%s exited %d: %s", argv[0], res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return out.String(), nil
}

func (p *Provider) abs(name string) string {
	if !path.IsAbs(name) {
		name = path.Join(p.o.Workdir, name)
	}
	return path.Clean(name)
}

// ReadFile reads a file through envd's /files.
func (p *Provider) ReadFile(ctx context.Context, id, name string) ([]byte, error) {
	st, err := p.running(ctx, "read", id)
	if err != nil {
		return nil, err
	}
	return p.getFile(ctx, "read", st, p.abs(name))
}

// WriteFile writes a file through envd's /files (which makes its parent
// directories) and then sets its mode.
func (p *Provider) WriteFile(ctx context.Context, id, name string, data []byte, mode fs.FileMode) error {
	st, err := p.running(ctx, "write", id)
	if err != nil {
		return err
	}
	name = p.abs(name)
	if err := p.postFile(ctx, "write", st, name, func() io.Reader { return bytes.NewReader(data) }, idempotent); err != nil {
		return err
	}
	_, err = p.run(ctx, "write", id, errdefs.ErrInvalid, nil, "chmod", strconv.FormatUint(uint64(mode.Perm()), 8), "--", name)
	return err
}

func tmpName(prefix string) string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "/tmp/.stasis-" + prefix + "-" + hex.EncodeToString(b)
}

// Upload writes the tar stream to a file in the sandbox through /files,
// then extracts it into dir with tar (inside, so it sees what the sandbox
// sees) and removes the file.
func (p *Provider) Upload(ctx context.Context, id, dir string, tr io.Reader) error {
	st, err := p.running(ctx, "upload", id)
	if err != nil {
		return err
	}
	tmp := tmpName("upload") + ".tar"
	if err := p.postFile(ctx, "upload", st, tmp, func() io.Reader { return tr }, once); err != nil {
		return err
	}
	_, err = p.run(ctx, "upload", id, errdefs.ErrInvalid, nil, "/bin/sh", "-c",
		`mkdir -p -- "$1" && tar -x --no-same-owner -C "$1" -f "$2"; rc=$?; rm -f -- "$2"; exit $rc`, "stasis-upload", p.abs(dir), tmp)
	return err
}

// Download streams dir from tar's stdout in the sandbox to w.
func (p *Provider) Download(ctx context.Context, id, dir string, w io.Writer) error {
	var errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"tar", "-c", "-C", p.abs(dir), "-f", "-", "."}, Cwd: "/", Stdout: w, Stderr: &errb})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return sandbox.Errorf(errdefs.ErrNotFound, "download", what(id), "%s: tar exited %d: %s", dir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}

// uploadDir seeds dir in the sandbox from a host directory, as a tar
// stream: modes, symlinks and modification times kept.
func (p *Provider) uploadDir(ctx context.Context, id, host, dir string) error {
	pr, pw := io.Pipe()
	go func() { pw.CloseWithError(fileop.Pack(host, pw)) }()
	err := p.Upload(ctx, id, dir, pr)
	pr.CloseWithError(errors.New("upload ended"))
	return err
}
