package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net/http"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/control/checkpoint"
	"stasis/internal/control/cluster"
	"stasis/internal/control/coordinator"
	"stasis/internal/control/episode"
	"stasis/internal/control/image"
	"stasis/internal/control/openapi"
	"stasis/internal/control/task"
	"stasis/internal/insandbox/harness"
	"stasis/internal/insandbox/supervisor"
	"stasis/internal/storage/ledger"
	"stasis/internal/storage/store"
	"stasis/sandbox"
)

// MaxBody is the largest request body the API reads (413 beyond).
const MaxBody = 1 << 20

// Handler serves the API, /metrics (this server's and the gateway's),
// /healthz and /openapi.json, behind the guard of Options.Access (by
// default LoopbackAccess): the Host header, cross-origin browser requests,
// credentials; and a body only as JSON. The gateway is not here: relays
// reach it on its own socket (and --gateway-listen), never on the API.
func (s *Server) Handler() http.Handler {
	m := http.NewServeMux()
	for pattern, h := range s.routes() {
		if method, _, _ := strings.Cut(pattern, " "); method != http.MethodGet {
			h = jsonOnly(h)
		}
		m.Handle(pattern, h)
	}
	a := s.o.Access
	if a == nil {
		a = LoopbackAccess()
	}
	return s.instrument(a.Guard(jsonMisses(m)))
}

// jsonMisses answers a path no route serves (404), or a method its route
// does not take (405, with Allow), as the API's JSON error rather than
// the mux's plain text.
func jsonMisses(m *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, q *http.Request) {
		h, pattern := m.Handler(q)
		if pattern != "" {
			m.ServeHTTP(w, q)
			return
		}
		rec := &recorder{header: http.Header{}}
		h.ServeHTTP(rec, q)
		switch rec.code {
		case http.StatusNotFound:
			writeError(w, rec.code, errNotFound, fmt.Sprintf("no such operation: %s %s (GET /openapi.json lists them)", q.Method, q.URL.Path))
		case http.StatusMethodNotAllowed:
			w.Header().Set("Allow", rec.header.Get("Allow"))
			writeError(w, rec.code, errMethod, fmt.Sprintf("%s %s: this path takes %s", q.Method, q.URL.Path, rec.header.Get("Allow")))
		default: // a redirect to the cleaned path
			for k, v := range rec.header {
				w.Header()[k] = v
			}
			w.WriteHeader(rec.code)
			_, _ = w.Write(rec.body.Bytes())
		}
	})
}

// recorder keeps what the mux's own handlers write.
type recorder struct {
	header http.Header
	code   int
	body   bytes.Buffer
}

func (r *recorder) Header() http.Header { return r.header }
func (r *recorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
}
func (r *recorder) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.body.Write(b)
}

// Routes lists the operations the handler serves ("METHOD /path"), sorted;
// a test checks them against the OpenAPI document.
func (s *Server) Routes() []string {
	r := s.routes()
	out := make([]string, 0, len(r))
	for k := range r {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func (s *Server) routes() map[string]http.Handler {
	doc := openapi.Raw(openapi.Server)
	return map[string]http.Handler{
		"POST /v1/episodes":                   http.HandlerFunc(s.startEpisode),
		"GET /v1/episodes":                    http.HandlerFunc(s.listEpisodes),
		"GET /v1/episodes/{id}":               http.HandlerFunc(s.getEpisode),
		"POST /v1/episodes/{id}/verify":       http.HandlerFunc(s.verifyEpisode),
		"POST /v1/episodes/{id}/retire":       http.HandlerFunc(s.retireEpisode),
		"GET /v1/episodes/{id}/ledger":        http.HandlerFunc(s.getLedger),
		"GET /v1/episodes/{id}/ledger/verify": http.HandlerFunc(s.verifyLedger),
		"GET /v1/tasks":                       http.HandlerFunc(s.listTasks),
		"POST /v1/checkpoints":                http.HandlerFunc(s.createCheckpoint),
		"GET /v1/checkpoints":                 http.HandlerFunc(s.listCheckpoints),
		"GET /v1/checkpoints/{id}":            http.HandlerFunc(s.getCheckpoint),
		"POST /v1/checkpoints/{id}/restore":   http.HandlerFunc(s.restoreCheckpoint),
		"POST /v1/checkpoints/{id}/branch":    http.HandlerFunc(s.branchCheckpoint),
		"DELETE /v1/checkpoints/{id}":         http.HandlerFunc(s.deleteCheckpoint),

		"GET /metrics": s.m.handler(s.gw.Metrics()),
		"GET /healthz": http.HandlerFunc(s.healthz),
		"GET /openapi.json": http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(doc)
		}),
	}
}

// Error types of the server's own, with their status codes; the others
// are package errdefs's (errdefs.Code), with its statuses.
const (
	errNotFound    = "not_found"          // 404
	errMethod      = "method_not_allowed" // 405
	errTooLarge    = "too_large"          // 413
	errUnavailable = "unavailable"        // 503 (shutting down)
	// 502: the node that drives an episode did not answer a request
	// forwarded to it.
	errNodeUnreachable = "node_unreachable"
)

// apiError is an error with the status and type to answer it with, for
// the statuses that are HTTP's own (a body too large) rather than a kind
// of package errdefs's.
type apiError struct {
	status int
	typ    string
	msg    string
}

func (e *apiError) Error() string { return e.msg }

// bad is a request the server refuses as invalid (400).
func bad(format string, args ...any) error {
	return errdefs.Errorf(errdefs.ErrInvalid, format, args...)
}

// conflict is a request the present state refuses (409).
func conflict(format string, args ...any) error {
	return errdefs.Errorf(errdefs.ErrConflict, format, args...)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		writeError(w, http.StatusInternalServerError, errdefs.CodeInternal, err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

func writeError(w http.ResponseWriter, status int, typ, msg string) {
	b, _ := json.Marshal(map[string]any{"error": map[string]string{"type": typ, "message": msg}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// fail answers err: an *apiError as it says, an error of one of package
// errdefs's kinds with that kind's status and type (no error is classified
// by its text), and anything else 500, logged.
func (s *Server) fail(w http.ResponseWriter, q *http.Request, err error) {
	var ae *apiError
	if errors.As(err, &ae) {
		writeError(w, ae.status, ae.typ, ae.msg)
		return
	}
	status := errdefs.HTTPStatus(err)
	if status == http.StatusInternalServerError {
		s.log.Error("request failed", "method", q.Method, "path", q.URL.Path, "err", err)
	}
	writeError(w, status, errdefs.Code(err), err.Error())
}

// decode reads a JSON object of at most MaxBody bytes into dst, refusing
// unknown fields and trailing data. An empty body leaves dst as it is
// when allowEmpty.
func decode(w http.ResponseWriter, q *http.Request, dst any, allowEmpty bool) error {
	b, err := io.ReadAll(http.MaxBytesReader(w, q.Body, MaxBody))
	if err != nil {
		var tooLarge *http.MaxBytesError
		if errors.As(err, &tooLarge) {
			return &apiError{http.StatusRequestEntityTooLarge, errTooLarge, fmt.Sprintf("the request body is over %d bytes", MaxBody)}
		}
		return bad("reading the request body: %v", err)
	}
	if len(bytes.TrimSpace(b)) == 0 {
		if allowEmpty {
			return nil
		}
		return bad("the request needs a JSON object as its body")
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return bad("the request body is not the JSON object this operation takes: %v", err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return bad("the request body has data after its JSON object")
	}
	return nil
}

// newID is prefix and 12 random hex digits.
func newID(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// episodeID is what the gateway accepts as an episode name.
var episodeID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// checkpointID is what the record store accepts as a checkpoint id.
var checkpointID = regexp.MustCompile(`^[A-Za-z0-9._:@+-]{1,200}$`)

// TokenPath is where an episode's relay credentials are inside its
// sandbox.
func TokenPath(episodeID string) string {
	return path.Join(checkpoint.SessionDir(episodeID), "token.json")
}

// EpisodeView is an episode as the API shows it: the record store's row
// and what the server knows of it now.
type EpisodeView struct {
	store.Episode
	// Live: this server drives it (its sandbox runs).
	Live bool `json:"live"`
	// Status is its supervisor's status when live, else null.
	Status      *supervisor.Status `json:"status"`
	StatusError string             `json:"status_error,omitempty"`
	// ModelCalls is the live length of its ledger (0 when it has none).
	ModelCalls int64 `json:"model_calls"`
	// LedgerOK: the ledger's hash chain verifies and its history is not
	// broken (false when there is no ledger).
	LedgerOK bool `json:"ledger_ok"`
	// Reward is the recorded verdict's (of the current attempt), or null
	// before any verify; Verdict its status (resolved, unresolved, error).
	Reward  *int   `json:"reward"`
	Verdict string `json:"verdict,omitempty"`
	// TokenPath is set in the answer to a start only.
	TokenPath string `json:"token_path,omitempty"`
}

func (s *Server) view(ctx context.Context, row store.Episode) EpisodeView {
	v := EpisodeView{Episode: row}
	if e, ok := s.coord.Live(row.ID); ok {
		v.Live = true
		sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		st, err := e.Status(sctx)
		cancel()
		if err != nil {
			v.StatusError = err.Error()
		} else {
			v.Status = st
			if st.State == supervisor.StateExited && row.State == store.EpisodeRunning {
				// Its harness has ended: so says the store from now on.
				s.coord.MarkEnded(ctx, row.ID)
				v.State = store.EpisodeEnded
			}
		}
	}
	if rep, err := ledger.VerifyIn(s.gw.Ledgers(), row.ID); err == nil {
		v.ModelCalls = rep.Live
		v.LedgerOK = rep.OK && !rep.Broken
	}
	if vd, ok, err := s.env.Verifier.Recorded(ctx, row.ID, row.Attempt); err == nil && ok {
		r := vd.Reward
		v.Reward, v.Verdict = &r, vd.Status
	}
	return v
}

// views makes the views of rows, a few at a time (a live episode's status
// is an exec in its sandbox).
func (s *Server) views(ctx context.Context, rows []store.Episode) []EpisodeView {
	out := make([]EpisodeView, len(rows))
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for i, r := range rows {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			out[i] = s.view(ctx, r)
		}()
	}
	wg.Wait()
	return out
}

// StartRequest is the body of POST /v1/episodes.
type StartRequest struct {
	ID        string   `json:"id,omitempty"`
	Task      string   `json:"task"`
	Harness   string   `json:"harness"`
	Provider  string   `json:"provider,omitempty"`
	PauseMode string   `json:"pause_mode,omitempty"`
	DeadlineS *float64 `json:"deadline_s,omitempty"`
	// Limits bound the episode's sandbox, every attempt's (fields left
	// out: the server's; local provider only).
	Limits *sandbox.Limits `json:"limits,omitempty"`
	// Image is the episode's sandbox image (default: the task's, then
	// the server's --image): an image reference on the local provider,
	// the service's template or image name on a hosted one.
	Image string `json:"image,omitempty"`
}

func (s *Server) startEpisode(w http.ResponseWriter, q *http.Request) {
	var req StartRequest
	if err := decode(w, q, &req, false); err != nil {
		s.fail(w, q, err)
		return
	}
	if err := s.checkStart(&req); err != nil {
		s.fail(w, q, err)
		return
	}
	ctx := context.WithoutCancel(q.Context()) // a client that goes away does not leave a half-started episode
	// An id that is retired or lost is started again as its next attempt
	// (the coordinator checks its task and harness); one that runs or has
	// ended is refused.
	if row, err := s.store.GetEpisode(ctx, req.ID); err == nil && row.State != store.EpisodeRetired && row.State != store.EpisodeLost {
		s.fail(w, q, conflict("episode %s already exists and is %s: retire it first to start it again as its next attempt, or give another id", req.ID, row.State))
		return
	}
	s.startMu.Lock()
	if s.starting[req.ID] {
		s.startMu.Unlock()
		s.fail(w, q, conflict("episode %s is being started", req.ID))
		return
	}
	s.starting[req.ID] = true
	s.startMu.Unlock()
	defer func() {
		s.startMu.Lock()
		delete(s.starting, req.ID)
		s.startMu.Unlock()
	}()
	var deadline time.Duration
	if req.DeadlineS != nil {
		deadline = time.Duration(*req.DeadlineS * float64(time.Second))
	}
	so := coordinator.StartOptions{Deadline: deadline, Image: req.Image}
	if req.Limits != nil {
		so.Limits = *req.Limits
	}
	row, err := s.coord.StartWith(ctx, req.ID, req.Task, req.Harness, so)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	v := s.view(ctx, row)
	v.TokenPath = TokenPath(row.ID)
	writeJSON(w, http.StatusCreated, v)
}

// checkStart checks a start request and fills in its defaults.
func (s *Server) checkStart(req *StartRequest) error {
	if req.ID == "" {
		req.ID = newID("ep-")
	}
	if !episodeID.MatchString(req.ID) {
		return bad("episode id %q: use letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128", req.ID)
	}
	if req.Task == "" {
		return bad(`"task" is required: one of the server's tasks (stasis tasks ls)`)
	}
	if _, err := task.Lookup(s.tasks, req.Task); err != nil {
		return bad("%v", err)
	}
	if req.Harness == "" {
		return bad(`"harness" is required: %s`, strings.Join(harness.Names(), " or "))
	}
	if _, err := harness.New(req.Harness); err != nil {
		return bad("%v", err)
	}
	if req.Harness == "opencode" && s.noOpenCode != "" {
		return bad("%s", s.noOpenCode)
	}
	name := s.provider.Name()
	switch req.Provider {
	case "", name:
		req.Provider = name
	default:
		return bad("provider %q: this server runs the %s provider only (serve --provider)", req.Provider, name)
	}
	// Stop is available on every provider (a memory snapshot then holds a
	// stopped tree, continued by SIGCONT); hold only where snapshots keep
	// processes. The default is hold there, stop elsewhere.
	keeps := s.provider.Capabilities().KeepsProcesses
	switch supervisor.Mode(req.PauseMode) {
	case "":
		req.PauseMode = string(episode.DefaultPauseMode(s.provider))
	case supervisor.ModeStop:
	case supervisor.ModeHold, supervisor.ModeHoldFreeze:
		if !keeps {
			return bad("pause mode %s: the %s provider's snapshots are file-only, so a harness left running would change files while they are copied; use pause mode stop", req.PauseMode, name)
		}
		if req.PauseMode == string(supervisor.ModeHoldFreeze) && !s.provider.Capabilities().Freeze {
			return bad("pause mode hold+freeze: %s; use pause mode hold", sandbox.NoFreezeReason(name))
		}
	default:
		if keeps {
			return bad("pause mode %q: use %s (the default here), %s or %s", req.PauseMode, supervisor.ModeHold, supervisor.ModeHoldFreeze, supervisor.ModeStop)
		}
		return bad("pause mode %q: use %s", req.PauseMode, supervisor.ModeStop)
	}
	if req.DeadlineS != nil && (*req.DeadlineS <= 0 || *req.DeadlineS > 7*24*3600 || math.IsNaN(*req.DeadlineS)) {
		return bad("deadline_s %v: give the harness's time budget in seconds, more than 0 and at most a week (leave it out for the task's budget)", *req.DeadlineS)
	}
	if req.Image != "" {
		if req.Image != strings.TrimSpace(req.Image) || len(req.Image) > 4096 || strings.ContainsAny(req.Image, "\x00\n") {
			return bad("image %.60q: give one image reference", req.Image)
		}
		if name == "local" || name == "microvm" {
			if _, err := image.ParseRef(req.Image); err != nil {
				return bad("image: %v", err)
			}
		}
	}
	if req.Limits != nil {
		if name != "local" && *req.Limits != (sandbox.Limits{}) {
			return bad("limits: the %s provider's sandboxes are sized by the service or the VM, not by stasis; limits are for the local provider", name)
		}
		if err := req.Limits.Check(); err != nil {
			return bad("limits: %v", err)
		}
	}
	return nil
}

func (s *Server) listEpisodes(w http.ResponseWriter, q *http.Request) {
	qs := q.URL.Query()
	state := store.EpisodeState(qs.Get("state"))
	switch state {
	case "", store.EpisodeRunning, store.EpisodeEnded, store.EpisodeRetired, store.EpisodeLost:
	default:
		s.fail(w, q, bad("state %q: use running, ended, retired or lost", state))
		return
	}
	// A running row whose harness has ended becomes ended when viewed, so
	// both are read for either, and filtered after.
	from := state
	if state == store.EpisodeRunning || state == store.EpisodeEnded {
		from = ""
	}
	rows, err := s.store.ListEpisodes(q.Context(), from)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	taskID, h := qs.Get("task"), qs.Get("harness")
	kept := rows[:0]
	for _, r := range rows {
		if (taskID == "" || r.Task == taskID) && (h == "" || r.Harness == h) && (from == state || r.State == store.EpisodeRunning || r.State == state) {
			kept = append(kept, r)
		}
	}
	views := s.views(q.Context(), kept)
	if from != state {
		out := views[:0]
		for _, v := range views {
			if v.State == state {
				out = append(out, v)
			}
		}
		views = out
	}
	writeJSON(w, http.StatusOK, map[string]any{"episodes": views})
}

func (s *Server) getEpisode(w http.ResponseWriter, q *http.Request) {
	row, err := s.store.GetEpisode(q.Context(), q.PathValue("id"))
	if err != nil {
		s.fail(w, q, err)
		return
	}
	if s.forward(w, q, row) {
		return
	}
	writeJSON(w, http.StatusOK, s.view(q.Context(), row))
}

// VerifyResponse is the answer to POST /v1/episodes/{id}/verify.
type VerifyResponse struct {
	Verdict task.Verdict `json:"verdict"`
	// Recorded: the verdict was recorded before this call (nothing ran).
	Recorded bool `json:"recorded"`
}

func (s *Server) verifyEpisode(w http.ResponseWriter, q *http.Request) {
	id := q.PathValue("id")
	ctx := context.WithoutCancel(q.Context())
	row, err := s.store.GetEpisode(ctx, id)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	if s.forward(w, q, row) {
		return
	}
	_, live := s.coord.Live(id)
	v, rec, err := s.coord.Verify(ctx, id)
	if err != nil {
		if !live && !errors.Is(err, errdefs.ErrNotFound) {
			// Neither live nor verified: nothing to run the tests in.
			err = errdefs.Errorf(errdefs.ErrConflict, "%w", err)
		}
		s.fail(w, q, err)
		return
	}
	writeJSON(w, http.StatusOK, VerifyResponse{Verdict: v, Recorded: rec})
}

func (s *Server) retireEpisode(w http.ResponseWriter, q *http.Request) {
	id := q.PathValue("id")
	ctx := context.WithoutCancel(q.Context())
	row, err := s.store.GetEpisode(ctx, id)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	if s.forward(w, q, row) {
		return
	}
	if err := s.coord.Retire(ctx, id); err != nil {
		s.fail(w, q, err)
		return
	}
	row, err = s.store.GetEpisode(ctx, id)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	writeJSON(w, http.StatusOK, s.view(ctx, row))
}

// LedgerResponse is the answer to GET /v1/episodes/{id}/ledger: the
// episode's ledger as `stasis ledger show --json` prints it, its entries
// limited to the page asked for.
type LedgerResponse struct {
	ledger.History
	// Live is the logical ledger's whole length; More says entries past
	// this page remain (ask again with after = the last seq given).
	Live int64 `json:"live"`
	More bool  `json:"more"`
}

// MaxLedgerPage bounds the entries of one ledger page.
const MaxLedgerPage = 10000

// episodeLedgerID checks that the path's episode is known to the store and
// names a ledger.
func (s *Server) episodeLedgerID(q *http.Request) (string, error) {
	id := q.PathValue("id")
	if _, err := s.store.GetEpisode(q.Context(), id); err != nil {
		return "", err
	}
	if err := ledger.CheckEpisode(id); err != nil {
		return "", bad("%v", err)
	}
	return id, nil
}

// getLedger answers an episode's logical ledger (every model call its
// harness acted on, with token ids and logprobs when the model server gave
// them), the entries cuts dropped and the cuts and broken marks. An
// episode that has made no model call has an empty ledger. Query: after
// (entries with a greater seq only), limit (at most that many; at most
// MaxLedgerPage, the default), bodies=false (leave out each entry's
// request and response: the tokens, usage and hashes stay).
func (s *Server) getLedger(w http.ResponseWriter, q *http.Request) {
	// The query first: a bad one is refused whatever the episode.
	qs := q.URL.Query()
	after, limit, bodies := int64(0), int64(MaxLedgerPage), true
	var err error
	if v := qs.Get("after"); v != "" {
		if after, err = strconv.ParseInt(v, 10, 64); err != nil || after < 0 {
			s.fail(w, q, bad("after %q: give the seq of the last entry you have, 0 for the start", v))
			return
		}
	}
	if v := qs.Get("limit"); v != "" {
		if limit, err = strconv.ParseInt(v, 10, 64); err != nil || limit < 1 || limit > MaxLedgerPage {
			s.fail(w, q, bad("limit %q: give a number of entries from 1 to %d", v, MaxLedgerPage))
			return
		}
	}
	if v := qs.Get("bodies"); v != "" {
		if bodies, err = strconv.ParseBool(v); err != nil {
			s.fail(w, q, bad("bodies %q: give true or false", v))
			return
		}
	}
	id, err := s.episodeLedgerID(q)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	h, err := ledger.ReadIn(s.gw.Ledgers(), id)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		h = ledger.History{Path: s.gw.Ledgers().Where(id), Episode: id, Entries: []ledger.Entry{}, Dropped: []ledger.Entry{}, Events: []ledger.Event{}}
	case errors.Is(err, ledger.ErrCorrupt):
		s.fail(w, q, conflict("%v (GET /v1/episodes/%s/ledger/verify says where)", err, id))
		return
	case err != nil:
		s.fail(w, q, err)
		return
	}
	resp := LedgerResponse{Live: int64(len(h.Entries))}
	page := []ledger.Entry{}
	for _, e := range h.Entries {
		if e.Seq <= after {
			continue
		}
		if int64(len(page)) == limit {
			resp.More = true
			break
		}
		page = append(page, e)
	}
	h.Entries = page
	if !bodies {
		for _, es := range [][]ledger.Entry{h.Entries, h.Dropped} {
			for i := range es {
				es[i].Request, es[i].Response = nil, nil
			}
		}
	}
	resp.History = h
	writeJSON(w, http.StatusOK, resp)
}

// verifyLedger walks an episode's whole ledger file (ledger.Verify): ok
// false names the first bad record. An episode that has made no model
// call has an empty ledger, which verifies.
func (s *Server) verifyLedger(w http.ResponseWriter, q *http.Request) {
	id, err := s.episodeLedgerID(q)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	rep, err := ledger.VerifyIn(s.gw.Ledgers(), id)
	if errors.Is(err, fs.ErrNotExist) {
		rep, err = ledger.Report{Path: s.gw.Ledgers().Where(id), Episode: id, OK: true}, nil
	}
	if err != nil {
		s.fail(w, q, err)
		return
	}
	writeJSON(w, http.StatusOK, rep)
}

// TaskSummary is a task as GET /v1/tasks lists it.
type TaskSummary struct {
	ID       string `json:"id"`
	Language string `json:"language,omitempty"`
	Title    string `json:"title,omitempty"`
	// Image is the task's own image reference, if it has one.
	Image string `json:"image,omitempty"`
	// BudgetS is the harness's time budget in seconds.
	BudgetS float64 `json:"budget_s"`
	// FailToPass and PassToPass count the tests verify grades by.
	FailToPass int `json:"fail_to_pass"`
	PassToPass int `json:"pass_to_pass"`
}

// listTasks answers the tasks this server starts episodes on.
func (s *Server) listTasks(w http.ResponseWriter, _ *http.Request) {
	out := make([]TaskSummary, len(s.tasks))
	for i, t := range s.tasks {
		out[i] = TaskSummary{ID: t.ID, Language: t.Language, Title: t.Title, Image: t.Image, BudgetS: t.Budget().Seconds(), FailToPass: len(t.FailToPass), PassToPass: len(t.PassToPass)}
	}
	writeJSON(w, http.StatusOK, map[string]any{"tasks": out})
}

// CheckpointRequest is the body of POST /v1/checkpoints.
type CheckpointRequest struct {
	ID string `json:"id,omitempty"`
	// Stragglers overrides the server's policy for episodes that cannot
	// be checkpointed: exclude (commit without them, each named with the
	// reason) or fail.
	Stragglers string `json:"stragglers,omitempty"`
}

// CheckpointResponse is the answer to POST /v1/checkpoints: the
// coordinator's result, and when the checkpoint committed but an episode
// could not be continued after it, why.
type CheckpointResponse struct {
	coordinator.Result
	ContinueError string `json:"continue_error,omitempty"`
	// Shares, on a node of a cluster, are every node's share of the
	// checkpoint (Episodes are this node's).
	Shares []store.Share `json:"shares,omitempty"`
}

func (s *Server) createCheckpoint(w http.ResponseWriter, q *http.Request) {
	var req CheckpointRequest
	if err := decode(w, q, &req, true); err != nil {
		s.fail(w, q, err)
		return
	}
	if req.ID == "" {
		req.ID = "ckpt-" + time.Now().UTC().Format("20060102T150405Z") + "-" + newID("")[:8]
	}
	if !checkpointID.MatchString(req.ID) {
		s.fail(w, q, bad("checkpoint id %q: use at most 200 letters, digits and - _ . : @ +", req.ID))
		return
	}
	if err := coordinator.CheckStragglers(req.Stragglers); err != nil {
		s.fail(w, q, bad("%v", err))
		return
	}
	ctx := context.WithoutCancel(q.Context()) // a checkpoint under way finishes whatever the client does
	start := time.Now()
	if s.member != nil {
		s.createClusterCheckpoint(w, q, ctx, req, start)
		return
	}
	res, err := s.coord.PrepareWith(ctx, req.ID, coordinator.PrepareOptions{Stragglers: req.Stragglers})
	if err != nil {
		if errors.Is(err, errdefs.ErrExists) {
			s.fail(w, q, err)
			return
		}
		if ck, _, gerr := s.store.Get(ctx, req.ID); gerr == nil && ck.State == store.StateCommitted {
			s.m.checkpoints.WithLabelValues("committed").Inc()
			s.m.checkpointSeconds.Observe(time.Since(start).Seconds())
			writeJSON(w, http.StatusCreated, CheckpointResponse{Result: res, ContinueError: err.Error()})
			return
		}
		s.m.checkpoints.WithLabelValues("failed").Inc()
		s.fail(w, q, err)
		return
	}
	s.m.checkpoints.WithLabelValues("committed").Inc()
	s.m.checkpointSeconds.Observe(time.Since(start).Seconds())
	writeJSON(w, http.StatusCreated, CheckpointResponse{Result: filled(res)})
}

// createClusterCheckpoint takes a checkpoint over every live node of the
// cluster: every node's share of it, committed by the last to finish.
func (s *Server) createClusterCheckpoint(w http.ResponseWriter, q *http.Request, ctx context.Context, req CheckpointRequest, start time.Time) {
	res, err := s.member.Checkpoint(ctx, req.ID, req.Stragglers)
	if err != nil {
		if res.State == store.StateFailed {
			s.m.checkpoints.WithLabelValues("failed").Inc()
		}
		s.fail(w, q, err)
		return
	}
	s.m.checkpoints.WithLabelValues("committed").Inc()
	s.m.checkpointSeconds.Observe(time.Since(start).Seconds())
	res.Seconds = time.Since(start).Seconds()
	writeJSON(w, http.StatusCreated, CheckpointResponse{Result: filled(res.Result), Shares: res.Shares})
}

// filled is r with an empty list of episodes and map of phases rather
// than none, as the API's answers always carry them.
func filled(r coordinator.Result) coordinator.Result {
	if r.Episodes == nil {
		r.Episodes = []coordinator.EpisodeFigures{}
	}
	if r.Phases == nil {
		r.Phases = map[string]float64{}
	}
	return r
}

func (s *Server) listCheckpoints(w http.ResponseWriter, q *http.Request) {
	qs := q.URL.Query()
	opts := store.ListOptions{State: store.State(qs.Get("state"))}
	switch opts.State {
	case "", store.StatePending, store.StateCommitted, store.StateFailed:
	default:
		s.fail(w, q, bad("state %q: use pending, committed or failed", opts.State))
		return
	}
	if l := qs.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 0 {
			s.fail(w, q, bad("limit %q: give a number, 0 for no limit", l))
			return
		}
		opts.Limit = n
	}
	cks, err := s.store.List(q.Context(), opts)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	if cks == nil {
		cks = []store.Checkpoint{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"checkpoints": cks})
}

// CheckpointProgress is how far a checkpoint is, for a trainer watching it
// run: its nodes' shares finished (one node: the checkpoint itself) and the
// records in (one per episode, as each is paused and snapshotted).
type CheckpointProgress struct {
	Nodes     int `json:"nodes"`
	NodesDone int `json:"nodes_done"`
	Records   int `json:"records"`
}

// getCheckpoint answers a checkpoint with its records (one per episode in
// so far), and, on a cluster, each node's share, with the progress.
func (s *Server) getCheckpoint(w http.ResponseWriter, q *http.Request) {
	ck, recs, err := s.store.Get(q.Context(), q.PathValue("id"))
	if err != nil {
		s.fail(w, q, err)
		return
	}
	if recs == nil {
		recs = []store.Record{}
	}
	out := map[string]any{"checkpoint": ck, "records": recs}
	p := CheckpointProgress{Nodes: 1, Records: len(recs)}
	if ck.State != store.StatePending {
		p.NodesDone = 1
	}
	if pg, ok := s.store.(*store.Postgres); ok && s.member != nil {
		shares, err := pg.Shares(q.Context(), ck.ID)
		if err != nil {
			s.fail(w, q, err)
			return
		}
		if len(shares) > 0 {
			out["shares"] = shares
			p.Nodes, p.NodesDone = len(shares), 0
			for _, sh := range shares {
				if sh.State != store.SharePending {
					p.NodesDone++
				}
			}
		}
	}
	out["progress"] = p
	writeJSON(w, http.StatusOK, out)
}

// RestoreRequest is the optional body of POST /v1/checkpoints/{id}/restore.
type RestoreRequest struct {
	// Episodes, when given, are the only episodes of the checkpoint to
	// bring back (the others go on as they are); a retired one named
	// comes back (as its next attempt when it was running at the
	// checkpoint, as it ended when it had ended). Without it, every
	// episode of the checkpoint but the retired ones.
	Episodes []string `json:"episodes,omitempty"`
}

func (s *Server) restoreCheckpoint(w http.ResponseWriter, q *http.Request) {
	id := q.PathValue("id")
	var req RestoreRequest
	if err := decode(w, q, &req, true); err != nil {
		s.fail(w, q, err)
		return
	}
	if req.Episodes != nil && len(req.Episodes) == 0 {
		s.fail(w, q, bad("episodes is empty: name at least one episode, or leave it out to restore every one"))
		return
	}
	ctx := context.WithoutCancel(q.Context())
	// Whether the checkpoint is committed and names no live episode is the
	// coordinator's to say (Restore), before it touches anything.
	start := time.Now()
	var out RestoreResponse
	var err error
	if s.member != nil {
		var cr cluster.RestoreResult
		cr, err = s.member.Restore(ctx, id, req.Episodes)
		out = RestoreResponse{Result: cr.Result, Restore: &cr.Restore, Shares: cr.Shares}
		if err != nil && cr.Restore.State == store.RestoreGo {
			// The restore went (every node's forks were ready): what
			// failed is continuing some episodes (a node stopped after
			// it went, and finishes them when it starts again). Not an
			// error to retry: the restore is done.
			out.ContinueError, err = err.Error(), nil
		}
	} else {
		out.Result, err = s.coord.RestoreWith(ctx, id, coordinator.RestoreOptions{Episodes: req.Episodes})
	}
	if err != nil {
		s.m.restores.WithLabelValues("failed").Inc()
		s.fail(w, q, err)
		return
	}
	s.m.restores.WithLabelValues("restored").Inc()
	s.m.restoreSeconds.Observe(time.Since(start).Seconds())
	out.Result = filled(out.Result)
	out.Checkpoint = id
	writeJSON(w, http.StatusOK, out)
}

// RestoreResponse is the answer to POST /v1/checkpoints/{id}/restore: the
// coordinator's result; on a node of a cluster, this node's figures and
// the restore over every node with each node's share.
type RestoreResponse struct {
	coordinator.Result
	Restore *store.Restore       `json:"restore,omitempty"`
	Shares  []store.RestoreShare `json:"shares,omitempty"`
	// ContinueError, on a cluster, says which episodes the restore went
	// for but could not continue yet (their node stopped after it went;
	// it continues them when it starts again).
	ContinueError string `json:"continue_error,omitempty"`
}

// BranchRequest is the body of POST /v1/checkpoints/{id}/branch.
type BranchRequest struct {
	// Episode is the checkpoint's episode to branch from.
	Episode string `json:"episode"`
	// Copies is how many (1 to MaxCopies); IDs names them (default:
	// EPISODE-bN, the first N free).
	Copies int      `json:"copies,omitempty"`
	IDs    []string `json:"ids,omitempty"`
}

// MaxCopies bounds one branch.
const MaxCopies = 64

// branchCheckpoint continues one episode of a committed checkpoint as N new
// episodes (coordinator.Branch): RL users branch rollouts from one state.
func (s *Server) branchCheckpoint(w http.ResponseWriter, q *http.Request) {
	id := q.PathValue("id")
	var req BranchRequest
	if err := decode(w, q, &req, false); err != nil {
		s.fail(w, q, err)
		return
	}
	if req.Episode == "" {
		s.fail(w, q, bad(`"episode" is required: the checkpoint's episode to branch from`))
		return
	}
	switch {
	case req.Copies == 0 && len(req.IDs) == 0:
		req.Copies = 1
	case req.Copies == 0:
		req.Copies = len(req.IDs)
	}
	if req.Copies < 1 || req.Copies > MaxCopies || (len(req.IDs) > 0 && len(req.IDs) != req.Copies) {
		s.fail(w, q, bad("copies %d with %d ids: give 1 to %d copies, and as many ids if any", req.Copies, len(req.IDs), MaxCopies))
		return
	}
	for _, n := range req.IDs {
		if !episodeID.MatchString(n) {
			s.fail(w, q, bad("episode id %q: use letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128", n))
			return
		}
	}
	// Whether the checkpoint is committed and has the episode is the
	// coordinator's to say (Branch), before it touches anything.
	ctx := context.WithoutCancel(q.Context())
	if len(req.IDs) == 0 {
		for k := 1; len(req.IDs) < req.Copies && k <= 100000; k++ {
			n := fmt.Sprintf("%s-b%d", req.Episode, k)
			if len(n) > 128 {
				break
			}
			if _, err := s.store.GetEpisode(ctx, n); errors.Is(err, errdefs.ErrNotFound) {
				req.IDs = append(req.IDs, n)
			}
		}
		if len(req.IDs) < req.Copies {
			s.fail(w, q, bad("episode %s: no free names for %d copies: give ids", req.Episode, req.Copies))
			return
		}
	}
	res, err := s.coord.Branch(ctx, id, req.Episode, req.IDs)
	if err != nil {
		s.fail(w, q, err)
		return
	}
	writeJSON(w, http.StatusCreated, filled(res))
}

func (s *Server) deleteCheckpoint(w http.ResponseWriter, q *http.Request) {
	freed, err := s.coord.DeleteCheckpoint(context.WithoutCancel(q.Context()), q.PathValue("id"))
	if err != nil {
		s.fail(w, q, err)
		return
	}
	if freed == nil {
		freed = []store.SnapshotRef{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"freed": freed})
}

func (s *Server) healthz(w http.ResponseWriter, q *http.Request) {
	ctx, cancel := context.WithTimeout(q.Context(), 5*time.Second)
	defer cancel()
	if _, err := s.store.List(ctx, store.ListOptions{Limit: 1}); err != nil {
		// Liveness answers without credentials: the cause goes to the log.
		s.log.Warn("healthz: the record store is unreachable", "err", err)
		http.Error(w, "record store unreachable (see the server's log)", http.StatusServiceUnavailable)
		return
	}
	_, _ = io.WriteString(w, "ok\n")
}
