package e2bfake

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/strictjson"
	"stasis/sandbox"
)

// process is a command started through the fake's envd.
type process struct {
	cancel context.CancelFunc
	killed atomic.Bool // ended by SendSignal

	mu    sync.Mutex
	stdin *os.File // the pipe's write end; nil once closed or never opened
}

func (p *process) write(b []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stdin == nil {
		return errors.New("stdin is closed")
	}
	_, err := p.stdin.Write(b)
	return err
}

func (p *process) closeStdin() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.stdin != nil {
		p.stdin.Close()
		p.stdin = nil
	}
}

func (f *Server) envdRoutes() {
	f.envd.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		if _, ok := f.target(w, r); ok {
			w.WriteHeader(http.StatusNoContent)
		}
	})
	f.envd.HandleFunc("GET /files", f.getFile)
	f.envd.HandleFunc("POST /files", f.postFile)
	f.envd.HandleFunc("POST /process.Process/Start", f.start)
	f.envd.HandleFunc("POST /process.Process/SendInput", f.sendInput)
	f.envd.HandleFunc("POST /process.Process/CloseStdin", f.closeStdin)
	f.envd.HandleFunc("POST /process.Process/SendSignal", f.sendSignal)
	f.envd.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if _, ok := f.target(w, r); ok {
			unaryError(w, "unimplemented", fmt.Sprintf("the fake's envd does not serve %s %s", r.Method, r.URL.Path))
		}
	})
}

// target is the sandbox an envd request is for, with what the request
// needs of it, taken under the lock.
type target struct {
	sb      *sbx
	backend string
	ctx     context.Context
	env     map[string]string
}

// target finds the running sandbox an envd request is for, or answers as
// E2B's sandbox proxy and envd do: 502 when no running sandbox is there,
// 401 for a wrong access token.
func (f *Server) target(w http.ResponseWriter, r *http.Request) (target, bool) {
	id := r.Header.Get(headerSandboxID)
	if port := r.Header.Get(headerSandboxPort); port != "" && port != strconv.Itoa(envdPort) {
		writeJSON(w, http.StatusBadGateway, map[string]any{"message": "nothing listens on port " + port, "code": 502, "sandboxId": id})
		return target{}, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[id]
	if !ok || sb.state != stateRunning {
		msg := "The sandbox was not found"
		if ok {
			msg = "The sandbox is " + sb.state
		}
		writeJSON(w, http.StatusBadGateway, map[string]any{"message": msg, "code": 502, "sandboxId": id})
		return target{}, false
	}
	if sb.token != "" && r.Header.Get(headerAccessToken) != sb.token {
		writeJSON(w, http.StatusUnauthorized, apiError{Code: 401, Message: "unauthorized access, please provide a valid access token"})
		return target{}, false
	}
	env := map[string]string{}
	for k, v := range sb.env {
		env[k] = v
	}
	return target{sb: sb, backend: sb.backend, ctx: sb.ctx, env: env}, true
}

// envdUser is whom envd runs a process as: the user of the request's
// Basic authorization, as E2B's SDKs send it ("root", or by default
// "user"). The backend's stasis user stands for E2B's root, and its
// unprivileged agent for every other user.
func envdUser(r *http.Request) sandbox.User {
	if name, _, ok := r.BasicAuth(); ok && name == "root" {
		return sandbox.UserControl
	}
	return sandbox.UserAgent
}

// unaryError answers a unary Connect call with an error.
func unaryError(w http.ResponseWriter, code, msg string) {
	writeJSON(w, connectStatus(code), connectErrorJSON{Code: code, Message: msg})
}

// fileError answers /files with envd's error body.
func fileError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, apiError{Code: status, Message: msg})
}

func filePath(w http.ResponseWriter, r *http.Request) (string, bool) {
	p := r.URL.Query().Get("path")
	if p == "" || !path.IsAbs(p) {
		fileError(w, http.StatusBadRequest, fmt.Sprintf("path '%s' is not absolute (the fake resolves no home directory)", p))
		return "", false
	}
	return p, true
}

// fileTarget is the sandbox and the path of a /files request (target,
// filePath).
func (f *Server) fileTarget(w http.ResponseWriter, r *http.Request) (target, string, bool) {
	t, ok := f.target(w, r)
	if !ok {
		return t, "", false
	}
	p, ok := filePath(w, r)
	return t, p, ok
}

// getFile is GET /files.
func (f *Server) getFile(w http.ResponseWriter, r *http.Request) {
	t, p, ok := f.fileTarget(w, r)
	if !ok {
		return
	}
	var b []byte
	var err error
	if f.asRoot(r) {
		b, err = f.rootRead(r.Context(), t.backend, p)
	} else {
		b, err = f.b.ReadFile(r.Context(), t.backend, p)
	}
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
		fileError(w, http.StatusNotFound, fmt.Sprintf("path '%s' does not exist", p))
	case err != nil:
		fileError(w, http.StatusInternalServerError, fmt.Sprintf("error reading file '%s': %v", p, err))
	default:
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		_, _ = w.Write(b)
	}
}

// postFile is POST /files with a raw body: the file is written (mode 0644,
// as envd's 0666 under the usual umask), its directories made.
func (f *Server) postFile(w http.ResponseWriter, r *http.Request) {
	t, p, ok := f.fileTarget(w, r)
	if !ok {
		return
	}
	if ct := r.Header.Get("Content-Type"); ct != "application/octet-stream" {
		fileError(w, http.StatusBadRequest, fmt.Sprintf("unsupported content type: %s, the fake takes application/octet-stream", ct))
		return
	}
	b, err := io.ReadAll(io.LimitReader(r.Body, 1<<30))
	if err != nil {
		fileError(w, http.StatusBadRequest, "reading the body: "+err.Error())
		return
	}
	write := f.b.WriteFile
	if f.asRoot(r) {
		write = f.rootWrite
	}
	switch err := write(r.Context(), t.backend, p, b, 0o644); {
	case errors.Is(err, errdefs.ErrInvalid):
		fileError(w, http.StatusBadRequest, fmt.Sprintf("error writing file '%s': %v", p, err))
	case err != nil:
		fileError(w, http.StatusInternalServerError, fmt.Sprintf("error writing file '%s': %v", p, err))
	default:
		writeJSON(w, http.StatusOK, []entryJSON{{Path: p, Name: path.Base(p), Type: "file"}})
	}
}

// outMsg is one message of a Start stream: an event, or the end.
type outMsg struct {
	ev  *processEventJSON
	end *endStreamJSON
}

// procOut turns a backend command's output into Start's events. The
// wrapper prints the command's PID as its first line of stdout before it
// execs the command; stderr that comes before that line is held until it.
type procOut struct {
	mu      sync.Mutex
	msgs    chan<- outMsg
	onStart func(pid uint32)
	started bool
	line    []byte // stdout before the PID's newline
	held    []byte // stderr before the start
}

type outWriter struct {
	o      *procOut
	stderr bool
}

func (w outWriter) Write(b []byte) (int, error) {
	w.o.mu.Lock()
	defer w.o.mu.Unlock()
	n := len(b)
	b = append([]byte(nil), b...)
	if w.stderr {
		if !w.o.started {
			w.o.held = append(w.o.held, b...)
		} else {
			w.o.msgs <- outMsg{ev: &processEventJSON{Data: &dataEventJSON{Stderr: b}}}
		}
		return n, nil
	}
	if !w.o.started {
		w.o.line = append(w.o.line, b...)
		i := strings.IndexByte(string(w.o.line), '\n')
		if i < 0 {
			return n, nil
		}
		pid, err := strconv.ParseUint(string(w.o.line[:i]), 10, 32)
		if err != nil {
			return 0, fmt.Errorf("the wrapper printed %q, not a PID", w.o.line[:i])
		}
		rest := w.o.line[i+1:]
		w.o.started, w.o.line = true, nil
		w.o.onStart(uint32(pid))
		w.o.msgs <- outMsg{ev: &processEventJSON{Start: &startEventJSON{PID: uint32(pid)}}}
		if len(w.o.held) > 0 {
			w.o.msgs <- outMsg{ev: &processEventJSON{Data: &dataEventJSON{Stderr: w.o.held}}}
			w.o.held = nil
		}
		if len(rest) == 0 {
			return n, nil
		}
		b = rest
	}
	w.o.msgs <- outMsg{ev: &processEventJSON{Data: &dataEventJSON{Stdout: b}}}
	return n, nil
}

// finish sends the end of the stream for a command that ended.
func (o *procOut) finish(cmd string, res sandbox.ExecResult, err error, killed bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	end := func(code int32, exited bool, status string) {
		o.msgs <- outMsg{ev: &processEventJSON{End: &endEventJSON{ExitCode: code, Exited: exited, Status: status}}}
	}
	closeWith := func(e *connectErrorJSON) { o.msgs <- outMsg{end: &endStreamJSON{Error: e}} }
	if !o.started {
		if err != nil && !errors.Is(err, errdefs.ErrTimeout) {
			closeWith(&connectErrorJSON{Code: "unavailable", Message: "the sandbox stopped: " + err.Error()})
			return
		}
		msg := strings.TrimSpace(string(o.held) + string(o.line))
		closeWith(&connectErrorJSON{Code: "invalid_argument", Message: fmt.Sprintf("error starting process '%s': %s", cmd, msg)})
		return
	}
	switch {
	case errors.Is(err, errdefs.ErrTimeout):
		end(-1, false, "signal: killed")
		closeWith(&connectErrorJSON{Code: "deadline_exceeded", Message: "the process ran past the call's deadline and was killed"})
	case killed:
		end(-1, false, "signal: killed")
		closeWith(nil)
	case err != nil:
		closeWith(&connectErrorJSON{Code: "unavailable", Message: "the sandbox stopped while the process ran: " + err.Error()})
	case res.ExitCode >= 0:
		end(int32(res.ExitCode), true, "exit status "+strconv.Itoa(res.ExitCode))
		closeWith(nil)
	default:
		end(-1, false, "signal: "+syscall.Signal(-res.ExitCode).String())
		closeWith(nil)
	}
}

// start is the process service's Start: the command runs in the backend
// sandbox (under a wrapper that reports its PID, as envd's own wrapper
// execs it), its output streamed as it comes. Like envd's, the process
// outlives a client that goes away; the call's deadline
// (Connect-Timeout-Ms) kills it.
func (f *Server) start(w http.ResponseWriter, r *http.Request) {
	t, ok := f.target(w, r)
	if !ok {
		return
	}
	req, timeout, err, ok := readStart(w, r)
	if !ok {
		return
	}
	w.Header().Set("Content-Type", streamContentType)
	w.WriteHeader(http.StatusOK)
	if err == nil && req.Process.Cmd == "" {
		err = errors.New("no command")
	}
	if err != nil {
		_ = writeEnvelope(w, flagEndStream, endStreamJSON{Error: &connectErrorJSON{Code: "invalid_argument", Message: err.Error()}})
		return
	}
	msgs, cerr := f.launch(r, t, req, timeout)
	if cerr != nil {
		_ = writeEnvelope(w, flagEndStream, endStreamJSON{Error: cerr})
		return
	}
	gone := false
	fl, _ := w.(http.Flusher)
	for m := range msgs {
		if gone {
			continue // the client went away; the process runs on
		}
		var err error
		if m.end != nil {
			err = writeEnvelope(w, flagEndStream, m.end)
		} else {
			err = writeEnvelope(w, 0, startResponseJSON{Event: *m.ev})
		}
		if fl != nil {
			fl.Flush()
		}
		gone = err != nil
	}
}

// readStart reads a Start request: the answer is written (ok false) for a
// content type that is not a stream's or a bad deadline; err is a request
// body that does not decode.
func readStart(w http.ResponseWriter, r *http.Request) (req startRequestJSON, timeout time.Duration, err error, ok bool) {
	if ct := r.Header.Get("Content-Type"); ct != streamContentType {
		// The Connect protocol: a streaming request whose content type is
		// not application/connect+… gets 415, so that a client unaware of
		// streams does not take the stream's 200 for a success.
		w.Header().Set("Accept-Post", streamContentType)
		writeJSON(w, http.StatusUnsupportedMediaType, connectErrorJSON{Code: "unknown", Message: fmt.Sprintf("content type %q: Start is a streaming call (%s)", ct, streamContentType)})
		return req, 0, nil, false
	}
	if s := r.Header.Get(headerTimeout); s != "" {
		ms, err := strconv.ParseInt(s, 10, 64)
		if err != nil || ms < 0 {
			unaryError(w, "invalid_argument", "bad "+headerTimeout+": "+s)
			return req, 0, nil, false
		}
		timeout = time.Duration(ms) * time.Millisecond
	}
	_, msg, err := readEnvelope(r.Body)
	if err == nil {
		err = strictjson.Unmarshal(msg, &req)
	}
	return req, timeout, err, true
}

// launch starts the requested command in the backend sandbox, under a
// wrapper that prints its PID first, and returns the stream of its
// events, closed after the last; the error is the one to end the stream
// with when it cannot start.
func (f *Server) launch(r *http.Request, t target, req startRequestJSON, timeout time.Duration) (<-chan outMsg, *connectErrorJSON) {
	for k, v := range req.Process.Envs {
		t.env[k] = v
	}
	cwd := ""
	if req.Process.Cwd != nil {
		cwd = *req.Process.Cwd
	}
	p := &process{}
	var stdinR *os.File
	if req.Stdin == nil || *req.Stdin {
		var err error
		if stdinR, p.stdin, err = os.Pipe(); err != nil {
			return nil, &connectErrorJSON{Code: "internal", Message: err.Error()}
		}
	}
	pctx, pcancel := context.WithCancel(t.ctx)
	p.cancel = pcancel
	msgs := make(chan outMsg, 64)
	var pid atomic.Uint32
	out := &procOut{msgs: msgs, onStart: func(n uint32) {
		pid.Store(n)
		f.mu.Lock()
		t.sb.procs[n] = p
		f.mu.Unlock()
	}}
	argv := append([]string{"/bin/sh", "-c", `echo "$$"; exec "$@"`, "sh", req.Process.Cmd}, req.Process.Args...)
	user := envdUser(r)
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		pcancel()
		if stdinR != nil {
			stdinR.Close()
		}
		p.closeStdin()
		return nil, &connectErrorJSON{Code: "unavailable", Message: "the fake is closed"}
	}
	f.procs.Add(1)
	f.mu.Unlock()
	go func() {
		defer f.procs.Done()
		defer close(msgs)
		defer pcancel()
		er := sandbox.ExecRequest{Argv: argv, Env: t.env, Cwd: cwd, User: user, Stdout: outWriter{o: out}, Stderr: outWriter{o: out, stderr: true}, Timeout: timeout}
		if stdinR != nil {
			er.Stdin = stdinR
		}
		res, err := f.b.Exec(pctx, t.backend, er)
		if stdinR != nil {
			stdinR.Close()
		}
		p.closeStdin()
		if n := pid.Load(); n != 0 {
			f.mu.Lock()
			if t.sb.procs[n] == p {
				delete(t.sb.procs, n)
			}
			f.mu.Unlock()
		}
		out.finish(req.Process.Cmd, res, err, p.killed.Load())
	}()
	return msgs, nil
}

// proc finds a process of the target sandbox by PID.
func (f *Server) proc(t target, sel selectorJSON) (*process, bool) {
	if sel.PID == nil {
		return nil, false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := t.sb.procs[*sel.PID]
	return p, ok
}

func (f *Server) unaryStart(w http.ResponseWriter, r *http.Request, in any) (target, bool) {
	t, ok := f.target(w, r)
	if !ok {
		return t, false
	}
	if ct := r.Header.Get("Content-Type"); ct != unaryContentType {
		// The Connect protocol: a codec the server does not serve is 415.
		w.Header().Set("Accept-Post", unaryContentType)
		writeJSON(w, http.StatusUnsupportedMediaType, connectErrorJSON{Code: "unknown", Message: fmt.Sprintf("content type %q: the fake serves %s", ct, unaryContentType)})
		return t, false
	}
	b, err := io.ReadAll(r.Body)
	if err == nil {
		err = strictjson.Unmarshal(b, in)
	}
	if err != nil {
		unaryError(w, "invalid_argument", err.Error())
		return t, false
	}
	return t, true
}

// unaryProc starts a unary call about a process (unaryStart) and finds
// the process that sel, a member of in, names; not_found is answered when
// there is none.
func (f *Server) unaryProc(w http.ResponseWriter, r *http.Request, in any, sel *selectorJSON) (target, *process, bool) {
	t, ok := f.unaryStart(w, r, in)
	if !ok {
		return t, nil, false
	}
	p, ok := f.proc(t, *sel)
	if !ok {
		unaryError(w, "not_found", "process not found")
		return t, nil, false
	}
	return t, p, true
}

func unaryOK(w http.ResponseWriter) {
	writeJSON(w, http.StatusOK, struct{}{})
}

func (f *Server) sendInput(w http.ResponseWriter, r *http.Request) {
	var in sendInputJSON
	_, p, ok := f.unaryProc(w, r, &in, &in.Process)
	if !ok {
		return
	}
	if err := p.write(in.Input.Stdin); err != nil {
		unaryError(w, "failed_precondition", "error writing to stdin: "+err.Error())
		return
	}
	unaryOK(w)
}

func (f *Server) closeStdin(w http.ResponseWriter, r *http.Request) {
	var in closeStdinJSON
	_, p, ok := f.unaryProc(w, r, &in, &in.Process)
	if !ok {
		return
	}
	p.closeStdin()
	unaryOK(w)
}

func (f *Server) sendSignal(w http.ResponseWriter, r *http.Request) {
	var in sendSignalJSON
	t, p, ok := f.unaryProc(w, r, &in, &in.Process)
	if !ok {
		return
	}
	switch in.Signal {
	case "SIGNAL_SIGKILL":
		p.killed.Store(true)
		p.cancel()
	case "SIGNAL_SIGTERM":
		res, err := f.b.Exec(r.Context(), t.backend, sandbox.ExecRequest{Argv: []string{"kill", "-TERM", strconv.FormatUint(uint64(*in.Process.PID), 10)}, User: sandbox.UserControl})
		if err != nil || res.ExitCode != 0 {
			unaryError(w, "internal", fmt.Sprintf("error sending signal: %v (exit %d)", err, res.ExitCode))
			return
		}
	default:
		unaryError(w, "invalid_argument", "invalid signal: "+string(in.Signal))
		return
	}
	unaryOK(w)
}

// asRoot says whether a file request is E2B's root's ("username=root"), on
// a backend with users of its own (the microVM's writes files as its
// agent): the file is then read or written as the backend's stasis user,
// as envd does for root.
func (f *Server) asRoot(r *http.Request) bool {
	return r.URL.Query().Get("username") == "root" && f.b.Capabilities().Users
}

// rootWrite writes a file as the backend's stasis user, its directories
// made.
func (f *Server) rootWrite(ctx context.Context, backend, name string, data []byte, mode os.FileMode) error {
	var errb bytes.Buffer
	res, err := f.b.Exec(ctx, backend, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", `mkdir -p -- "${1%/*}" && cat > "$1" && chmod "$2" -- "$1"`, "write", name, fmt.Sprintf("%o", mode.Perm())},
		User: sandbox.UserControl, Stdin: bytes.NewReader(data), Stderr: &errb, Timeout: time.Minute,
	})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return sandbox.Errorf(errdefs.ErrInvalid, "write", backend, "%s: %s", name, strings.TrimSpace(errb.String()))
	}
	return nil
}

// rootRead reads a file as the backend's stasis user.
func (f *Server) rootRead(ctx context.Context, backend, name string) ([]byte, error) {
	var out, errb bytes.Buffer
	res, err := f.b.Exec(ctx, backend, sandbox.ExecRequest{
		Argv: []string{"/bin/sh", "-c", `[ -e "$1" ] || exit 44; cat -- "$1"`, "read", name},
		User: sandbox.UserControl, Stdout: &out, Stderr: &errb, Timeout: time.Minute,
	})
	switch {
	case err != nil:
		return nil, err
	case res.ExitCode == 44:
		return nil, sandbox.Errorf(errdefs.ErrNotFound, "read", backend, "%s does not exist", name)
	case res.ExitCode != 0:
		return nil, fmt.Errorf("read %s: %s", name, strings.TrimSpace(errb.String()))
	}
	return out.Bytes(), nil
}
