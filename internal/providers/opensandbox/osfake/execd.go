package osfake

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"path"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/strictjson"
	"stasis/sandbox"
)

// execUser is whom execd runs commands as: the container's user, root
// in the images OpenSandbox runs, for which the backend's stasis user
// stands (OpenSandbox's command API names no user).
const execUser = sandbox.UserControl

// execd wraps an execd handler: the sandbox must exist (else 404, as a
// gateway with no route), the port must be execd's (else 502), the access
// token of the endpoint must come along (else 401) and the sandbox must run
// (else 409: a paused sandbox's execd does not answer).
func (f *Fake) execd(h func(w http.ResponseWriter, r *http.Request, backend string)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		f.mu.Lock()
		s := f.sandboxes[r.PathValue("id")]
		var backend string
		switch {
		case s == nil:
			f.mu.Unlock()
			writeError(w, http.StatusNotFound, "SANDBOX_NOT_FOUND", fmt.Sprintf("no sandbox %s behind this endpoint", r.PathValue("id")))
			return
		case r.PathValue("port") != strconv.Itoa(ExecdPort):
			f.mu.Unlock()
			writeError(w, http.StatusBadGateway, "BAD_GATEWAY", fmt.Sprintf("nothing listens on port %s in sandbox %s", r.PathValue("port"), s.id))
			return
		case r.Header.Get(execdTokenHeader) != s.token && !strings.HasPrefix(r.URL.Path, "/sandboxes/"+s.id+"/proxy/"):
			f.mu.Unlock()
			writeError(w, http.StatusUnauthorized, "UNAUTHORIZED", "missing or invalid "+execdTokenHeader)
			return
		case s.state != "Running":
			f.mu.Unlock()
			writeError(w, http.StatusConflict, "SANDBOX_NOT_RUNNING", fmt.Sprintf("sandbox %s is %s", s.id, s.state))
			return
		}
		backend = s.backend
		f.mu.Unlock()
		h(w, r, backend)
	}
}

func (f *Fake) ping(w http.ResponseWriter, r *http.Request, backend string) {
	w.WriteHeader(http.StatusOK)
}

// events writes execd's event stream: each event one line of JSON and a
// blank line, flushed at once.
type events struct {
	mu      sync.Mutex
	w       http.ResponseWriter
	started bool
}

func (e *events) send(typ string, fields map[string]any) {
	m := map[string]any{"type": typ, "timestamp": time.Now().UnixMilli()}
	for k, v := range fields {
		m[k] = v
	}
	b, _ := json.Marshal(m)
	e.mu.Lock()
	defer e.mu.Unlock()
	if !e.started {
		e.started = true
		e.w.Header().Set("Content-Type", "text/event-stream")
		e.w.Header().Set("Cache-Control", "no-cache")
		e.w.WriteHeader(http.StatusOK)
	}
	_, _ = e.w.Write(append(b, '\n', '\n'))
	if fl, ok := e.w.(http.Flusher); ok {
		fl.Flush()
	}
}

// lines splits output as execd does: a "\n" or "\r" ends a line, which is
// sent without it; an empty line is sent as "\n" (the "\n" of a "\r\n" is
// no second line); a last line without an end is sent when the command
// ends.
type lines struct {
	mu   sync.Mutex
	emit func(string)
	buf  []byte
	cr   bool
}

func (l *lines) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, b := range p {
		if b == '\n' || b == '\r' {
			switch {
			case len(l.buf) > 0:
				l.emit(string(l.buf))
				l.buf = l.buf[:0]
			case b == '\n' && l.cr:
			default:
				l.emit("\n")
			}
			l.cr = b == '\r'
			continue
		}
		l.cr = false
		l.buf = append(l.buf, b)
	}
	return len(p), nil
}

func (l *lines) flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.buf) > 0 {
		l.emit(string(l.buf))
		l.buf = l.buf[:0]
	}
}

func killed(e *events) {
	e.send("error", map[string]any{"error": map[string]any{"ename": "CommandExecError", "evalue": "-1", "traceback": []string{"signal: killed"}}})
}

// commandRequest is execd's RunCommandRequest (uid and gid, which the
// fake does not run as, left out).
type commandRequest struct {
	Command    string            `json:"command"`
	Cwd        string            `json:"cwd"`
	Background bool              `json:"background"`
	Timeout    int64             `json:"timeout"`
	Envs       map[string]string `json:"envs"`
}

// uploadMetadata is execd's FileMetadata, an upload's metadata part.
type uploadMetadata struct {
	Path string `json:"path"`
	Mode int    `json:"mode"`
}

// runCommand is POST /command: the command runs with sh -c in the backend
// sandbox, not tied to the request (as execd: a client that goes away does
// not end it; DELETE /command does, and so does the timeout).
func (f *Fake) runCommand(w http.ResponseWriter, r *http.Request, backend string) {
	var req commandRequest
	if err := readJSON(r, &req, false); err != nil {
		writeError(w, http.StatusBadRequest, "INVALID_REQUEST_BODY", "error parsing request, MAYBE invalid body format. "+err.Error())
		return
	}
	if req.Command == "" {
		writeError(w, http.StatusBadRequest, "INVALID_REQUEST_BODY", "invalid request, validation error: command is required")
		return
	}
	id := newHex(16)
	ctx, cancel := context.WithCancel(context.Background())
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		cancel()
		writeError(w, http.StatusServiceUnavailable, "RUNTIME_ERROR", "execd is shutting down")
		return
	}
	f.cmds[id] = cancel
	f.wg.Add(1)
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.cmds, id)
		f.mu.Unlock()
		cancel()
		f.wg.Done()
	}()
	ev := &events{w: w}
	start := time.Now()
	argv := []string{"/bin/sh", "-c", req.Command}
	if req.Background {
		ev.send("init", map[string]any{"text": id})
		_, err := f.o.Backend.Exec(ctx, backend, sandbox.ExecRequest{User: execUser, Argv: argv, Env: req.Envs, Cwd: req.Cwd, Background: true, LogPath: "/tmp/" + id + ".output"})
		if err != nil {
			ev.send("error", map[string]any{"error": map[string]any{"ename": "CommandExecError", "evalue": err.Error(), "traceback": []string{err.Error()}}})
			return
		}
		ev.send("execution_complete", map[string]any{"execution_time": time.Since(start).Milliseconds()})
		return
	}
	ev.send("init", map[string]any{"text": id})
	done := make(chan struct{})
	defer close(done)
	go func() { // execd's keep-alive
		t := time.NewTicker(3 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				ev.send("ping", map[string]any{"text": "pong"})
			case <-done:
				return
			}
		}
	}()
	stdout := &lines{emit: func(s string) { ev.send("stdout", map[string]any{"text": s}) }}
	stderr := &lines{emit: func(s string) { ev.send("stderr", map[string]any{"text": s}) }}
	res, err := f.o.Backend.Exec(ctx, backend, sandbox.ExecRequest{User: execUser, Argv: argv, Env: req.Envs, Cwd: req.Cwd, Stdout: stdout, Stderr: stderr, Timeout: time.Duration(req.Timeout) * time.Millisecond})
	stdout.flush()
	stderr.flush()
	switch {
	case errors.Is(err, errdefs.ErrTimeout), ctx.Err() != nil:
		killed(ev)
	case err != nil:
		ev.send("error", map[string]any{"error": map[string]any{"ename": "CommandExecError", "evalue": err.Error(), "traceback": []string{err.Error()}}})
	case res.ExitCode == 0:
		ev.send("execution_complete", map[string]any{"execution_time": time.Since(start).Milliseconds()})
	case res.ExitCode < 0:
		killed(ev)
	default:
		ev.send("error", map[string]any{"error": map[string]any{"ename": "CommandExecError", "evalue": strconv.Itoa(res.ExitCode), "traceback": []string{"exit status " + strconv.Itoa(res.ExitCode)}}})
	}
}

// interruptCommand is DELETE /command?id=: it kills a running command.
func (f *Fake) interruptCommand(w http.ResponseWriter, r *http.Request, backend string) {
	id := r.URL.Query().Get("id")
	f.mu.Lock()
	cancel := f.cmds[id]
	f.mu.Unlock()
	if id == "" || cancel == nil {
		writeError(w, http.StatusBadRequest, "INVALID_REQUEST_BODY", fmt.Sprintf("command session %q is not running", id))
		return
	}
	cancel()
	w.WriteHeader(http.StatusOK)
}

// upload is POST /files/upload: pairs of a metadata part (a file part
// named "metadata" holding JSON) and a file part; parent directories are
// made; mode is octal digits read as decimal (0: left as created, 755).
func (f *Fake) upload(w http.ResponseWriter, r *http.Request, backend string) {
	mr, err := r.MultipartReader()
	if err != nil {
		writeError(w, http.StatusBadRequest, "INVALID_FILE", "multipart form is empty")
		return
	}
	var metas []uploadMetadata
	var files [][]byte
	for {
		part, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			writeError(w, http.StatusBadRequest, "INVALID_FILE", "bad multipart form: "+err.Error())
			return
		}
		b, err := io.ReadAll(part)
		if err != nil {
			writeError(w, http.StatusBadRequest, "INVALID_FILE", "bad multipart form: "+err.Error())
			return
		}
		if part.FileName() == "" {
			continue // a plain form value: execd reads only file parts
		}
		switch part.FormName() {
		case "metadata":
			var m uploadMetadata
			if err := strictjson.Unmarshal(b, &m); err != nil {
				writeError(w, http.StatusBadRequest, "INVALID_FILE_METADATA", "invalid metadata format. "+err.Error())
				return
			}
			metas = append(metas, m)
		case "file":
			files = append(files, b)
		}
	}
	switch {
	case len(metas) == 0:
		writeError(w, http.StatusBadRequest, "INVALID_FILE_METADATA", "metadata file is missing")
		return
	case len(files) == 0:
		writeError(w, http.StatusBadRequest, "INVALID_FILE_CONTENT", "file is missing")
		return
	case len(metas) != len(files):
		writeError(w, http.StatusBadRequest, "INVALID_FILE", fmt.Sprintf("metadata and file count mismatch: %d vs %d", len(metas), len(files)))
		return
	}
	for i, m := range metas {
		if m.Path == "" {
			writeError(w, http.StatusBadRequest, "INVALID_FILE_METADATA", "metadata path is empty")
			return
		}
		mode := uint64(0o755)
		if m.Mode != 0 {
			if mode, err = strconv.ParseUint(strconv.Itoa(m.Mode), 8, 32); err != nil {
				writeError(w, http.StatusInternalServerError, "RUNTIME_ERROR", fmt.Sprintf("error chmoding file %s. %v", m.Path, err))
				return
			}
		}
		if err := f.o.Backend.WriteFile(r.Context(), backend, m.Path, files[i], fsMode(mode)); err != nil {
			writeError(w, http.StatusInternalServerError, "RUNTIME_ERROR", fmt.Sprintf("error writing file %s. %v", m.Path, err))
			return
		}
	}
	w.WriteHeader(http.StatusOK)
}

// download is GET /files/download?path= (with Range support).
func (f *Fake) download(w http.ResponseWriter, r *http.Request, backend string) {
	name := r.URL.Query().Get("path")
	if name == "" {
		writeError(w, http.StatusBadRequest, "MISSING_QUERY", "missing query parameter 'path'")
		return
	}
	data, err := f.o.Backend.ReadFile(r.Context(), backend, name)
	if errors.Is(err, errdefs.ErrNotFound) {
		writeError(w, http.StatusNotFound, "FILE_NOT_FOUND", fmt.Sprintf("file not found. open %s: no such file or directory", name))
		return
	}
	if err != nil {
		writeError(w, http.StatusInternalServerError, "RUNTIME_ERROR", fmt.Sprintf("error accessing file: %v", err))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", `attachment; filename="`+path.Base(name)+`"`)
	http.ServeContent(w, r, path.Base(name), time.Time{}, bytes.NewReader(data))
}

// removeFiles is DELETE /files?path=…: files only, not directories.
func (f *Fake) removeFiles(w http.ResponseWriter, r *http.Request, backend string) {
	paths := r.URL.Query()["path"]
	if len(paths) > 0 {
		argv := append([]string{"rm", "-f", "--"}, paths...)
		if _, err := f.o.Backend.Exec(r.Context(), backend, sandbox.ExecRequest{User: execUser, Argv: argv, Timeout: time.Minute}); err != nil {
			writeError(w, http.StatusInternalServerError, "RUNTIME_ERROR", err.Error())
			return
		}
	}
	w.WriteHeader(http.StatusOK)
}

func fsMode(m uint64) fs.FileMode { return fs.FileMode(m).Perm() }
