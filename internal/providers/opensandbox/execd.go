package opensandbox

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"
	"os"
	"path"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"stasis/errdefs"
	"stasis/internal/fileop"
	"stasis/sandbox"
)

// endpoint is where a sandbox's execd answers, and the headers it wants.
type endpoint struct {
	url     string
	headers map[string]string
}

// fetchEndpoint asks the Lifecycle API where execd is.
func (p *Provider) fetchEndpoint(ctx context.Context, op, id string) (*endpoint, error) {
	q := url.Values{}
	if p.o.UseServerProxy {
		q.Set("use_server_proxy", "true")
	}
	var r apiEndpoint
	err := p.do(ctx, call{method: http.MethodGet, url: p.base + "/sandboxes/" + url.PathEscape(id) + "/endpoints/" + strconv.Itoa(ExecdPort), query: q, apiKey: true, idempotent: true, retry500: true}, &r)
	if isStatus(err, http.StatusNotFound) {
		return nil, p.vanished(ctx, op, id, p.fail(op, what(id), err))
	}
	if err != nil {
		return nil, p.fail(op, what(id), err)
	}
	if r.Endpoint == "" {
		return nil, fmt.Errorf("%s %s: the server gave no endpoint for execd (port %d)", op, what(id), ExecdPort)
	}
	u := r.Endpoint
	if !strings.Contains(u, "://") {
		u = p.scheme + "://" + u
	}
	ep := &endpoint{url: strings.TrimRight(u, "/"), headers: map[string]string{}}
	for k, v := range r.Headers {
		ep.headers[k] = v
	}
	if p.o.UseServerProxy && p.o.APIKey != "" {
		if _, ok := ep.headers[execdTokenHeader]; !ok {
			ep.headers[execdTokenHeader] = p.o.APIKey
		}
	}
	return ep, nil
}

// execd returns the endpoint of a running sandbox's execd.
func (p *Provider) execd(ctx context.Context, op, id string) (*endpoint, error) {
	if _, err := p.live(ctx, op, id); err != nil {
		return nil, err
	}
	p.mu.Lock()
	var ep *endpoint
	if k := p.known[id]; k != nil {
		ep = k.ep
	}
	p.mu.Unlock()
	if ep != nil {
		return ep, nil
	}
	ep, err := p.fetchEndpoint(ctx, op, id)
	if err != nil {
		return nil, err
	}
	p.setEndpoint(id, ep)
	return ep, nil
}

func (p *Provider) setEndpoint(id string, ep *endpoint) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if k := p.known[id]; k != nil {
		k.ep = ep
	}
}

// waitExecd finds execd and polls its /ping until it answers, bounded by
// ReadyTimeout.
func (p *Provider) waitExecd(ctx context.Context, op, id string) (*endpoint, error) {
	ep, err := p.fetchEndpoint(ctx, op, id)
	if err != nil {
		return nil, err
	}
	deadline := p.o.Now().Add(p.o.ReadyTimeout)
	for {
		err := p.do(ctx, p.execdCall(ep, call{method: http.MethodGet, url: "/ping"}), nil)
		if err == nil {
			return ep, nil
		}
		if isStatus(err, http.StatusUnauthorized) || isStatus(err, http.StatusForbidden) {
			return nil, fmt.Errorf("%s %s: execd refused the endpoint's credentials (%v); check the server's secure-access settings", op, what(id), err)
		}
		if p.o.Now().After(deadline) {
			return nil, sandbox.Errorf(errdefs.ErrTimeout, op, what(id), "its execd at %s did not answer within %s (%v); check the sandbox's image and the OpenSandbox server", ep.url, p.o.ReadyTimeout, err)
		}
		if err := p.sleep(ctx, p.o.PollInterval); err != nil {
			return nil, fmt.Errorf("%s %s: waiting for execd: %w", op, what(id), err)
		}
	}
}

// execdCall makes c a call to execd at ep (c.url is the path).
func (p *Provider) execdCall(ep *endpoint, c call) call {
	c.url = ep.url + c.url
	h := make(map[string]string, len(ep.headers)+len(c.headers))
	for k, v := range ep.headers {
		h[k] = v
	}
	for k, v := range c.headers {
		h[k] = v
	}
	c.headers = h
	return c
}

// execdFail turns an error from execd into one about the sandbox (when it
// is gone or no longer runs) or about the request.
func (p *Provider) execdFail(ctx context.Context, op, id string, err error) error {
	var he *httpError
	var te *transportError
	switch {
	case errors.As(err, &he) && (he.Status == http.StatusUnauthorized || he.Status == http.StatusForbidden):
		p.forget(id) // the endpoint's headers may be stale
		return fmt.Errorf("%s %s: execd refused the request (%s); the endpoint's credentials may have changed: retry", op, what(id), he.detail())
	case errors.As(err, &he), errors.As(err, &te):
		msg := err.Error()
		if he != nil {
			msg = he.detail()
		}
		return p.vanished(ctx, op, id, fmt.Errorf("%s %s: execd in the sandbox answered: %s", op, what(id), msg))
	}
	return fmt.Errorf("%s %s: %w", op, what(id), err)
}

// abs makes a path inside the sandbox absolute (relative to WorkDir).
func (p *Provider) abs(name string) string {
	if path.IsAbs(name) {
		return path.Clean(name)
	}
	return path.Join(p.o.WorkDir, name)
}

// quote quotes s for sh.
func quote(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func quoteAll(argv []string) string {
	q := make([]string, len(argv))
	for i, a := range argv {
		q[i] = quote(a)
	}
	return strings.Join(q, " ")
}

// wrapScript is the shell command execd runs for argv: argv runs in a
// subshell by exec (so argv[0] is a program, never a shell builtin), with
// stdin from the uploaded file (removed at once) or /dev/null; then the
// marker and the exit code go to stdout, and the marker to stderr, each
// after a newline. The reader of the stream drops that newline and the
// marker line, which gives back the output exactly as written, with or
// without a final newline.
func wrapScript(argv []string, stdinPath, mark string) string {
	var b strings.Builder
	b.WriteString("( ")
	if stdinPath != "" {
		b.WriteString("rm -f -- " + quote(stdinPath) + "; ")
	}
	b.WriteString("exec " + quoteAll(argv) + " )")
	if stdinPath != "" {
		b.WriteString(" <" + quote(stdinPath))
	} else {
		b.WriteString(" </dev/null")
	}
	fmt.Fprintf(&b, "; __stasis_rc=$?; printf '\\n%%s %%d\\n' %s \"$__stasis_rc\"; printf '\\n%%s\\n' %s >&2; exit \"$__stasis_rc\"", quote(mark), quote(mark))
	return b.String()
}

// lineOut rebuilds one output stream from execd's line events, up to the
// wrapper's marker. An event is a line without its terminator ("\n" for
// an empty line). The newlines that end lines are owed until the next line
// or the marker: at the marker the last one owed is the wrapper's own and
// is dropped. (A "\r" that ended a line comes back as "\n": execd treats
// both as line ends.)
type lineOut struct {
	w    io.Writer
	mark string
	// peer is the other stream when both go to the same writer: before a
	// line of one, the newlines the other owes are written (but the last,
	// which may be the wrapper's, when it owes more than one), so lines
	// interleave whole, in the order execd sent them.
	peer *lineOut
	owed int
	done bool
	rc   *int
	err  error
}

func (l *lineOut) event(text string) {
	if l.done {
		return
	}
	if text == "\n" {
		l.owed++
		return
	}
	if rest, ok := strings.CutPrefix(text, l.mark); ok && (rest == "" || rest[0] == ' ') {
		if n, err := strconv.Atoi(strings.TrimSpace(rest)); err == nil {
			l.rc = &n
		}
		l.newlines(l.owed - 1)
		l.done = true
		return
	}
	if p := l.peer; p != nil && !p.done && p.owed > 0 {
		keep := 0
		if p.owed > 1 {
			keep = 1
		}
		p.newlines(p.owed - keep)
		p.owed = keep
	}
	l.newlines(l.owed)
	l.write(text)
	l.owed = 1
}

func (l *lineOut) newlines(n int) {
	if n > 0 {
		l.write(strings.Repeat("\n", n))
	}
}

// end settles a stream that ended without its marker.
func (l *lineOut) end() {
	if !l.done {
		l.newlines(l.owed)
		l.owed = 0
	}
	l.done = true
}

func (l *lineOut) write(s string) {
	if l.err != nil || s == "" {
		return
	}
	_, l.err = io.WriteString(l.w, s)
}

// sameWriter says whether a and b are the same writer.
func sameWriter(a, b io.Writer) bool {
	ta, tb := reflect.TypeOf(a), reflect.TypeOf(b)
	return ta == tb && ta != nil && ta.Comparable() && a == b
}

// readEvents reads a server-sent event stream and calls fn with the data
// of each event. Both framings are read: the standard one ("data:" lines)
// and execd's (a bare JSON line per event).
func readEvents(r io.Reader, fn func(data []byte) error) error {
	br := bufio.NewReaderSize(r, 64<<10)
	var data []byte
	has := false
	dispatch := func() error {
		if !has {
			return nil
		}
		d := data
		data, has = nil, false
		return fn(d)
	}
	add := func(b []byte) {
		if has {
			data = append(data, '\n')
		}
		data = append(data, b...)
		has = true
	}
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			line = bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r"))
			switch {
			case len(line) == 0:
				if e := dispatch(); e != nil {
					return e
				}
			case line[0] == ':':
			case line[0] == '{':
				add(line)
			default:
				field, value, _ := bytes.Cut(line, []byte(":"))
				if string(field) == "data" {
					add(bytes.TrimPrefix(value, []byte(" ")))
				}
			}
		}
		if err == io.EOF {
			return dispatch()
		}
		if err != nil {
			return err
		}
	}
}

// outcome is what the event stream of one command said.
type outcome struct {
	cmdID    string
	complete bool
	errEvent bool
	errName  string
	errValue string
}

// clientGrace is how long past a command's timeout the client waits for
// execd to end it before interrupting it itself.
const clientGrace = 10 * time.Second

// runCommand runs a command through execd's POST /command, streaming its
// output to out and errOut. With timeout > 0 the command is interrupted
// (DELETE /command) when execd has not ended it by timeout+clientGrace;
// timedOut then says so.
func (p *Provider) runCommand(ctx context.Context, op, id string, ep *endpoint, rc runCommandRequest, timeout time.Duration, out, errOut *lineOut) (oc outcome, timedOut bool, err error) {
	cctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var late atomic.Bool
	if timeout > 0 {
		t := time.AfterFunc(timeout+clientGrace, func() { late.Store(true); cancel() })
		defer t.Stop()
	}
	c := p.execdCall(ep, call{method: http.MethodPost, url: "/command", body: jsonBody(rc), contentType: "application/json", headers: map[string]string{"Accept": "text/event-stream"}, long: true})
	resp, err := p.send(cctx, c)
	if err != nil {
		if late.Load() {
			return oc, true, nil
		}
		if ctx.Err() != nil {
			return oc, false, fmt.Errorf("%s %s: %w", op, what(id), ctx.Err())
		}
		return oc, false, p.execdFail(ctx, op, id, err)
	}
	defer resp.Body.Close()
	rerr := readEvents(resp.Body, func(data []byte) error {
		var ev streamEvent
		if json.Unmarshal(data, &ev) != nil {
			return nil // not an event of the specification: skip it
		}
		switch ev.Type {
		case "init":
			oc.cmdID = ev.Text
		case "stdout":
			out.event(ev.Text)
		case "stderr":
			errOut.event(ev.Text)
		case "execution_complete":
			oc.complete = true
		case "error":
			oc.errEvent = true
			oc.errName, oc.errValue = ev.EName, ev.EValue
			if ev.Error != nil {
				oc.errName, oc.errValue = ev.Error.EName, ev.Error.EValue
			}
		}
		return nil
	})
	if late.Load() || ctx.Err() != nil {
		p.interrupt(ep, oc.cmdID)
		if late.Load() {
			return oc, true, nil
		}
		return oc, false, fmt.Errorf("%s %s: %w", op, what(id), ctx.Err())
	}
	if rerr != nil && out.rc == nil {
		return oc, false, p.vanished(ctx, op, id, fmt.Errorf("%s %s: the command's output stream broke: %v", op, what(id), rerr))
	}
	return oc, false, nil
}

// interrupt asks execd to kill a command (best effort).
func (p *Provider) interrupt(ep *endpoint, cmdID string) {
	if cmdID == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = p.do(ctx, p.execdCall(ep, call{method: http.MethodDelete, url: "/command", query: url.Values{"id": {cmdID}}, idempotent: true}), nil)
}

// Exec runs a command in the sandbox through execd.
func (p *Provider) Exec(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if len(req.Argv) == 0 {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", what(id), "no command")
	}
	ep, err := p.execd(ctx, "exec", id)
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	if req.Background {
		return p.background(ctx, id, req)
	}
	stdinPath := ""
	if req.Stdin != nil {
		stdinPath = "/tmp/.stasis-stdin-" + newHex(8)
		if err := p.uploadStream(ctx, "exec", id, ep, stdinPath, 0o600, req.Stdin); err != nil {
			return sandbox.ExecResult{}, err
		}
	}
	mark := "__stasis_end_" + newHex(8)
	cwd := req.Cwd
	if cwd == "" {
		cwd = p.o.WorkDir
	}
	rc := runCommandRequest{Command: wrapScript(req.Argv, stdinPath, mark), Cwd: cwd, Envs: req.Env}
	if req.Timeout > 0 {
		rc.Timeout = max(req.Timeout.Milliseconds(), 1)
	}
	stdout, stderr := req.Stdout, req.Stderr
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	out, errOut := &lineOut{w: stdout, mark: mark}, &lineOut{w: stderr, mark: mark}
	if sameWriter(stdout, stderr) {
		out.peer, errOut.peer = errOut, out
	}
	start := time.Now()
	oc, timedOut, err := p.runCommand(ctx, "exec", id, ep, rc, req.Timeout, out, errOut)
	if err != nil {
		if stdinPath != "" {
			p.removeFile(ep, stdinPath)
		}
		return sandbox.ExecResult{}, err
	}
	if out.rc != nil {
		errOut.end()
		if out.err != nil || errOut.err != nil {
			return sandbox.ExecResult{ExitCode: *out.rc}, fmt.Errorf("exec in %s: writing the output: %w", what(id), errors.Join(out.err, errOut.err))
		}
		return sandbox.ExecResult{ExitCode: *out.rc}, nil
	}
	out.end()
	errOut.end()
	if timedOut || req.Timeout > 0 && time.Since(start) >= req.Timeout {
		return sandbox.ExecResult{ExitCode: -9}, sandbox.Errorf(errdefs.ErrTimeout, "exec", what(id), "%q ran past its %s timeout and was killed", strings.Join(req.Argv, " "), req.Timeout)
	}
	// The wrapper did not finish: the sandbox went, or something killed it.
	if err := p.vanished(ctx, "exec", id, nil); err != nil {
		return sandbox.ExecResult{}, err
	}
	switch {
	case oc.errEvent:
		return sandbox.ExecResult{}, fmt.Errorf("exec in %s: execd could not run %q to its end (%s: %s)", what(id), strings.Join(req.Argv, " "), oc.errName, oc.errValue)
	case oc.complete:
		return sandbox.ExecResult{}, nil
	}
	return sandbox.ExecResult{}, fmt.Errorf("exec in %s: the command's output stream ended before it did", what(id))
}

// background starts argv under setsid (when the image has it), its output
// appended to LogPath, and returns its PID as the sandbox sees it. execd's
// own background mode gives no PID, so a short foreground command starts it.
func (p *Provider) background(ctx context.Context, id string, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	logPath := "/dev/null"
	if req.LogPath != "" {
		logPath = req.LogPath
	}
	argv, log := quoteAll(req.Argv), quote(logPath)
	var script strings.Builder
	if req.LogPath != "" {
		script.WriteString("mkdir -p -- " + quote(path.Dir(logPath)) + " || exit 125\n")
	}
	fmt.Fprintf(&script, "if command -v setsid >/dev/null 2>&1; then setsid %s </dev/null >>%s 2>&1 & else %s </dev/null >>%s 2>&1 & fi\necho $!\n", argv, log, argv, log)
	var out, errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"/bin/sh", "-c", script.String()}, Env: req.Env, Cwd: req.Cwd, Stdout: &out, Stderr: &errb, Timeout: time.Minute})
	if err != nil {
		return sandbox.ExecResult{}, err
	}
	if res.ExitCode != 0 {
		return sandbox.ExecResult{}, fmt.Errorf("exec in %s: start %q in the background: exit %d: %s", what(id), req.Argv[0], res.ExitCode, strings.TrimSpace(errb.String()))
	}
	pid, err := strconv.Atoi(strings.TrimSpace(out.String()))
	if err != nil {
		return sandbox.ExecResult{}, fmt.Errorf("exec in %s: the background start printed %q, not a PID", what(id), out.String())
	}
	return sandbox.ExecResult{PID: pid}, nil
}

// octalMode is a mode as execd takes it: the octal digits read as decimal.
func octalMode(mode fs.FileMode) int {
	n, _ := strconv.Atoi(strconv.FormatUint(uint64(mode.Perm()), 8))
	return n
}

// writeUpload writes execd's upload form: a metadata part (a file part
// named "metadata", as execd reads it) then the file part.
func writeUpload(mw *multipart.Writer, name string, mode fs.FileMode, r io.Reader) error {
	h := textproto.MIMEHeader{}
	h.Set("Content-Disposition", `form-data; name="metadata"; filename="metadata"`)
	h.Set("Content-Type", "application/json")
	part, err := mw.CreatePart(h)
	if err != nil {
		return err
	}
	if _, err := part.Write(jsonBody(fileMetadata{Path: name, Mode: octalMode(mode)})); err != nil {
		return err
	}
	if part, err = mw.CreateFormFile("file", path.Base(name)); err != nil {
		return err
	}
	if _, err := io.Copy(part, r); err != nil {
		return err
	}
	return mw.Close()
}

// uploadStream uploads r to name in the sandbox, streaming it (such an
// upload is not retried).
func (p *Provider) uploadStream(ctx context.Context, op, id string, ep *endpoint, name string, mode fs.FileMode, r io.Reader) error {
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		pw.CloseWithError(writeUpload(mw, name, mode, r))
	}()
	err := p.do(ctx, p.execdCall(ep, call{method: http.MethodPost, url: "/files/upload", stream: pr, contentType: mw.FormDataContentType(), long: true}), nil)
	pr.CloseWithError(errors.New("upload ended"))
	wg.Wait()
	if err != nil {
		return p.execdFail(ctx, op, id, err)
	}
	return nil
}

// removeFile deletes a file in the sandbox (best effort).
func (p *Provider) removeFile(ep *endpoint, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = p.do(ctx, p.execdCall(ep, call{method: http.MethodDelete, url: "/files", query: url.Values{"path": {name}}, idempotent: true}), nil)
}

// ReadFile reads a file through execd's download.
func (p *Provider) ReadFile(ctx context.Context, id, name string) ([]byte, error) {
	ep, err := p.execd(ctx, "read", id)
	if err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	if err := p.download(ctx, "read", id, ep, p.abs(name), &buf); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

func (p *Provider) download(ctx context.Context, op, id string, ep *endpoint, name string, w io.Writer) error {
	resp, err := p.send(ctx, p.execdCall(ep, call{method: http.MethodGet, url: "/files/download", query: url.Values{"path": {name}}, idempotent: true, long: true}))
	var he *httpError
	if errors.As(err, &he) && he.Status == http.StatusNotFound && he.Code == "FILE_NOT_FOUND" {
		return sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "no file %s", name)
	}
	if err != nil {
		return p.execdFail(ctx, op, id, err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(w, resp.Body); err != nil {
		return fmt.Errorf("%s %s: %s: %w", op, what(id), name, err)
	}
	return nil
}

// WriteFile writes a file through execd's upload (which makes the parent
// directories) with the given permission bits.
func (p *Provider) WriteFile(ctx context.Context, id, name string, data []byte, mode fs.FileMode) error {
	ep, err := p.execd(ctx, "write", id)
	if err != nil {
		return err
	}
	name = p.abs(name)
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	if err := writeUpload(mw, name, mode, bytes.NewReader(data)); err != nil {
		return err
	}
	err = p.do(ctx, p.execdCall(ep, call{method: http.MethodPost, url: "/files/upload", body: body.Bytes(), contentType: mw.FormDataContentType(), idempotent: true, long: true}), nil)
	if err != nil {
		return p.execdFail(ctx, "write", id, err)
	}
	if mode.Perm() == 0 { // execd leaves a mode of 0 alone
		var errb bytes.Buffer
		res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"chmod", "0", "--", name}, Stderr: &errb, Timeout: time.Minute})
		if err != nil {
			return err
		}
		if res.ExitCode != 0 {
			return fmt.Errorf("write %s: chmod 0 %s: %s", what(id), name, strings.TrimSpace(errb.String()))
		}
	}
	return nil
}

// Upload extracts a tar stream into dir: the stream is uploaded as a file
// and tar, in the sandbox, extracts it.
func (p *Provider) Upload(ctx context.Context, id, dir string, r io.Reader) error {
	ep, err := p.execd(ctx, "upload", id)
	if err != nil {
		return err
	}
	tmp := "/tmp/.stasis-upload-" + newHex(8) + ".tar"
	if err := p.uploadStream(ctx, "upload", id, ep, tmp, 0o600, r); err != nil {
		p.removeFile(ep, tmp)
		return err
	}
	var errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{
		Argv:   []string{"/bin/sh", "-c", `mkdir -p -- "$1" && tar -x --no-same-owner -C "$1" -f "$2"; rc=$?; rm -f -- "$2"; exit $rc`, "upload", p.abs(dir), tmp},
		Stderr: &errb,
	})
	if err != nil {
		p.removeFile(ep, tmp)
		return err
	}
	if res.ExitCode != 0 {
		return sandbox.Errorf(errdefs.ErrInvalid, "upload", what(id), "into %s: tar exited %d: %s", dir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}

// Download writes dir as a tar stream: tar, in the sandbox, writes it to a
// file, which is downloaded and removed.
func (p *Provider) Download(ctx context.Context, id, dir string, w io.Writer) error {
	ep, err := p.execd(ctx, "download", id)
	if err != nil {
		return err
	}
	tmp := "/tmp/.stasis-download-" + newHex(8) + ".tar"
	defer p.removeFile(ep, tmp)
	var errb bytes.Buffer
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"tar", "-c", "-C", p.abs(dir), "-f", tmp, "."}, Stderr: &errb})
	if err != nil {
		return err
	}
	if res.ExitCode != 0 {
		return sandbox.Errorf(errdefs.ErrNotFound, "download", what(id), "%s: tar exited %d: %s", dir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return p.download(ctx, "download", id, ep, tmp, w)
}

// tarDir checks a host directory and returns a function that streams it
// as a tar (regular files, directories and symlinks; modes and times kept).
func tarDir(root string) (func() (io.ReadCloser, error), error) {
	fi, err := os.Stat(root)
	if err != nil {
		return nil, err
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%s is not a directory", root)
	}
	return func() (io.ReadCloser, error) {
		pr, pw := io.Pipe()
		go func() { pw.CloseWithError(fileop.Pack(root, pw)) }()
		return pr, nil
	}, nil
}
