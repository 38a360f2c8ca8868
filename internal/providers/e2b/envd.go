package e2b

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"

	"stasis/errdefs"
	"stasis/internal/providers/e2b/internal/wire"
	"stasis/internal/retryafter"
	"stasis/sandbox"
)

// envdBase is the address of a sandbox's envd: Options.EnvdURL when set,
// else https://<port>-<id>.<domain>.
func (p *Provider) envdBase(st sbState) string {
	if p.o.EnvdURL != "" {
		return p.o.EnvdURL
	}
	domain := st.domain
	if domain == "" {
		domain = p.o.Domain
	}
	return fmt.Sprintf("https://%d-%s.%s", p.o.EnvdPort, st.id, domain)
}

// envdRequest builds a request to a sandbox's envd: the routing headers,
// the access token, and the user (HTTP basic authentication with the user
// name, as envd takes it).
func (p *Provider) envdRequest(ctx context.Context, st sbState, method, path string, query url.Values, body io.Reader) (*http.Request, error) {
	u := p.envdBase(st) + path
	if len(query) > 0 {
		u += "?" + query.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set(wire.SandboxIDHeader, st.id)
	req.Header.Set(wire.SandboxPortHeader, strconv.Itoa(p.o.EnvdPort))
	if st.token != "" {
		req.Header.Set(wire.AccessTokenHeader, st.token)
	}
	req.Header.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(p.o.User+":")))
	req.Header.Set("User-Agent", "stasis-e2b")
	return req, nil
}

// Retry modes of envd requests.
const (
	once       = iota // the body is a one-shot stream: never sent twice
	unapplied         // tried again after answers that show it had no effect (429, 502, 503)
	idempotent        // also after transport errors: repeating it is harmless
)

// envdDo sends a request to envd. The sandbox proxy answers 502 when the
// sandbox is not there to answer: the API then says why (gone, expired,
// paused), or, when the sandbox runs, the request is tried again. 429 and
// 503 are tried again too, and transport errors when the request is
// idempotent; mode once tries nothing again.
func (p *Provider) envdDo(ctx context.Context, op string, st sbState, mode int, build func() (*http.Request, error)) (*http.Response, error) {
	for try := 1; ; try++ {
		req, err := build()
		if err != nil {
			return nil, err
		}
		resp, err := p.hc.Do(req)
		wait := p.backoff(try)
		switch {
		case err != nil && ctx.Err() != nil:
			return nil, fmt.Errorf("%s %s: %w", op, what(st.id), ctx.Err())
		case err != nil:
			if mode != idempotent || try > p.o.Retries {
				return nil, p.unreachable(ctx, op, st, fmt.Sprintf("envd at %s: %v", p.envdBase(st), err))
			}
		case resp.StatusCode == http.StatusBadGateway:
			msg := readError(resp)
			if err := p.stillRunning(ctx, op, st); err != nil {
				return nil, err
			}
			if mode == once || try > p.o.Retries {
				return nil, &APIError{Op: op, What: what(st.id), Status: http.StatusBadGateway, Message: msg, Tries: try, Hint: "the sandbox runs but its envd does not answer; try again, or delete it and fork a snapshot"}
			}
		case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable:
			msg := readError(resp)
			if ra, ok := retryafter.Parse(resp.Header.Get("Retry-After"), p.now()); ok && ra <= p.o.MaxRetryAfter {
				wait = ra
			}
			if mode == once || try > p.o.Retries {
				return nil, &APIError{Op: op, What: what(st.id), Status: resp.StatusCode, Message: msg, Tries: try, Hint: "the sandbox's envd is overloaded or rate-limited; run fewer commands at once and try again"}
			}
		case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
			msg := readError(resp)
			p.update(st.id, func(s *sbState) { s.conn = false }) // fetch a fresh token next time
			return nil, &APIError{Op: op, What: what(st.id), Status: resp.StatusCode, Message: msg, Tries: try,
				Hint: fmt.Sprintf("envd refused the access token or the user %q; try again (the token is fetched anew), and check Options.User", p.o.User)}
		default:
			return resp, nil
		}
		if err := retryafter.Wait(ctx, wait); err != nil {
			return nil, fmt.Errorf("%s %s: %w", op, what(st.id), err)
		}
	}
}

// stillRunning asks the API about a sandbox whose envd did not answer: nil
// when it runs, else the error that says why not.
func (p *Provider) stillRunning(ctx context.Context, op string, st sbState) error {
	fresh, err := p.sandbox(ctx, op, st.id, true)
	if err != nil {
		return err
	}
	if fresh.state == wire.StatePaused {
		return sandbox.Errorf(errdefs.ErrConflict, op, what(st.id), "it is paused; resume it first (Resume)")
	}
	return nil
}

// unreachable is the error for an envd that could not be reached: the
// API's account of the sandbox when it is not running, else the transport
// failure.
func (p *Provider) unreachable(ctx context.Context, op string, st sbState, msg string) error {
	if err := p.stillRunning(ctx, op, st); err != nil {
		return err
	}
	return &APIError{Op: op, What: what(st.id), Message: msg, Hint: "the sandbox runs but its envd cannot be reached; check the network and the sandbox address (" + EnvSandboxURL + ", " + EnvDomain + ")"}
}

func readError(resp *http.Response) string {
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var ce wire.ConnectError
	if json.Unmarshal(b, &ce) == nil && ce.Message != "" && ce.Code != "" {
		return ce.Code + ": " + ce.Message
	}
	return errorMessage(b)
}

// unary calls a unary method of envd's process service.
func (p *Provider) unary(ctx context.Context, op string, st sbState, method string, in any, mode int) error {
	body, err := json.Marshal(in)
	if err != nil {
		return err
	}
	resp, err := p.envdDo(ctx, op, st, mode, p.envdPost(ctx, st, "/process.Process/"+method, nil, func() io.Reader { return bytes.NewReader(body) },
		"Content-Type", wire.UnaryContentType, wire.ProtocolHeader, "1"))
	return drainOK(resp, err, func(resp *http.Response) error {
		var ce wire.ConnectError
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if json.Unmarshal(b, &ce) != nil || ce.Code == "" {
			ce = wire.ConnectError{Code: "unknown", Message: errorMessage(b)}
		}
		return &connectError{method: method, code: ce.Code, msg: ce.Message, status: resp.StatusCode}
	})
}

// envdPost makes the requests envdDo sends: a POST to envd's path, with
// the headers given as name, value pairs and a body made anew by body for
// each try.
func (p *Provider) envdPost(ctx context.Context, st sbState, path string, q url.Values, body func() io.Reader, header ...string) func() (*http.Request, error) {
	return func() (*http.Request, error) {
		req, err := p.envdRequest(ctx, st, http.MethodPost, path, q, body())
		if err == nil {
			for i := 0; i+1 < len(header); i += 2 {
				req.Header.Set(header[i], header[i+1])
			}
		}
		return req, err
	}
}

// drainOK ends the call of envdDo that gave resp and err, for a request
// whose answer says nothing: a 200 is read to its end (its connection is
// reused), another status is the error refused makes of it.
func drainOK(resp *http.Response, err error, refused func(*http.Response) error) error {
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	return refused(resp)
}

// connectError is an error answer of envd's process service.
type connectError struct {
	method, code, msg string
	status            int
}

func (e *connectError) Error() string {
	return fmt.Sprintf("envd %s: %s: %s", e.method, e.code, e.msg)
}

func connectCode(err error) string {
	var ce *connectError
	if errors.As(err, &ce) {
		return ce.code
	}
	return ""
}

// procStream is the output stream of Start.
type procStream struct {
	body io.ReadCloser
}

// startProcess calls Start and returns its stream once envd has accepted
// it. timeout > 0 is sent as the call's deadline, which makes envd kill
// the process when it passes.
func (p *Provider) startProcess(ctx context.Context, op string, st sbState, in wire.StartRequest, timeout int64) (*procStream, error) {
	var buf bytes.Buffer
	if err := wire.WriteEnvelope(&buf, 0, in); err != nil {
		return nil, err
	}
	body := buf.Bytes()
	header := []string{"Content-Type", wire.StreamContentType, wire.ProtocolHeader, "1", wire.KeepaliveHeader, "50"}
	if timeout > 0 {
		header = append(header, wire.TimeoutHeader, strconv.FormatInt(timeout, 10))
	}
	resp, err := p.envdDo(ctx, op, st, unapplied, p.envdPost(ctx, st, "/process.Process/Start", nil, func() io.Reader { return bytes.NewReader(body) }, header...))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		msg := readError(resp)
		return nil, fmt.Errorf("%s %s: envd refused to start %q: %d %s", op, what(st.id), in.Process.Cmd, resp.StatusCode, msg)
	}
	return &procStream{body: resp.Body}, nil
}

// next reads the stream's next event, or its end.
func (s *procStream) next() (*wire.ProcessEvent, *wire.EndStream, error) {
	flags, msg, err := wire.ReadEnvelope(s.body)
	if err == io.EOF {
		return nil, nil, errors.New("the output stream ended without its closing message")
	}
	if err != nil {
		return nil, nil, err
	}
	if flags&wire.FlagEndStream != 0 {
		var end wire.EndStream
		if err := json.Unmarshal(msg, &end); err != nil {
			return nil, nil, fmt.Errorf("reading the end of the output stream: %w", err)
		}
		return nil, &end, nil
	}
	var r wire.StartResponse
	if err := json.Unmarshal(msg, &r); err != nil {
		return nil, nil, fmt.Errorf("reading the output stream: %w", err)
	}
	return &r.Event, nil, nil
}

func (s *procStream) Close() error { return s.body.Close() }

// getFile reads a file through envd's /files.
func (p *Provider) getFile(ctx context.Context, op string, st sbState, path string) ([]byte, error) {
	q := url.Values{"path": {path}, "username": {p.o.User}}
	resp, err := p.envdDo(ctx, op, st, idempotent, func() (*http.Request, error) {
		return p.envdRequest(ctx, st, http.MethodGet, "/files", q, nil)
	})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			return nil, fmt.Errorf("%s %s: reading %s: %w", op, what(st.id), path, err)
		}
		return b, nil
	}
	return nil, fileError(op, st.id, path, resp)
}

// postFile writes a file through envd's /files (raw body); envd makes the
// parent directories. body makes the body for each try (mode once: one).
func (p *Provider) postFile(ctx context.Context, op string, st sbState, path string, body func() io.Reader, mode int) error {
	q := url.Values{"path": {path}, "username": {p.o.User}}
	resp, err := p.envdDo(ctx, op, st, mode, p.envdPost(ctx, st, "/files", q, body, "Content-Type", "application/octet-stream"))
	return drainOK(resp, err, func(resp *http.Response) error { return fileError(op, st.id, path, resp) })
}

func fileError(op, id, path string, resp *http.Response) error {
	msg := readError(resp)
	switch resp.StatusCode {
	case http.StatusNotFound:
		return sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "no file %s (%s)", path, msg)
	case http.StatusBadRequest:
		return sandbox.Errorf(errdefs.ErrInvalid, op, what(id), "%s: %s", path, msg)
	case http.StatusInsufficientStorage:
		return fmt.Errorf("%s %s: %s: the sandbox's disk is full (%s); free space or use a template with a larger disk", op, what(id), path, msg)
	}
	return fmt.Errorf("%s %s: %s: envd answered %d (%s)", op, what(id), path, resp.StatusCode, msg)
}
