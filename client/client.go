// Package client is the Go client of the stasis server's HTTP API
// (internal/control/openapi/server.json): episodes (start, list, get, verify, retire, their
// ledgers), tasks, and checkpoints (create, list, get, restore, branch,
// delete). Its request and answer types are the server's own, so the two
// cannot drift apart. An API error comes back as an *Error, whose kind is
// package errdefs's: errors.Is(err, errdefs.ErrNotFound) and friends work.
package client

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"stasis/errdefs"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/server"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
)

// The API's types, as the server defines them.
type (
	StartRequest       = server.StartRequest
	EpisodeView        = server.EpisodeView
	VerifyResponse     = server.VerifyResponse
	LedgerResponse     = server.LedgerResponse
	TaskSummary        = server.TaskSummary
	CheckpointRequest  = server.CheckpointRequest
	CheckpointResponse = server.CheckpointResponse
	RestoreRequest     = server.RestoreRequest
	RestoreResponse    = server.RestoreResponse
	BranchRequest      = server.BranchRequest
	Result             = coordinator.Result
	Checkpoint         = store.Checkpoint
	Record             = store.Record
	SnapshotRef        = store.SnapshotRef
	LedgerReport       = ledger.Report
)

// MaxAnswer bounds an answer's body (a ledger page with bodies is the
// largest).
const MaxAnswer = 256 << 20

// Client calls one server. Its zero value is not usable: use New.
type Client struct {
	base  string
	http  *http.Client
	token string
}

// Option configures a Client.
type Option func(*Client)

// WithHTTPClient sends the requests through hc (TLS, client certificates,
// timeouts): the default is a plain http.Client.
func WithHTTPClient(hc *http.Client) Option { return func(c *Client) { c.http = hc } }

// WithToken sends "Authorization: Bearer token" with every request (a
// server that listens beyond loopback wants one).
func WithToken(token string) Option { return func(c *Client) { c.token = token } }

// New returns a client of the server at base ("http://127.0.0.1:8080",
// or "https://…").
func New(base string, opts ...Option) (*Client, error) {
	u, err := url.Parse(base)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, errdefs.Errorf(errdefs.ErrInvalid, "server address %q: give http://HOST:PORT or https://HOST:PORT", base)
	}
	c := &Client{base: strings.TrimRight(base, "/"), http: &http.Client{}}
	for _, o := range opts {
		o(c)
	}
	return c, nil
}

// Error is an answer of the API that is not a success.
type Error struct {
	Method, Path string
	Status       int
	// Type is the API's error type (invalid_request, not_found,
	// conflict, ...); Message its message.
	Type, Message string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s %s: %d %s: %s", e.Method, e.Path, e.Status, e.Type, e.Message)
}

// Is makes the error match its kind in package errdefs's vocabulary.
func (e *Error) Is(target error) bool {
	k := errdefs.FromHTTPStatus(e.Status)
	return k != nil && target == k
}

// do sends one request; in, when not nil, is the JSON body, and out, when
// not nil, receives the JSON answer.
func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return err
	}
	if method != http.MethodGet {
		req.Header.Set("Content-Type", "application/json")
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("%s %s: %w", method, path, err) // the caller's deadline, not the server's fault
		}
		return errdefs.Errorf(errdefs.ErrUnavailable, "%s %s: the server did not answer: %w", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, MaxAnswer+1))
	if err != nil {
		return fmt.Errorf("%s %s: reading the answer: %w", method, path, err)
	}
	if len(b) > MaxAnswer {
		return fmt.Errorf("%s %s: the answer is over %d bytes", method, path, MaxAnswer)
	}
	if resp.StatusCode/100 != 2 {
		e := &Error{Method: method, Path: path, Status: resp.StatusCode, Type: "unknown", Message: string(bytes.TrimSpace(b))}
		var doc struct {
			Error struct{ Type, Message string } `json:"error"`
		}
		if json.Unmarshal(b, &doc) == nil && doc.Error.Message != "" {
			e.Type, e.Message = doc.Error.Type, doc.Error.Message
		}
		return e
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return fmt.Errorf("%s %s: the answer is not what the API documents: %w", method, path, err)
		}
	}
	return nil
}

func episodePath(id string) string { return "/v1/episodes/" + url.PathEscape(id) }

func checkpointPath(id string) string { return "/v1/checkpoints/" + url.PathEscape(id) }

// StartEpisode starts an episode (POST /v1/episodes).
func (c *Client) StartEpisode(ctx context.Context, req StartRequest) (EpisodeView, error) {
	var v EpisodeView
	return v, c.do(ctx, http.MethodPost, "/v1/episodes", req, &v)
}

// ListOptions filter Episodes; empty fields do not filter.
type ListOptions struct {
	State   store.EpisodeState
	Task    string
	Harness string
}

// Episodes lists the episodes (GET /v1/episodes), in the server's order.
func (c *Client) Episodes(ctx context.Context, o ListOptions) ([]EpisodeView, error) {
	q := url.Values{}
	if o.State != "" {
		q.Set("state", string(o.State))
	}
	if o.Task != "" {
		q.Set("task", o.Task)
	}
	if o.Harness != "" {
		q.Set("harness", o.Harness)
	}
	path := "/v1/episodes"
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	var l struct {
		Episodes []EpisodeView `json:"episodes"`
	}
	return l.Episodes, c.do(ctx, http.MethodGet, path, nil, &l)
}

// Episode returns one episode (GET /v1/episodes/{id}).
func (c *Client) Episode(ctx context.Context, id string) (EpisodeView, error) {
	var v EpisodeView
	return v, c.do(ctx, http.MethodGet, episodePath(id), nil, &v)
}

// Verify runs (or returns the recorded) verify of an ended episode
// (POST /v1/episodes/{id}/verify).
func (c *Client) Verify(ctx context.Context, id string) (VerifyResponse, error) {
	var v VerifyResponse
	return v, c.do(ctx, http.MethodPost, episodePath(id)+"/verify", nil, &v)
}

// Retire deletes an episode's sandbox (POST /v1/episodes/{id}/retire).
func (c *Client) Retire(ctx context.Context, id string) (EpisodeView, error) {
	var v EpisodeView
	return v, c.do(ctx, http.MethodPost, episodePath(id)+"/retire", nil, &v)
}

// Ledger returns a page of an episode's ledger: the entries after seq
// after, at most limit (0: the server's page), with their bodies or not
// (GET /v1/episodes/{id}/ledger).
func (c *Client) Ledger(ctx context.Context, id string, after int64, limit int, bodies bool) (LedgerResponse, error) {
	q := url.Values{"after": {strconv.FormatInt(after, 10)}, "bodies": {strconv.FormatBool(bodies)}}
	if limit > 0 {
		q.Set("limit", strconv.Itoa(limit))
	}
	var r LedgerResponse
	return r, c.do(ctx, http.MethodGet, episodePath(id)+"/ledger?"+q.Encode(), nil, &r)
}

// VerifyLedger walks an episode's ledger's hash chain
// (GET /v1/episodes/{id}/ledger/verify).
func (c *Client) VerifyLedger(ctx context.Context, id string) (LedgerReport, error) {
	var r LedgerReport
	return r, c.do(ctx, http.MethodGet, episodePath(id)+"/ledger/verify", nil, &r)
}

// Tasks lists the server's tasks (GET /v1/tasks).
func (c *Client) Tasks(ctx context.Context) ([]TaskSummary, error) {
	var l struct {
		Tasks []TaskSummary `json:"tasks"`
	}
	return l.Tasks, c.do(ctx, http.MethodGet, "/v1/tasks", nil, &l)
}

// Checkpoint checkpoints every live episode (POST /v1/checkpoints).
func (c *Client) Checkpoint(ctx context.Context, req CheckpointRequest) (CheckpointResponse, error) {
	var r CheckpointResponse
	return r, c.do(ctx, http.MethodPost, "/v1/checkpoints", req, &r)
}

// Checkpoints lists checkpoints, newest first, of one state or all ("")
// and at most limit (0: all) (GET /v1/checkpoints).
func (c *Client) Checkpoints(ctx context.Context, state store.State, limit int) ([]Checkpoint, error) {
	q := url.Values{}
	if state != "" {
		q.Set("state", string(state))
	}
	if limit > 0 {
		q.Set("limit", strconv.Itoa(limit))
	}
	path := "/v1/checkpoints"
	if len(q) > 0 {
		path += "?" + q.Encode()
	}
	var l struct {
		Checkpoints []Checkpoint `json:"checkpoints"`
	}
	return l.Checkpoints, c.do(ctx, http.MethodGet, path, nil, &l)
}

// GetCheckpoint returns a checkpoint and its records
// (GET /v1/checkpoints/{id}).
func (c *Client) GetCheckpoint(ctx context.Context, id string) (Checkpoint, []Record, error) {
	var r struct {
		Checkpoint Checkpoint `json:"checkpoint"`
		Records    []Record   `json:"records"`
	}
	err := c.do(ctx, http.MethodGet, checkpointPath(id), nil, &r)
	return r.Checkpoint, r.Records, err
}

// Restore restores a committed checkpoint (POST /v1/checkpoints/{id}/restore);
// on a node of a cluster, over every live node.
func (c *Client) Restore(ctx context.Context, id string) (RestoreResponse, error) {
	var r RestoreResponse
	return r, c.do(ctx, http.MethodPost, checkpointPath(id)+"/restore", nil, &r)
}

// RestoreWith is Restore with a body: req.Episodes, when given, are the
// only episodes of the checkpoint brought back (a scoped restore; a
// retired episode named comes back).
func (c *Client) RestoreWith(ctx context.Context, id string, req RestoreRequest) (RestoreResponse, error) {
	var r RestoreResponse
	return r, c.do(ctx, http.MethodPost, checkpointPath(id)+"/restore", req, &r)
}

// Branch starts copies of one of a checkpoint's episodes
// (POST /v1/checkpoints/{id}/branch).
func (c *Client) Branch(ctx context.Context, id string, req BranchRequest) (Result, error) {
	var r Result
	return r, c.do(ctx, http.MethodPost, checkpointPath(id)+"/branch", req, &r)
}

// DeleteCheckpoint deletes a checkpoint and returns the snapshots nothing
// references any more, which the server deleted (DELETE /v1/checkpoints/{id}).
func (c *Client) DeleteCheckpoint(ctx context.Context, id string) ([]SnapshotRef, error) {
	var r struct {
		Freed []SnapshotRef `json:"freed"`
	}
	return r.Freed, c.do(ctx, http.MethodDelete, checkpointPath(id), nil, &r)
}
