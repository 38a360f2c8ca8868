package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"stasis/errdefs"
	"stasis/internal/proc"
	"stasis/sandbox"
)

const (
	// pipeChunk is the most output one frame carries, and the size of a
	// stdin read.
	pipeChunk = 32 << 10
	// outputGrace is how long output pipes may stay open after a kill
	// (held by a process that escaped it) before the agent closes them.
	outputGrace = 2 * time.Second
)

func (s *server) exec(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	// Stdin is read from the body while output is written: say so, or the
	// server would read the whole body before the first frame goes out.
	if err := rc.EnableFullDuplex(); err != nil {
		s.log.Warn("exec: no full duplex", "err", err)
	}
	br := bufio.NewReaderSize(r.Body, pipeChunk)
	line, err := readHeader(br)
	if err == nil {
		var h execHeader
		if h, err = parseExecHeader(line); err == nil {
			s.run(r.Context(), h, br, w, rc)
			return
		}
	}
	writeError(w, err)
}

// run runs a parsed exec request and answers with its frame stream.
func (s *server) run(ctx context.Context, h execHeader, stdin io.Reader, w http.ResponseWriter, rc *http.ResponseController) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	fw := &frameWriter{w: w, rc: rc, clientGone: cancel}
	if h.Background {
		pid, err := s.startBackground(h)
		if err != nil {
			writeError(w, err)
			return
		}
		fw.end(endFrame{PID: pid})
		return
	}
	t0 := time.Now()
	end := s.foreground(ctx, h, stdin, fw)
	s.log.Debug("exec", "argv0", h.Argv[0], "exit", end.ExitCode, "kind", end.Kind, "took", time.Since(t0))
	fw.end(end)
}

// frameWriter writes frames to the response, one at a time, flushing each.
// After a failed write (the client is gone) it drops the rest.
type frameWriter struct {
	mu         sync.Mutex
	w          http.ResponseWriter
	rc         *http.ResponseController
	clientGone func()
	started    bool
	failed     bool
	buf        []byte
}

// start sends the response header.
func (f *frameWriter) start() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.startLocked()
	f.check(f.rc.Flush())
}

func (f *frameWriter) startLocked() {
	if !f.started {
		f.w.Header().Set("Content-Type", framesType)
		f.w.WriteHeader(http.StatusOK)
		f.started = true
	}
}

func (f *frameWriter) check(err error) {
	if err != nil && !f.failed {
		f.failed = true
		f.clientGone()
	}
}

func (f *frameWriter) write(kind byte, data []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failed {
		return
	}
	f.startLocked()
	f.buf = appendFrame(f.buf[:0], kind, data)
	_, err := f.w.Write(f.buf)
	if err == nil {
		err = f.rc.Flush()
	}
	f.check(err)
}

func (f *frameWriter) end(e endFrame) {
	b, _ := json.Marshal(e)
	f.write(frameEnd, b)
}

// prepare makes the command for a request, or says why it cannot start
// and with which exit code (env(1)'s: 125 for the directory, 127 for a
// command not found).
func prepare(h execHeader, env []string) (*exec.Cmd, int, string) {
	if fi, err := os.Stat(h.Cwd); err != nil {
		return nil, 125, fmt.Sprintf("cannot change directory to %s: %v", h.Cwd, err)
	} else if !fi.IsDir() {
		return nil, 125, fmt.Sprintf("cannot change directory to %s: not a directory", h.Cwd)
	}
	pathEnv := ""
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			pathEnv = v
		}
	}
	p, ok := lookPath(h.Argv[0], pathEnv, h.Cwd)
	if !ok {
		return nil, 127, fmt.Sprintf("%s: command not found", h.Argv[0])
	}
	return &exec.Cmd{Path: p, Args: h.Argv, Env: env, Dir: h.Cwd}, 0, ""
}

// lookPath finds a command in the command's PATH (not the agent's).
// A name with a slash is used as it is (relative to cwd).
func lookPath(file, pathEnv, cwd string) (string, bool) {
	if strings.Contains(file, "/") {
		return file, true
	}
	for _, dir := range filepath.SplitList(pathEnv) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, file)
		if !filepath.IsAbs(p) {
			p = filepath.Join(cwd, p)
		}
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, true
		}
	}
	return "", false
}

// startExitCode is the exit code for a command that failed to start.
func startExitCode(err error) int {
	if errors.Is(err, fs.ErrNotExist) {
		return 127
	}
	return 126
}

// foreground runs a command in its own process group, streaming its output
// as frames, and returns the end frame.
func (s *server) foreground(ctx context.Context, h execHeader, stdin io.Reader, fw *frameWriter) endFrame {
	// The response starts at once: the client knows the agent took the
	// command even if no output comes for a long time.
	fw.start()
	cmd, code, msg := prepare(h, h.environ(s.home(h)))
	if cmd == nil {
		fw.write(frameStderr, []byte("stasis agent: "+msg+"\n"))
		return endFrame{ExitCode: code}
	}
	// The agent makes the pipes itself (os/exec makes none for *os.File),
	// so that it decides when to stop reading and when to close them.
	var files [6]*os.File // inR, inW, outR, outW, errR, errW
	for i := 0; i < 6; i += 2 {
		r, w, err := os.Pipe()
		if err != nil {
			for _, f := range files[:i] {
				f.Close()
			}
			return endFrame{ExitCode: 126, wireError: toWire(err)}
		}
		files[i], files[i+1] = r, w
	}
	inR, inW, outR, outW, errR, errW := files[0], files[1], files[2], files[3], files[4], files[5]
	defer inW.Close()
	defer outR.Close()
	defer errR.Close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, errW
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: s.credential(h)}
	err := cmd.Start()
	inR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		fw.write(frameStderr, []byte(fmt.Sprintf("stasis agent: start %s: %v\n", h.Argv[0], err)))
		return endFrame{ExitCode: startExitCode(err)}
	}

	go copyStdin(stdin, inW, fw.clientGone)
	var pumps sync.WaitGroup
	for _, p := range []struct {
		f    *os.File
		kind byte
	}{{outR, frameStdout}, {errR, frameStderr}} {
		pumps.Go(func() {
			buf := make([]byte, pipeChunk)
			for {
				n, err := p.f.Read(buf)
				if n > 0 {
					fw.write(p.kind, buf[:n])
				}
				if err != nil {
					return
				}
			}
		})
	}
	outputDone := make(chan struct{})
	go func() { pumps.Wait(); close(outputDone) }()
	waited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(waited) }()

	var timeout <-chan time.Time
	if d := h.timeout(); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	// The command is done when it has exited and its output pipes have
	// closed (a child it left running may still hold them, as with any
	// provider).
	exited, drained := waited, outputDone
	for exited != nil || drained != nil {
		select {
		case <-exited:
			exited = nil
		case <-drained:
			drained = nil
		case <-timeout:
			s.stop(cmd.Process.Pid, exited, outputDone, outR, errR)
			return endFrame{ExitCode: -int(unix.SIGKILL), wireError: wireError{
				Kind:    "timeout",
				Message: fmt.Sprintf("%q ran past its %s timeout and was killed", strings.Join(h.Argv, " "), h.timeout()),
			}}
		case <-ctx.Done():
			s.stop(cmd.Process.Pid, exited, outputDone, outR, errR)
			s.log.Info("exec cancelled: the client went away; command killed", "argv0", h.Argv[0])
			return endFrame{ExitCode: -int(unix.SIGKILL), wireError: toWire(ctx.Err())}
		}
	}
	return endFrame{ExitCode: exitCode(cmd.ProcessState)}
}

// exitCode is the exit status, or minus the signal that ended the process.
func exitCode(ps *os.ProcessState) int {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return -int(ws.Signal())
	}
	return ps.ExitCode()
}

// stop kills a foreground command: its process group and every process
// below it, again until the command has been reaped (exited is nil once it
// has), since a process may fork while it is being killed. Then it waits a
// moment for the output pipes to close, and closes them if something that
// escaped still holds them.
func (s *server) stop(pid int, exited <-chan struct{}, outputDone <-chan struct{}, outR, errR *os.File) {
	if pid <= 1 { // never signal group 0 or -1
		return
	}
	deadline := time.Now().Add(10 * time.Second)
	for exited != nil {
		// The command is not reaped yet, so pid is still its own.
		tree, _ := proc.Descendants(pid)
		for _, p := range tree {
			_ = unix.Kill(p.PID, unix.SIGKILL)
		}
		_ = unix.Kill(-pid, unix.SIGKILL)
		select {
		case <-exited:
			exited = nil
		case <-time.After(5 * time.Millisecond):
		}
		if exited != nil && time.Now().After(deadline) {
			s.log.Warn("exec: a killed command is still not reaped", "pid", pid)
			break
		}
	}
	// Members of the group that outlived its leader.
	_ = unix.Kill(-pid, unix.SIGKILL)
	select {
	case <-outputDone:
	case <-time.After(outputGrace):
		outR.Close()
		errR.Close()
		<-outputDone
	}
}

// copyStdin copies the request body after the header to the command's
// stdin, and closes it at the body's end. When the command stops reading,
// the rest of the body is read and dropped, so that a client that goes away
// is still noticed: a body that breaks off (not at its end) means the
// client is gone.
func copyStdin(body io.Reader, w *os.File, clientGone func()) {
	buf := make([]byte, pipeChunk)
	writing := true
	for {
		n, err := body.Read(buf)
		if n > 0 && writing {
			if _, werr := w.Write(buf[:n]); werr != nil {
				writing = false
				w.Close()
			}
		}
		if err != nil {
			w.Close()
			if err != io.EOF {
				clientGone()
			}
			return
		}
	}
}

// startBackground starts a command in its own session with its output
// appended to its log, and has a goroutine wait for it so that it leaves
// no zombie.
func (s *server) startBackground(h execHeader) (int, error) {
	invalid := func(format string, args ...any) (int, error) {
		return 0, sandbox.Errorf(errdefs.ErrInvalid, "exec", "", format, args...)
	}
	cmd, _, msg := prepare(h, h.environ(s.home(h)))
	if cmd == nil {
		return invalid("%s", msg)
	}
	logPath := os.DevNull
	if h.LogPath != "" {
		logPath = h.LogPath
		if !filepath.IsAbs(logPath) {
			logPath = filepath.Join(h.Cwd, logPath)
		}
	}
	// The log is opened as the command's user: an agent's command cannot
	// have it appended to a file of stasis's through a symlink.
	var out *os.File
	openLog := func() error {
		if logPath != os.DevNull {
			if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err != nil {
				return fmt.Errorf("log directory: %v", err)
			}
		}
		var err error
		out, err = os.OpenFile(logPath, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return fmt.Errorf("log: %v", err)
		}
		return nil
	}
	var err error
	if s.credential(h) != nil {
		err = s.asAgent(openLog)
	} else {
		err = openLog()
	}
	if err != nil {
		return invalid("%v", err)
	}
	defer out.Close()
	in, err := os.Open(os.DevNull)
	if err != nil {
		return 0, err
	}
	defer in.Close()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = in, out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: s.credential(h)}
	if err := cmd.Start(); err != nil {
		return invalid("start %s: %v", h.Argv[0], err)
	}
	pid := cmd.Process.Pid
	s.log.Debug("background command started", "pid", pid, "argv0", h.Argv[0], "log", logPath)
	go func() {
		_ = cmd.Wait()
		s.log.Debug("background command ended", "pid", pid, "argv0", h.Argv[0], "exit", exitCode(cmd.ProcessState))
	}()
	return pid, nil
}
