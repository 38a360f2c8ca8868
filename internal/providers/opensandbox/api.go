package opensandbox

// The wire types below are the subset of the OpenSandbox API that this
// client uses, written by hand from the specifications in the OpenSandbox
// repository at commit 4db3a993c6a7c5c6e0c7cbb202e307fe9582762f (2026-06-12):
// specs/sandbox-lifecycle.yml (Lifecycle API 0.1.0, last changed in
// 0ecfb731f03e) and specs/execd-api.yaml (Execd API 1.0.0, last changed in
// 7ad48db77ce2). Where execd's implementation (components/execd) says more
// than its specification — the framing of its event stream, how it splits
// output into lines, which multipart parts an upload carries — the comments
// say so.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"stasis/internal/retryafter"
)

// Headers.
const (
	apiKeyHeader     = "OPEN-SANDBOX-API-KEY"
	execdTokenHeader = "X-EXECD-ACCESS-TOKEN"
)

// Sandbox states (SandboxState).
const (
	statePending    = "Pending"
	stateRunning    = "Running"
	statePausing    = "Pausing"
	statePaused     = "Paused"
	stateResuming   = "Resuming"
	stateStopping   = "Stopping"
	stateTerminated = "Terminated"
	stateFailed     = "Failed"
)

// Snapshot states (SnapshotState).
const (
	snapCreating = "Creating"
	snapReady    = "Ready"
	snapFailed   = "Failed"
	snapDeleting = "Deleting"
)

// apiTime is a date-time as the server writes it: RFC 3339, or (from a
// server that loses the zone) an ISO 8601 time without one, read as UTC.
type apiTime struct{ time.Time }

func (t *apiTime) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05.999999999", "2006-01-02 15:04:05.999999999Z07:00"} {
		if v, err := time.Parse(layout, s); err == nil {
			t.Time = v
			return nil
		}
	}
	return fmt.Errorf("unreadable time %q", s)
}

func (t apiTime) MarshalJSON() ([]byte, error) { return json.Marshal(t.UTC().Format(time.RFC3339Nano)) }

type imageSpec struct {
	URI string `json:"uri"`
}

type sandboxStatus struct {
	State   string `json:"state"`
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
}

// apiSandbox is Sandbox (and CreateSandboxResponse, which lacks the
// startup source).
type apiSandbox struct {
	ID         string            `json:"id"`
	Image      *imageSpec        `json:"image,omitempty"`
	SnapshotID string            `json:"snapshotId,omitempty"`
	Status     sandboxStatus     `json:"status"`
	Metadata   map[string]string `json:"metadata,omitempty"`
	Entrypoint []string          `json:"entrypoint,omitempty"`
	ExpiresAt  *apiTime          `json:"expiresAt,omitempty"`
	CreatedAt  apiTime           `json:"createdAt"`
}

// createSandboxRequest is CreateSandboxRequest: exactly one of Image and
// SnapshotID; Entrypoint is required with an image; Timeout is seconds
// (at least 60), omitted for no expiry (stasis always sends one).
type createSandboxRequest struct {
	Image          *imageSpec        `json:"image,omitempty"`
	SnapshotID     string            `json:"snapshotId,omitempty"`
	Timeout        int               `json:"timeout"`
	ResourceLimits map[string]string `json:"resourceLimits,omitempty"`
	Env            map[string]string `json:"env,omitempty"`
	Metadata       map[string]string `json:"metadata,omitempty"`
	Entrypoint     []string          `json:"entrypoint,omitempty"`
}

type paginationInfo struct {
	Page        int  `json:"page"`
	PageSize    int  `json:"pageSize"`
	TotalItems  int  `json:"totalItems"`
	TotalPages  int  `json:"totalPages"`
	HasNextPage bool `json:"hasNextPage"`
}

type listSandboxesResponse struct {
	Items      []apiSandbox   `json:"items"`
	Pagination paginationInfo `json:"pagination"`
}

type renewExpirationRequest struct {
	ExpiresAt apiTime `json:"expiresAt"`
}

type createSnapshotRequest struct {
	Name string `json:"name,omitempty"`
}

type apiSnapshot struct {
	ID        string        `json:"id"`
	SandboxID string        `json:"sandboxId"`
	Name      string        `json:"name,omitempty"`
	Status    sandboxStatus `json:"status"`
	CreatedAt apiTime       `json:"createdAt"`
}

// apiEndpoint is Endpoint: a URL without a scheme
// ("{endpoint-host}/sandboxes/{sandboxId}/port/{port}") and the headers a
// request to it must carry.
type apiEndpoint struct {
	Endpoint string            `json:"endpoint"`
	Headers  map[string]string `json:"headers,omitempty"`
}

type errorResponse struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// runCommandRequest is execd's RunCommandRequest; Timeout is milliseconds
// (the server kills the command's process group when it passes).
type runCommandRequest struct {
	Command    string            `json:"command"`
	Cwd        string            `json:"cwd,omitempty"`
	Background bool              `json:"background,omitempty"`
	Timeout    int64             `json:"timeout,omitempty"`
	Envs       map[string]string `json:"envs,omitempty"`
}

// streamEvent is execd's ServerStreamEvent. execd writes each as one line
// of JSON followed by a blank line (no "data:" field); stdout and stderr
// events carry one line of output each, without its terminator, and an
// empty line as "\n". The exit code of a failed command is the error's
// evalue; older servers put ename and evalue at the top level.
type streamEvent struct {
	Type  string `json:"type"`
	Text  string `json:"text"`
	Error *struct {
		EName     string   `json:"ename"`
		EValue    string   `json:"evalue"`
		Traceback []string `json:"traceback"`
	} `json:"error"`
	EName  string `json:"ename"`
	EValue string `json:"evalue"`
}

// fileMetadata is execd's FileMetadata; Mode is the octal digits read as a
// decimal number (0o640 is 640).
type fileMetadata struct {
	Path string `json:"path"`
	Mode int    `json:"mode,omitempty"`
}

// httpError is a non-2xx answer.
type httpError struct {
	Status   int
	Code     string
	Message  string
	Attempts int
}

func (e *httpError) Error() string { return e.detail() }

func (e *httpError) detail() string {
	s := strconv.Itoa(e.Status) + " " + http.StatusText(e.Status)
	if e.Code != "" {
		s += ", " + e.Code
	}
	if e.Message != "" {
		s += ": " + e.Message
	}
	return s
}

// transportError is a request that got no answer.
type transportError struct {
	Err      error
	Attempts int
}

func (e *transportError) Error() string { return e.Err.Error() }
func (e *transportError) Unwrap() error { return e.Err }

// call is one HTTP request.
type call struct {
	method string
	url    string
	query  url.Values
	// body is sent again on a retry; stream is sent once (a call with a
	// stream is never retried).
	body        []byte
	stream      io.Reader
	contentType string
	headers     map[string]string
	// apiKey: send the lifecycle API key.
	apiKey bool
	// idempotent calls are retried after 5xx and transport errors; every
	// call without a stream is retried after 429.
	idempotent bool
	// retry500: a 500 is worth retrying (the lifecycle API; execd answers
	// 500 for file errors that another try does not change).
	retry500 bool
	// long: no per-request timeout (streams of command output, files).
	long bool
}

func jsonBody(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only the types above, which always marshal
	}
	return b
}

// send makes the call, with bounded retries and backoff. A 2xx answer is
// returned open; anything else is an *httpError or a *transportError (or
// the context's error).
func (p *Provider) send(ctx context.Context, c call) (*http.Response, error) {
	u := c.url
	if len(c.query) > 0 {
		u += "?" + c.query.Encode()
	}
	for attempt := 1; ; attempt++ {
		rctx, cancel := ctx, context.CancelFunc(func() {})
		if !c.long && p.o.RequestTimeout > 0 {
			rctx, cancel = context.WithTimeout(ctx, p.o.RequestTimeout)
		}
		var body io.Reader
		switch {
		case c.stream != nil:
			body = c.stream
		case c.body != nil:
			body = bytes.NewReader(c.body)
		}
		req, err := http.NewRequestWithContext(rctx, c.method, u, body)
		if err != nil {
			cancel()
			return nil, err
		}
		if c.contentType != "" {
			req.Header.Set("Content-Type", c.contentType)
		}
		if c.apiKey && p.o.APIKey != "" {
			req.Header.Set(apiKeyHeader, p.o.APIKey)
		}
		for k, v := range c.headers {
			req.Header.Set(k, v)
		}
		resp, err := p.hc.Do(req)
		if err != nil {
			cancel()
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if c.idempotent && c.stream == nil && attempt < p.o.MaxAttempts {
				if err := p.sleep(ctx, p.backoff(attempt)); err != nil {
					return nil, err
				}
				continue
			}
			return nil, &transportError{Err: err, Attempts: attempt}
		}
		if resp.StatusCode/100 == 2 {
			resp.Body = &cancelBody{ReadCloser: resp.Body, cancel: cancel}
			return resp, nil
		}
		herr := readError(resp)
		cancel()
		herr.Attempts = attempt
		retry, wait := false, p.backoff(attempt)
		switch {
		case c.stream != nil || attempt >= p.o.MaxAttempts:
		case resp.StatusCode == http.StatusTooManyRequests:
			retry = true
			if ra, ok := retryafter.Parse(resp.Header.Get("Retry-After"), p.o.Now()); ok {
				wait = min(ra, p.o.MaxRetryWait)
			}
		case resp.StatusCode == http.StatusInternalServerError:
			retry = c.idempotent && c.retry500
		case resp.StatusCode == http.StatusBadGateway, resp.StatusCode == http.StatusServiceUnavailable, resp.StatusCode == http.StatusGatewayTimeout:
			retry = c.idempotent
		}
		if !retry {
			return nil, herr
		}
		if err := p.sleep(ctx, wait); err != nil {
			return nil, err
		}
	}
}

// do makes a call and decodes a JSON answer into out (when not nil).
func (p *Provider) do(ctx context.Context, c call, out any) error {
	resp, err := p.send(ctx, c)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return fmt.Errorf("unreadable answer to %s %s: %w", c.method, c.url, err)
	}
	return nil
}

// cancelBody ends a request's context when its body is closed.
type cancelBody struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b *cancelBody) Close() error {
	err := b.ReadCloser.Close()
	b.cancel()
	return err
}

func readError(resp *http.Response) *httpError {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	e := &httpError{Status: resp.StatusCode}
	var er errorResponse
	if json.Unmarshal(b, &er) == nil && (er.Code != "" || er.Message != "") {
		e.Code, e.Message = er.Code, er.Message
	} else {
		// FastAPI's own validation errors and proxies' pages.
		var fa struct {
			Detail json.RawMessage `json:"detail"`
		}
		if json.Unmarshal(b, &fa) == nil && len(fa.Detail) > 0 {
			e.Message = string(fa.Detail)
		} else {
			e.Message = strings.TrimSpace(string(b))
		}
		if len(e.Message) > 300 {
			e.Message = e.Message[:300] + "…"
		}
	}
	return e
}

// backoff is the wait before retry number attempt: exponential from
// RetryBase, capped at 5 s, with jitter.
func (p *Provider) backoff(attempt int) time.Duration {
	d := p.o.RetryBase << min(attempt-1, 10)
	d = min(d, 5*time.Second)
	return d/2 + rand.N(d/2+1)
}

// sleep waits d; it returns ctx's error when ctx ends first, or has ended
// already when d is 0.
func (p *Provider) sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	return retryafter.Wait(ctx, d)
}

func isStatus(err error, status int) bool {
	var he *httpError
	return errors.As(err, &he) && he.Status == status
}
