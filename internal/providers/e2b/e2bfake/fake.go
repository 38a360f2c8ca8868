// Package e2bfake is a fake E2B for tests: an http.Handler that serves the
// part of E2B's REST API and of envd that the e2b provider uses, with the
// behaviour E2B's specifications and SDKs give (status codes, {code,
// message} error bodies, X-API-Key authentication, running↔paused
// transitions, relative timeouts that end sandboxes, cursor pagination),
// backed by a real sandbox.Provider: every sandbox is a backend sandbox and
// every envd command and file operation runs there for real.
//
// It owns the fake's state and its faults on request: answers with a
// status (429 with Retry-After, 500, ...) or slowly, for requests that
// match; the k-th sandbox made from a snapshot failing (the conformance
// suite's FailFork); a sandbox that vanishes before its timeout; a service
// that ignores timeouts. It counts the deletes of each sandbox and logs the
// requests it received, for tests to check.
//
// Both planes are served on one handler, told apart the way E2B's sandbox
// proxy routes envd requests in the SDKs' E2B_SANDBOX_URL mode: a request
// with an E2b-Sandbox-Id header is for that sandbox's envd. Point the
// provider's BaseURL and EnvdURL at the same server.
//
// Where it differs from E2B: snapshots and pauses are those of the backend
// (with the local provider, file-only: processes do not survive them, so
// the provider runs with FileOnlySnapshots; with the microVM provider and
// HostClockOnResume, memory snapshots with AgentENV's clock behaviour),
// resuming makes a new backend sandbox under the same id, snapshot names
// are refused, and /files takes raw bodies only (no multipart).
package e2bfake

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/internal/guestclock"
	"stasis/internal/providers/faults"
	"stasis/internal/retryafter"
	"stasis/sandbox"
)

// Options configure the fake.
type Options struct {
	// APIKey is the key the API takes (default "e2b_fake").
	APIKey string
	// Templates are the templates sandboxes can be made from besides
	// snapshots (default: "base").
	Templates []string
	// PageLimit is the most items a list answers with per page, whatever
	// the request's limit (default 100, the spec's maximum).
	PageLimit int
	// Lease is the expiry given to backend sandboxes, beyond which the
	// backend ends them whatever the fake's timeouts say (default 1h).
	Lease time.Duration
	// Now is the clock (default time.Now).
	Now func() time.Time
	// HostClockOnResume is AgentENV's behaviour with memory snapshots (a
	// backend whose snapshots keep processes, such as the microVM
	// provider): a sandbox resumed or made from a snapshot gets the
	// host's wall clock, while its uptime goes on from the snapshot. The
	// backend must be able to set a guest's clock (ClockSetter).
	HostClockOnResume bool
	// Image is the backend image of every sandbox not made from a
	// snapshot (a template's image, on a real service); empty: the
	// backend's own root.
	Image string
}

// ClockSetter is a backend that sets a guest's wall clock (the microVM
// provider does).
type ClockSetter interface {
	SetClock(ctx context.Context, id string, t guestclock.Target) (guestclock.Fix, error)
}

// hostClock sets a backend sandbox made from a snapshot to the host's wall
// clock, in HostClockOnResume mode.
func (f *Server) hostClock(ctx context.Context, backendID string) error {
	if !f.o.HostClockOnResume {
		return nil
	}
	cs, ok := f.b.(ClockSetter)
	if !ok {
		return fmt.Errorf("HostClockOnResume: the backend %s cannot set a guest's clock", f.b.Name())
	}
	_, err := cs.SetClock(ctx, backendID, guestclock.Target{Wall: float64(f.now().UnixNano()) / 1e9})
	return err
}

// Server is the fake.
type Server struct {
	o    Options
	b    sandbox.Provider
	api  *http.ServeMux
	envd *http.ServeMux

	ctx    context.Context // ended by Close: every process ends
	cancel context.CancelFunc
	procs  sync.WaitGroup

	mu             sync.Mutex
	sbs            map[string]*sbx
	tmpls          map[string]*tmpl
	faults         []*fault
	forkFaults     map[string]*forkFault
	retired        map[string]int
	backendIDs     map[string][]string
	ignoreTimeouts bool
	closed         bool

	logMu sync.Mutex // the request log, apart: answers are written under mu
	log   []*Request
}

// sbx is one sandbox.
type sbx struct {
	id, template, token string
	state               string // running, paused, or pausing / resuming while the backend works
	backend             string // the backend sandbox while running
	pausedSnap          string // the backend snapshot while paused
	metadata, env       map[string]string
	startedAt, endAt    time.Time
	timer               *time.Timer
	ctx                 context.Context // ended when the sandbox stops running
	cancel              context.CancelFunc
	procs               map[uint32]*process
}

// Transitional states: the backend is busy; other transitions get 409.
const (
	statePausing  = "pausing"
	stateResuming = "resuming"
)

// tmpl is a snapshot template.
type tmpl struct {
	id      string
	backend string // the backend snapshot
	env     map[string]string
	source  string
	created time.Time
	deleted bool
}

type forkFault struct {
	k, seen int
}

// Fault makes requests that match fail or answer slowly.
type Fault struct {
	// Method and Path select requests: an empty Method matches any; Path
	// matches a path that equals it, or starts with it when it ends in
	// "/", or any path when empty.
	Method, Path string
	// Envd selects the envd plane instead of the API.
	Envd bool
	// Status answers with this status and an error body; 0 serves the
	// request normally (after Delay).
	Status int
	// RetryAfter is sent as Retry-After (whole seconds, rounded up).
	RetryAfter time.Duration
	// Delay holds the answer this long first.
	Delay time.Duration
	// Times is how many requests it hits (0: until undone).
	Times int
}

type fault struct {
	Fault
	hits int
}

// Request is one request the fake received.
type Request struct {
	At     time.Time
	Method string
	Path   string
	Query  string
	// Body is the request's body (API plane, and envd's Start and unary
	// calls; at most 64 KiB).
	Body []byte
	// Envd: the request was for envd; Sandbox names the sandbox then.
	Envd    bool
	Sandbox string
	// Status is the answer's status (0 until it is written).
	Status int
}

// New makes a fake over a backend provider.
func New(backend sandbox.Provider, o Options) *Server {
	if o.APIKey == "" {
		o.APIKey = "e2b_fake"
	}
	if len(o.Templates) == 0 {
		o.Templates = []string{"base"}
	}
	if o.PageLimit <= 0 || o.PageLimit > 100 {
		o.PageLimit = 100
	}
	if o.Lease == 0 {
		o.Lease = time.Hour
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &Server{
		o: o, b: backend, api: http.NewServeMux(), envd: http.NewServeMux(), ctx: ctx, cancel: cancel,
		sbs: map[string]*sbx{}, tmpls: map[string]*tmpl{}, forkFaults: map[string]*forkFault{},
		retired: map[string]int{}, backendIDs: map[string][]string{},
	}
	f.routes()
	return f
}

// APIKey is the key the fake takes.
func (f *Server) APIKey() string { return f.o.APIKey }

func (f *Server) now() time.Time { return f.o.Now() }

// ServeHTTP serves both planes.
func (f *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	envd := r.Header.Get(headerSandboxID) != ""
	rec := Request{At: f.now(), Method: r.Method, Path: r.URL.Path, Query: r.URL.RawQuery, Envd: envd, Sandbox: r.Header.Get(headerSandboxID)}
	if !envd || strings.HasPrefix(r.URL.Path, "/process.Process/") {
		b, err := io.ReadAll(io.LimitReader(r.Body, 64<<10+1))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		if len(b) > 64<<10 {
			// A big body: keep streaming it to the handler.
			r.Body = struct {
				io.Reader
				io.Closer
			}{io.MultiReader(strings.NewReader(string(b)), r.Body), r.Body}
			b = b[:64<<10]
		} else {
			r.Body = io.NopCloser(strings.NewReader(string(b)))
		}
		rec.Body = b
	}
	// Logged on arrival (a stream's client may be done before its handler
	// returns); the status is filled in at the end.
	sw := &statusWriter{ResponseWriter: w, f: f, rec: &rec}
	f.logMu.Lock()
	f.log = append(f.log, &rec)
	f.logMu.Unlock()
	if fl := f.matchFault(r, envd); fl != nil {
		if retryafter.Wait(r.Context(), fl.Delay) != nil {
			return // the client gave up
		}
		if fl.Status != 0 {
			if fl.RetryAfter > 0 {
				secs := (fl.RetryAfter + time.Second - 1) / time.Second
				sw.Header().Set("Retry-After", strconv.Itoa(int(secs)))
			}
			writeError(sw, fl.Status, "injected fault")
			return
		}
	}
	if envd {
		f.envd.ServeHTTP(sw, r)
		return
	}
	if r.Header.Get(headerAPIKey) != f.o.APIKey {
		writeError(sw, http.StatusUnauthorized, "Invalid API key, it must be a valid key of the team (X-API-Key)")
		return
	}
	f.api.ServeHTTP(sw, r)
}

// statusWriter records the status in the request's log entry before the
// client can see it; it passes Flush on for streams.
type statusWriter struct {
	http.ResponseWriter
	f      *Server
	rec    *Request
	status int
}

func (s *statusWriter) WriteHeader(code int) {
	if s.status == 0 {
		s.status = code
		s.f.logMu.Lock()
		s.rec.Status = code
		s.f.logMu.Unlock()
	}
	s.ResponseWriter.WriteHeader(code)
}

func (s *statusWriter) Write(b []byte) (int, error) {
	if s.status == 0 {
		s.WriteHeader(http.StatusOK)
	}
	return s.ResponseWriter.Write(b)
}

func (s *statusWriter) Flush() {
	if fl, ok := s.ResponseWriter.(http.Flusher); ok {
		fl.Flush()
	}
}

func (f *Server) matchFault(r *http.Request, envd bool) *Fault {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i, fl := range f.faults {
		if fl.Envd != envd || (fl.Method != "" && fl.Method != r.Method) {
			continue
		}
		if fl.Path != "" && r.URL.Path != fl.Path && !(strings.HasSuffix(fl.Path, "/") && strings.HasPrefix(r.URL.Path, fl.Path)) {
			continue
		}
		fl.hits++
		out := fl.Fault
		if fl.Times > 0 && fl.hits >= fl.Times {
			f.faults = append(f.faults[:i:i], f.faults[i+1:]...)
		}
		return &out
	}
	return nil
}

// Inject adds a fault; undo removes it (if it has not run out).
func (f *Server) Inject(fl Fault) (undo func()) {
	return faults.Add(&f.mu, &f.faults, &fault{Fault: fl})
}

// FailFork makes the k-th sandbox (0-based) made from the snapshot from now
// on fail with a 500, as the conformance suite's hook asks; undo removes it.
func (f *Server) FailFork(snapshot string, k int) (undo func()) {
	return faults.Put(&f.mu, f.forkFaults, templateID(snapshot), &forkFault{k: k})
}

// IgnoreTimeouts makes the fake leave sandboxes running past their timeout
// (on), as a service that failed to end them would.
func (f *Server) IgnoreTimeouts(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ignoreTimeouts = on
	if !on {
		now := f.now()
		for _, sb := range f.sbs {
			if sb.state == stateRunning {
				f.armLocked(sb, now)
			}
		}
	}
}

// Vanish ends a sandbox as if the service lost it: it is gone from the API
// and its backend sandbox is deleted, whatever its timeout. It does not
// count as a delete.
func (f *Server) Vanish(id string) bool {
	return f.end(id, false)
}

// Retired says how many DELETE requests ended the sandbox.
func (f *Server) Retired(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.retired[id]
}

// BackendIDs lists the backend sandboxes that have been the sandbox (a
// resume makes a new one).
func (f *Server) BackendIDs(id string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.backendIDs[id]...)
}

// EndAt is the time at which the fake ends the running sandbox.
func (f *Server) EndAt(id string) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[id]
	if !ok || sb.state != stateRunning {
		return time.Time{}, false
	}
	return sb.endAt, true
}

// State is a sandbox's state ("running", "paused"; "" when gone).
func (f *Server) State(id string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb, ok := f.sbs[id]; ok {
		return sb.state
	}
	return ""
}

// Requests returns the requests received so far.
func (f *Server) Requests() []Request {
	f.logMu.Lock()
	defer f.logMu.Unlock()
	out := make([]Request, len(f.log))
	for i, r := range f.log {
		out[i] = *r
	}
	return out
}

// Sandboxes lists the ids of the sandboxes the fake holds.
func (f *Server) Sandboxes() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ids []string
	for id := range f.sbs {
		ids = append(ids, id)
	}
	return ids
}

// Close ends every process and deletes every backend sandbox and snapshot
// the fake holds. Close the HTTP server after it.
func (f *Server) Close() error {
	f.mu.Lock()
	f.closed = true
	var ids []string
	for id := range f.sbs {
		ids = append(ids, id)
	}
	var snaps []string
	for _, t := range f.tmpls {
		if !t.deleted && t.backend != "" {
			snaps = append(snaps, t.backend)
			t.deleted = true
		}
	}
	f.mu.Unlock()
	f.cancel()
	for _, id := range ids {
		f.end(id, false)
	}
	ctx := context.Background()
	for _, s := range snaps {
		_ = f.b.DeleteSnapshot(ctx, s)
	}
	f.procs.Wait()
	return nil
}

// end removes a sandbox and deletes its backend sandbox and paused
// snapshot; retire counts it as a delete. It reports whether the sandbox
// was there.
func (f *Server) end(id string, retire bool) bool {
	f.mu.Lock()
	sb, ok := f.sbs[id]
	if !ok {
		f.mu.Unlock()
		return false
	}
	delete(f.sbs, id)
	if retire {
		f.retired[id]++
	}
	if sb.timer != nil {
		sb.timer.Stop()
	}
	if sb.cancel != nil {
		sb.cancel()
	}
	backend, snap := sb.backend, sb.pausedSnap
	f.mu.Unlock()
	ctx := context.Background()
	if backend != "" {
		_ = f.b.Delete(ctx, backend)
	}
	if snap != "" {
		_ = f.b.DeleteSnapshot(ctx, snap)
	}
	return true
}

// armLocked (re)arms the timer that ends a running sandbox at its endAt.
func (f *Server) armLocked(sb *sbx, now time.Time) {
	if sb.timer != nil {
		sb.timer.Stop()
	}
	id, at := sb.id, sb.endAt
	sb.timer = time.AfterFunc(at.Sub(now), func() { f.timeUp(id, at) })
}

// timeUp ends a sandbox whose timeout passed, unless its end moved or the
// fake ignores timeouts.
func (f *Server) timeUp(id string, at time.Time) {
	f.mu.Lock()
	sb, ok := f.sbs[id]
	if !ok || sb.state != stateRunning || !sb.endAt.Equal(at) || f.ignoreTimeouts {
		f.mu.Unlock()
		return
	}
	f.mu.Unlock()
	f.end(id, false)
}

// newID is an E2B-like id: 20 lowercase letters and digits.
func newID() string {
	const chars = "abcdefghijklmnopqrstuvwxyz0123456789"
	b := make([]byte, 20)
	_, _ = rand.Read(b)
	for i := range b {
		b[i] = chars[int(b[i])%len(chars)]
	}
	return string(b)
}

// templateID is a template id without its tag.
func templateID(s string) string {
	id, _, _ := strings.Cut(s, ":")
	return id
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError answers with E2B's error body.
func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, apiError{Code: status, Message: msg})
}
