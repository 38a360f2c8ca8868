package mini

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"stasis/internal/retryafter"
)

// Retry policy for model calls: connection errors, 429 and 5xx.
const (
	maxAttempts   = 6 // attempts per model call, the first included
	backoffFirst  = 500 * time.Millisecond
	backoffMax    = 8 * time.Second  // the longest backoff between attempts
	retryAfterMax = 60 * time.Second // the longest Retry-After honoured
	totalWaitMax  = 2 * time.Minute  // the most waited in all for one model call
	maxResponse   = 64 << 20         // the largest response body read
	maxErrorBody  = 2 << 10          // bytes of an error body kept in the error
)

// HTTPError is a model server answer that ends the run: a 4xx other than
// 429, or a 429 or 5xx that lasted through every retry.
type HTTPError struct {
	Status int    // the HTTP status code
	Body   string // the start of the response body
}

func (e *HTTPError) Error() string {
	return fmt.Sprintf("the model server answered %d %s: %s", e.Status, http.StatusText(e.Status), strings.TrimSpace(e.Body))
}

// complete sends the conversation and returns the assistant message as the
// server returned it (choices[0].message, raw) and its parsed form.
func (a *agent) complete(ctx context.Context, msgs []json.RawMessage) (json.RawMessage, message, error) {
	body := requestBody(a.cfg.Model, msgs)
	b, err := a.post(ctx, body)
	if err != nil {
		return nil, message{}, err
	}
	var resp struct {
		Choices []struct {
			Message      json.RawMessage `json:"message"`
			FinishReason string          `json:"finish_reason"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(b, &resp); err != nil {
		return nil, message{}, fmt.Errorf("mini: the model server's answer is not a chat completion: %v: %.200q", err, b)
	}
	if len(resp.Choices) == 0 || len(bytes.TrimSpace(resp.Choices[0].Message)) == 0 {
		return nil, message{}, fmt.Errorf("mini: the model server's answer has no choices[0].message: %.200q", b)
	}
	raw := json.RawMessage(bytes.Clone(resp.Choices[0].Message))
	m, err := parseMessage(raw)
	if err != nil {
		return nil, message{}, fmt.Errorf("mini: the model server's choices[0].message: %v", err)
	}
	if m.Role != "assistant" {
		return nil, message{}, fmt.Errorf("mini: the model server's choices[0].message has role %q, not assistant", m.Role)
	}
	a.log.Debug("model answered", "finish_reason", resp.Choices[0].FinishReason, "tool_calls", len(m.ToolCalls))
	return raw, m, nil
}

// requestBody is a non-streamed chat-completions request. The messages are
// written verbatim (json.Marshal would compact them and escape HTML), so the
// same history always gives the same bytes.
func requestBody(model string, msgs []json.RawMessage) []byte {
	var b bytes.Buffer
	name, _ := json.Marshal(model)
	b.WriteString(`{"model":`)
	b.Write(name)
	b.WriteString(`,"messages":[`)
	for i, m := range msgs {
		if i > 0 {
			b.WriteByte(',')
		}
		b.Write(m)
	}
	b.WriteString(`],"tools":`)
	b.Write(toolsJSON)
	b.WriteString(`,"stream":false}`)
	return b.Bytes()
}

// post sends one chat-completions request, retrying connection errors, 429
// (after its Retry-After) and 5xx with exponential backoff and jitter, a
// bounded number of times and for a bounded total wait.
func (a *agent) post(ctx context.Context, body []byte) ([]byte, error) {
	url := a.cfg.Endpoint + "/chat/completions"
	backoff := backoffFirst
	var waited time.Duration
	for attempt := 1; ; attempt++ {
		b, status, retryAfter, err := a.attempt(ctx, url, body)
		if ctx.Err() != nil {
			return nil, fmt.Errorf("mini: model call: %w", ctx.Err())
		}
		var last error
		switch {
		case errors.Is(err, errTooLarge):
			return nil, fmt.Errorf("mini: POST %s: %w", url, err)
		case err != nil:
			last = fmt.Errorf("POST %s: %w", url, err)
		case status == http.StatusTooManyRequests || status >= 500:
			last = &HTTPError{Status: status, Body: truncate(b, maxErrorBody)}
		case status/100 == 2:
			return b, nil
		default:
			return nil, fmt.Errorf("mini: POST %s: %w", url, &HTTPError{Status: status, Body: truncate(b, maxErrorBody)})
		}
		wait := backoff/2 + rand.N(backoff/2+1) // jitter: half to the whole backoff
		if retryAfter >= 0 {
			wait = min(retryAfter, retryAfterMax)
		}
		if attempt >= maxAttempts || waited+wait > totalWaitMax {
			return nil, fmt.Errorf("mini: model call failed %d times in %s, giving up: %w", attempt, waited.Round(time.Millisecond), last)
		}
		a.log.Warn("model call failed, retrying", "attempt", attempt, "in", wait, "err", last)
		fmt.Fprintf(a.out, "model call failed (%v); retry %d in %s\n", firstLine(last.Error(), 160), attempt, wait.Round(time.Millisecond))
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("mini: model call: %w", ctx.Err())
		}
		waited += wait
		backoff = min(2*backoff, backoffMax)
	}
}

// attempt makes one HTTP request. retryAfter is -1 unless the answer had a
// usable Retry-After header.
func (a *agent) attempt(ctx context.Context, url string, body []byte) ([]byte, int, time.Duration, error) {
	a.calls++
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return nil, 0, -1, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	resp, err := a.cfg.HTTPClient.Do(req)
	if err != nil {
		return nil, 0, -1, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxResponse+1))
	if err != nil {
		return nil, 0, -1, fmt.Errorf("reading the answer: %w", err)
	}
	if len(b) > maxResponse {
		return nil, 0, -1, errTooLarge
	}
	return b, resp.StatusCode, retryAfter(resp.Header.Get("Retry-After")), nil
}

// retryAfter reads the header's wait; -1 when absent or unreadable.
func retryAfter(h string) time.Duration {
	if d, ok := retryafter.Parse(h, time.Now()); ok {
		return d
	}
	return -1
}

func truncate(b []byte, n int) string {
	if len(b) <= n {
		return string(b)
	}
	return string(b[:n]) + "…"
}

// errTooLarge is an answer over maxResponse bytes: not retried.
var errTooLarge = fmt.Errorf("the answer is over %d bytes", maxResponse)
