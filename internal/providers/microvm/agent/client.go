package agent

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"stasis/errdefs"
	"stasis/internal/guestclock"
	"stasis/sandbox"
)

// execGrace is how long past an exec's own timeout the client waits for
// the agent to report it before giving up on the agent.
const execGrace = 10 * time.Second

// Client talks to one agent. Its errors are sandbox errors (ErrNotFound,
// ErrInvalid, ErrTimeout, ...) whose What is the client's What; an error
// reaching the agent at all is a plain error naming the agent's address.
type Client struct {
	// What names the sandbox in errors ("sandbox sb-…"); empty by default.
	// Set it before the first call.
	What string

	base string
	tr   *http.Transport
	hc   *http.Client
}

// New makes a client for the agent at baseURL ("http://127.0.0.1:PORT"),
// with its own connection pool: a short dial timeout, no proxy whatever the
// environment says, no compression.
func New(baseURL string) *Client {
	tr := &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 3 * time.Second, KeepAlive: 15 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 8,
		IdleConnTimeout:     30 * time.Second,
		DisableCompression:  true,
	}
	return &Client{base: strings.TrimRight(baseURL, "/"), tr: tr, hc: &http.Client{Transport: tr}}
}

// CloseIdle closes the pooled connections; call it after the VM was
// restored from a snapshot, whose connections are gone.
func (c *Client) CloseIdle() { c.tr.CloseIdleConnections() }

// do sends a request and returns the response when its status is want;
// otherwise it returns the agent's error.
func (c *Client) do(ctx context.Context, op, method, path string, q url.Values, body io.Reader, want int) (*http.Response, error) {
	u := c.base + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", op, err)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, c.netError(op, err)
	}
	if resp.StatusCode == want {
		return resp, nil
	}
	defer resp.Body.Close()
	return nil, c.statusError(op, resp)
}

func (c *Client) netError(op string, err error) error {
	if c.What != "" {
		op += " " + c.What
	}
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	return fmt.Errorf("%s: agent at %s: %w", op, c.base, err)
}

// statusError reads an error answer.
func (c *Client) statusError(op string, resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var we wireError
	if json.Unmarshal(b, &we) != nil || we.Kind == "" {
		if resp.StatusCode == http.StatusNotFound || resp.StatusCode == http.StatusMethodNotAllowed {
			return sandbox.Errorf(errdefs.ErrUnsupported, op, c.What, "the agent does not serve %s %s (an older agent?)", resp.Request.Method, resp.Request.URL.Path)
		}
		we = wireError{Message: fmt.Sprintf("%s: %s", resp.Status, strings.TrimSpace(string(b)))}
	}
	return we.toError(op, c.What)
}

// discard reads what is left of a response and closes it, so that its
// connection can be reused.
func discard(resp *http.Response) {
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 256<<10))
	resp.Body.Close()
}

// Exec runs a command in the guest; see the package doc for what the agent
// does. Stdin is streamed to the command as the command runs; Exec may
// return (the command having ended) before Stdin is read to its end, and
// then stops reading it at the next Read's return. A cancelled ctx kills
// the command and Exec returns ctx.Err().
func (c *Client) Exec(ctx context.Context, req sandbox.ExecRequest) (sandbox.ExecResult, error) {
	if len(req.Argv) == 0 || req.Argv[0] == "" {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", c.What, "no command")
	}
	h := execHeader{Argv: req.Argv, Env: req.Env, Cwd: req.Cwd, Background: req.Background, User: string(req.User)}
	if req.Background {
		h.LogPath = req.LogPath
	} else if req.Timeout > 0 {
		h.TimeoutMS = max(req.Timeout.Milliseconds(), 1)
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeoutCause(ctx, req.Timeout+execGrace, errAgentLate)
		defer cancel()
	}
	line, err := json.Marshal(h)
	if err != nil {
		return sandbox.ExecResult{}, sandbox.Errorf(errdefs.ErrInvalid, "exec", c.What, "%v", err)
	}
	var body io.Reader = bytes.NewReader(append(line, '\n'))
	if req.Stdin != nil && !req.Background {
		// Stdin goes through a pipe that Exec closes when it returns or
		// ctx ends: the transport waits for a body Read to return before it
		// gives up a request, and Stdin's Read may block for ever.
		pr, pw := io.Pipe()
		go func() {
			_, err := io.Copy(pw, req.Stdin)
			pw.CloseWithError(err) // nil: the command sees end of file
		}()
		defer pr.CloseWithError(errExecReturned)
		stop := context.AfterFunc(ctx, func() { pr.CloseWithError(ctx.Err()) })
		defer stop()
		body = io.MultiReader(body, pr)
	}
	resp, err := c.do(ctx, "exec", http.MethodPost, "/v1/exec", nil, body, http.StatusOK)
	if err != nil {
		return sandbox.ExecResult{}, c.execCtxError(ctx, err)
	}
	end, err := c.readFrames(resp.Body, req.Stdout, req.Stderr)
	if err != nil {
		// Closing the stream unread ends the connection, and the agent
		// kills the command.
		resp.Body.Close()
		return sandbox.ExecResult{}, c.execCtxError(ctx, err)
	}
	discard(resp) // nothing comes after the end frame
	res := sandbox.ExecResult{ExitCode: end.ExitCode, PID: end.PID}
	if end.Kind != "" {
		return res, end.toError("exec", c.What)
	}
	return res, nil
}

var (
	errAgentLate    = errors.New("the agent did not report the command's end in time")
	errExecReturned = errors.New("exec returned")
)

// execCtxError prefers the context's story to the transport's.
func (c *Client) execCtxError(ctx context.Context, err error) error {
	if ctx.Err() == nil {
		return err
	}
	if cause := context.Cause(ctx); cause == errAgentLate {
		return sandbox.Errorf(errdefs.ErrTimeout, "exec", c.What, "%v", cause)
	}
	return ctx.Err()
}

// readFrames copies output frames to stdout and stderr (nil: dropped) until
// the end frame, and returns it.
func (c *Client) readFrames(r io.Reader, stdout, stderr io.Writer) (endFrame, error) {
	br := bufio.NewReaderSize(r, pipeChunk+frameHeaderLen)
	var buf []byte
	for {
		kind, data, nb, err := readFrame(br, buf)
		buf = nb
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return endFrame{}, c.netError("exec", errors.New("the stream ended before the command did (the connection broke)"))
		}
		if err != nil {
			return endFrame{}, c.netError("exec", err)
		}
		var w io.Writer
		switch kind {
		case frameStdout:
			w = stdout
		case frameStderr:
			w = stderr
		case frameEnd:
			return parseEnd(data)
		}
		if w != nil {
			if _, err := w.Write(data); err != nil {
				return endFrame{}, fmt.Errorf("exec: write the command's output: %w", err)
			}
		}
	}
}

// ReadFile reads a whole file; ErrNotFound if it is missing or a
// directory.
func (c *Client) ReadFile(ctx context.Context, path string) ([]byte, error) {
	resp, err := c.do(ctx, "read", http.MethodGet, "/v1/file", url.Values{"path": {path}}, nil, http.StatusOK)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, c.netError("read", err)
	}
	if msg := resp.Trailer.Get(errTrailer); msg != "" {
		return nil, wireError{Message: msg}.toError("read", c.What)
	}
	return b, nil
}

// WriteFile writes a file atomically with the given mode (permission,
// setuid, setgid and sticky bits), making its parent directories.
func (c *Client) WriteFile(ctx context.Context, path string, data []byte, mode fs.FileMode) error {
	q := url.Values{"path": {path}, "mode": {"0" + strconv.FormatUint(uint64(unixMode(mode)), 8)}}
	resp, err := c.do(ctx, "write", http.MethodPut, "/v1/file", q, bytes.NewReader(data), http.StatusNoContent)
	if err != nil {
		return err
	}
	discard(resp)
	return nil
}

// Upload extracts a tar stream into dir (made if missing). A bad stream or
// an entry that would land outside dir is ErrInvalid.
func (c *Client) Upload(ctx context.Context, dir string, tr io.Reader) error {
	resp, err := c.do(ctx, "upload", http.MethodPut, "/v1/tar", url.Values{"dir": {dir}}, tr, http.StatusNoContent)
	if err != nil {
		return err
	}
	discard(resp)
	return nil
}

// Download writes dir as a tar stream to w; ErrNotFound if dir is missing.
func (c *Client) Download(ctx context.Context, dir string, w io.Writer) error {
	resp, err := c.do(ctx, "download", http.MethodGet, "/v1/tar", url.Values{"dir": {dir}}, nil, http.StatusOK)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(w, resp.Body); err != nil {
		return c.netError("download", err)
	}
	if msg := resp.Trailer.Get(errTrailer); msg != "" {
		return wireError{Message: msg}.toError("download", c.What)
	}
	return nil
}

// SetClock sets the guest's wall clock (CLOCK_REALTIME) to t, computed in
// the guest from its own uptime (see guestclock), and returns what it did.
func (c *Client) SetClock(ctx context.Context, t guestclock.Target) (guestclock.Fix, error) {
	var f guestclock.Fix
	b, _ := json.Marshal(t)
	resp, err := c.do(ctx, "clock", http.MethodPost, "/v1/clock", nil, bytes.NewReader(b), http.StatusOK)
	if err != nil {
		return f, err
	}
	defer discard(resp)
	if err := json.NewDecoder(resp.Body).Decode(&f); err != nil {
		return f, c.netError("clock", err)
	}
	return f, nil
}

// Info reads the guest's wall clock, uptime, boot id and the agent's PID.
func (c *Client) Info(ctx context.Context) (Info, error) {
	var in Info
	resp, err := c.do(ctx, "info", http.MethodGet, "/v1/info", nil, nil, http.StatusOK)
	if err != nil {
		return in, err
	}
	defer discard(resp)
	if err := json.NewDecoder(resp.Body).Decode(&in); err != nil {
		return in, c.netError("info", err)
	}
	return in, nil
}

// Health returns nil when the agent answers.
func (c *Client) Health(ctx context.Context) error {
	resp, err := c.do(ctx, "health", http.MethodGet, "/v1/health", nil, nil, http.StatusOK)
	if err != nil {
		return err
	}
	discard(resp)
	return nil
}
