package e2b

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/e2b/internal/wire"
	"stasis/internal/retryafter"
	"stasis/sandbox"
)

// APIError is a failure of E2B's API that is not a sandbox.Error: a
// refused API key (of no kind: the server's configuration is wrong), or
// rate limiting, a service failure that outlasted the retries, or a
// service that could not be reached (errdefs.ErrUnavailable).
type APIError struct {
	Op, What string
	// Status is the last HTTP status (0: no answer).
	Status int
	// Message is the service's own message, or the transport error.
	Message string
	// Tries is how many requests were made.
	Tries int
	// Hint says what to do.
	Hint string
}

// Is makes rate limiting, a failure of the service and no answer match
// errdefs.ErrUnavailable.
func (e *APIError) Is(target error) bool {
	return target == errdefs.ErrUnavailable && (e.Status == 0 || e.Status == http.StatusTooManyRequests || e.Status >= 500)
}

func (e *APIError) Error() string {
	s := e.Op
	if e.What != "" {
		s += " " + e.What
	}
	switch {
	case e.Status == 0:
		s += ": no answer from E2B"
	default:
		s += fmt.Sprintf(": E2B answered %d %s", e.Status, http.StatusText(e.Status))
	}
	if e.Message != "" {
		s += " (" + e.Message + ")"
	}
	if e.Tries > 1 {
		s += fmt.Sprintf(" after %d tries", e.Tries)
	}
	if e.Hint != "" {
		s += "; " + e.Hint
	}
	return s
}

// restCall is one call of the REST API.
type restCall struct {
	op, what string // for errors: "create", "sandbox …"
	method   string
	path     string // escaped, from the API's root
	query    url.Values
	body     any
	out      any
	// idempotent calls are retried after transport errors and 500, 502 and
	// 504 too; every call is retried after 429 and 503, which E2B answers
	// before doing anything.
	idempotent bool
	// accept lists the statuses that mean success (default: any 2xx).
	accept []int
}

// rest makes a call, retrying as restCall says, and maps failures: 404 to
// ErrNotFound, 409 to ErrWrongState, 400 and 422 to ErrInvalid, the rest to
// *APIError.
func (p *Provider) rest(ctx context.Context, c restCall) (int, http.Header, error) {
	var body []byte
	if c.body != nil {
		var err error
		if body, err = json.Marshal(c.body); err != nil {
			return 0, nil, err
		}
	}
	u := p.base + c.path
	if len(c.query) > 0 {
		u += "?" + c.query.Encode()
	}
	for try := 1; ; try++ {
		status, hdr, msg, err := p.restOnce(ctx, c, u, body)
		wait := p.backoff(try)
		switch {
		case err != nil && ctx.Err() != nil:
			return 0, nil, fmt.Errorf("%s: %w", strings.TrimSpace(c.op+" "+c.what), ctx.Err())
		case err != nil:
			if !c.idempotent || try > p.o.Retries {
				return 0, nil, &APIError{Op: c.op, What: c.what, Message: err.Error(), Tries: try,
					Hint: fmt.Sprintf("check the network and the API address %s (%s, %s)", p.base, EnvAPIURL, EnvDomain)}
			}
		case accepted(status, c.accept):
			return status, hdr, nil
		case status == http.StatusTooManyRequests || status == http.StatusServiceUnavailable:
			if ra, ok := retryafter.Parse(hdr.Get("Retry-After"), p.now()); ok {
				if ra > p.o.MaxRetryAfter {
					return status, hdr, &APIError{Op: c.op, What: c.what, Status: status, Message: msg, Tries: try,
						Hint: fmt.Sprintf("E2B asks to wait %s (Retry-After), longer than this provider waits (%s); try again then, with fewer sandboxes at once", ra.Round(time.Second), p.o.MaxRetryAfter)}
				}
				wait = ra
			}
			if try > p.o.Retries {
				hint := "E2B is rate-limiting this team: run fewer sandboxes or calls at once, or raise the team's limits, and try again"
				if status == http.StatusServiceUnavailable {
					hint = "E2B is unavailable or out of capacity; try again later"
				}
				return status, hdr, &APIError{Op: c.op, What: c.what, Status: status, Message: msg, Tries: try, Hint: hint}
			}
		case status >= 500:
			if !c.idempotent || try > p.o.Retries {
				hint := "a failure on E2B's side; try again later"
				if !c.idempotent {
					hint = "a failure on E2B's side (not retried: the request may have taken effect); check with `stasis sandbox ls` and try again"
				}
				return status, hdr, &APIError{Op: c.op, What: c.what, Status: status, Message: msg, Tries: try, Hint: hint}
			}
		case status == http.StatusUnauthorized || status == http.StatusForbidden:
			return status, hdr, &APIError{Op: c.op, What: c.what, Status: status, Message: msg, Tries: try,
				Hint: fmt.Sprintf("E2B refused the API key: set %s (Options.APIKey) to a valid key of your team", EnvAPIKey)}
		case status == http.StatusNotFound:
			return status, hdr, sandbox.Errorf(errdefs.ErrNotFound, c.op, c.what, "E2B has no such thing for this API key (deleted, expired, or never made): %s", msg)
		case status == http.StatusConflict:
			return status, hdr, sandbox.Errorf(errdefs.ErrConflict, c.op, c.what, "E2B refuses it in the current state (%s); check the state with Get and try again", msg)
		case status == http.StatusBadRequest || status == http.StatusUnprocessableEntity:
			return status, hdr, sandbox.Errorf(errdefs.ErrInvalid, c.op, c.what, "E2B rejected the request: %s", msg)
		default:
			return status, hdr, &APIError{Op: c.op, What: c.what, Status: status, Message: msg, Tries: try}
		}
		if err := retryafter.Wait(ctx, wait); err != nil {
			return 0, nil, fmt.Errorf("%s: %w", strings.TrimSpace(c.op+" "+c.what), err)
		}
	}
}

// restOnce makes one request: the status, the headers, the error message of
// a failed answer, or a transport error. A success's body is decoded into
// c.out.
func (p *Provider) restOnce(ctx context.Context, c restCall, u string, body []byte) (int, http.Header, string, error) {
	ctx, cancel := context.WithTimeout(ctx, p.o.RequestTimeout)
	defer cancel()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, c.method, u, rd)
	if err != nil {
		return 0, nil, "", err
	}
	req.Header.Set(wire.APIKeyHeader, p.o.APIKey)
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "stasis-e2b")
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := p.hc.Do(req)
	if err != nil {
		return 0, nil, "", err
	}
	defer resp.Body.Close()
	if accepted(resp.StatusCode, c.accept) {
		if c.out != nil && resp.StatusCode != http.StatusNoContent {
			if err := json.NewDecoder(resp.Body).Decode(c.out); err != nil {
				return 0, nil, "", fmt.Errorf("reading the answer to %s %s: %w", c.method, c.path, err)
			}
		}
		return resp.StatusCode, resp.Header, "", nil
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, resp.Header, errorMessage(b), nil
}

func accepted(status int, accept []int) bool {
	if len(accept) == 0 {
		return status >= 200 && status < 300
	}
	for _, a := range accept {
		if a == status {
			return true
		}
	}
	return false
}

// errorMessage is the message of an error body ({code, message}), or the
// body itself, shortened.
func errorMessage(b []byte) string {
	var e wire.Error
	if json.Unmarshal(b, &e) == nil && e.Message != "" {
		if e.ErrorCode != "" {
			return e.Message + " [" + e.ErrorCode + "]"
		}
		return e.Message
	}
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}

// backoff is the wait before try+1: Backoff doubled per try, at most 10s,
// with up to a quarter of jitter.
func (p *Provider) backoff(try int) time.Duration {
	d := p.o.Backoff
	for i := 1; i < try && d < 10*time.Second; i++ {
		d *= 2
	}
	d = min(d, 10*time.Second)
	return d + time.Duration(rand.Int64N(int64(d)/4+1))
}
