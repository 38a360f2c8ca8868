// Package osfake is a fake OpenSandbox server for tests. It owns the
// server side of what the opensandbox provider speaks: the Lifecycle API
// (/v1: sandboxes with Pending, Running, Pausing, Paused, Resuming and
// Failed states, metadata filters and pagination, absolute expiry renewal
// and the server's own expiry, snapshots that go Creating → Ready or
// Failed, endpoints, API-key auth) and, per sandbox, an execd (commands
// streamed as execd streams them, file upload and download, interrupts)
// at the endpoint it hands out ({host}/sandboxes/{id}/port/44772), behind
// the access token the endpoint names, and through the server's proxy
// route ({host}/sandboxes/{id}/proxy/44772).
//
// The behaviour follows the OpenSandbox specifications
// (specs/sandbox-lifecycle.yml, specs/execd-api.yaml at commit
// 4db3a993c6a7) and, where they are silent, the reference server and
// execd: error bodies {code, message}, 202 for asynchronous operations,
// 409 for a wrong state, execd's line-by-line output events.
//
// Sandboxes are real: each is a sandbox of the backend Provider given (in
// tests, the local provider), and commands and files go through it.
//
// Faults on request: any status (429 with Retry-After, 500, …) or a delay
// for the requests that match (Inject); a snapshot that stays in Creating
// (StickSnapshots); the k-th sandbox restored from a snapshot failing
// (FailFork); a sandbox that disappears before its expiry (Vanish).
// Retired counts the deletes of each sandbox.
package osfake

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"reflect"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/internal/providers/faults"
	"stasis/internal/providers/strictjson"
	"stasis/internal/retryafter"
	"stasis/sandbox"
)

// Options configure the fake.
type Options struct {
	// Backend runs the sandboxes. Required.
	Backend sandbox.Provider
	// APIKey, when set, is the only OPEN-SANDBOX-API-KEY accepted (else
	// 401); empty accepts requests without a key, as a server without one.
	APIKey string
	// ProvisionDelay keeps a new sandbox Pending at least this long.
	ProvisionDelay time.Duration
	// TransitionDelay is how long Pausing and Resuming last (default 20ms).
	TransitionDelay time.Duration
	// MaxTimeout is the longest timeout a sandbox may be created with
	// (default 24h).
	MaxTimeout time.Duration
}

// Fake is the fake server; it is an http.Handler.
type Fake struct {
	o   Options
	mux *http.ServeMux

	mu        sync.Mutex
	sandboxes map[string]*sb
	snapshots map[string]*snap
	retired   map[string]int
	faults    []*Fault
	stuck     map[string]int // source sandbox ("" for every one) → holds
	failFork  map[string]*forkFault
	cmds      map[string]context.CancelFunc
	closed    bool
	wg        sync.WaitGroup
}

type sb struct {
	id, backend, token string
	image              string
	snapshotID         string
	entrypoint         []string
	metadata           map[string]string
	env                map[string]string
	state, reason, msg string
	transition         time.Time
	created            time.Time
	expires            *time.Time
	timer              *time.Timer
	gone               bool
}

type snap struct {
	id, sandboxID, name string
	backend             string
	state, reason, msg  string
	transition, created time.Time
	captured            bool
}

type forkFault struct{ k, seen int }

// New makes a fake over a backend provider.
func New(o Options) *Fake {
	if o.Backend == nil {
		panic("osfake: no backend provider")
	}
	if o.TransitionDelay <= 0 {
		o.TransitionDelay = 20 * time.Millisecond
	}
	if o.MaxTimeout <= 0 {
		o.MaxTimeout = 24 * time.Hour
	}
	f := &Fake{o: o, mux: http.NewServeMux(), sandboxes: map[string]*sb{}, snapshots: map[string]*snap{}, retired: map[string]int{},
		stuck: map[string]int{}, failFork: map[string]*forkFault{}, cmds: map[string]context.CancelFunc{}}
	m := f.mux
	m.HandleFunc("POST /v1/sandboxes", f.createSandbox)
	m.HandleFunc("GET /v1/sandboxes", f.listSandboxes)
	m.HandleFunc("GET /v1/sandboxes/{id}", f.getSandbox)
	m.HandleFunc("DELETE /v1/sandboxes/{id}", f.deleteSandbox)
	m.HandleFunc("PATCH /v1/sandboxes/{id}/metadata", f.patchMetadata)
	m.HandleFunc("POST /v1/sandboxes/{id}/pause", f.pause)
	m.HandleFunc("POST /v1/sandboxes/{id}/resume", f.resume)
	m.HandleFunc("POST /v1/sandboxes/{id}/renew-expiration", f.renew)
	m.HandleFunc("POST /v1/sandboxes/{id}/snapshots", f.createSnapshot)
	m.HandleFunc("GET /v1/sandboxes/{id}/endpoints/{port}", f.endpoint)
	m.HandleFunc("GET /v1/snapshots", f.listSnapshots)
	m.HandleFunc("GET /v1/snapshots/{sid}", f.getSnapshot)
	m.HandleFunc("DELETE /v1/snapshots/{sid}", f.deleteSnapshot)
	// execd, at the sandbox's own endpoint ("port", behind the endpoint's
	// access token) and through the server's proxy ("proxy", which adds
	// the token itself and needs no API key).
	for _, route := range []string{"port", "proxy"} {
		pre := "/sandboxes/{id}/" + route + "/{port}"
		m.HandleFunc("GET "+pre+"/ping", f.execd(f.ping))
		m.HandleFunc("POST "+pre+"/command", f.execd(f.runCommand))
		m.HandleFunc("DELETE "+pre+"/command", f.execd(f.interruptCommand))
		m.HandleFunc("POST "+pre+"/files/upload", f.execd(f.upload))
		m.HandleFunc("GET "+pre+"/files/download", f.execd(f.download))
		m.HandleFunc("DELETE "+pre+"/files", f.execd(f.removeFiles))
	}
	return f
}

// ExecdPort is where execd listens in a sandbox.
const ExecdPort = 44772

const (
	apiKeyHeader     = "OPEN-SANDBOX-API-KEY"
	execdTokenHeader = "X-EXECD-ACCESS-TOKEN"
)

// ServeHTTP serves the Lifecycle API under /v1 and each sandbox's execd.
func (f *Fake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Request-ID", newUUID())
	if f.fault(w, r) {
		return
	}
	if strings.HasPrefix(r.URL.Path, "/v1/") && f.o.APIKey != "" {
		switch key := r.Header.Get(apiKeyHeader); {
		case key == "":
			writeError(w, http.StatusUnauthorized, "MISSING_API_KEY", "Authentication credentials are missing. Provide API key via "+apiKeyHeader+" header.")
			return
		case key != f.o.APIKey:
			writeError(w, http.StatusUnauthorized, "INVALID_API_KEY", "Authentication credentials are invalid. Check your API key and try again.")
			return
		}
	}
	f.mux.ServeHTTP(w, r)
}

// Close stops the fake's timers, deletes the backend sandboxes still
// there and waits for its background work. Close the HTTP server first.
func (f *Fake) Close() {
	f.mu.Lock()
	f.closed = true
	var left []string
	for _, s := range f.sandboxes {
		if s.timer != nil {
			s.timer.Stop()
		}
		s.gone = true
		if s.backend != "" {
			left = append(left, s.backend)
		}
	}
	f.sandboxes = map[string]*sb{}
	for _, cancel := range f.cmds {
		cancel()
	}
	f.mu.Unlock()
	for _, id := range left {
		_ = f.o.Backend.Delete(context.Background(), id)
	}
	f.wg.Wait()
}

// Retired says how many times a sandbox was deleted through the API.
func (f *Fake) Retired(id string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.retired[id]
}

// BackendID is the backend sandbox behind a sandbox ("" while Pending).
func (f *Fake) BackendID(id string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s := f.sandboxes[id]; s != nil {
		return s.backend
	}
	return ""
}

// Vanish makes a sandbox disappear at once, as if the server lost it: its
// backend sandbox is deleted and every request about it gets 404.
func (f *Fake) Vanish(id string) error {
	f.mu.Lock()
	s := f.sandboxes[id]
	if s == nil {
		f.mu.Unlock()
		return fmt.Errorf("osfake: no sandbox %s", id)
	}
	f.dropLocked(s)
	f.mu.Unlock()
	if s.backend != "" {
		return f.o.Backend.Delete(context.Background(), s.backend)
	}
	return nil
}

// StickSnapshots keeps the snapshots of a sandbox ("" for every sandbox)
// in Creating, those made before too, until undo is called.
func (f *Fake) StickSnapshots(sandboxID string) (undo func()) {
	f.mu.Lock()
	f.stuck[sandboxID]++
	f.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			if f.stuck[sandboxID]--; f.stuck[sandboxID] <= 0 {
				delete(f.stuck, sandboxID)
			}
			f.mu.Unlock()
		})
	}
}

// FailFork makes the k-th sandbox (0-based, in order of arrival) created
// from the snapshot from now on fail to provision (it goes Failed); undo
// ends that.
func (f *Fake) FailFork(snapshot string, k int) (undo func()) {
	return faults.Put(&f.mu, f.failFork, snapshot, &forkFault{k: k})
}

// Fault is a misbehaviour for the requests that match Method (any when
// empty) and begin with Path (any when empty): a Delay before the answer
// (cut short when the client gives up), then, when Status is set, that
// status with an error body (and Retry-After when set) instead of the
// answer. Times bounds how many requests it hits (0: all).
type Fault struct {
	Method     string
	Path       string
	Status     int
	RetryAfter string
	Delay      time.Duration
	Times      int

	mu   sync.Mutex
	hits []time.Time
}

// Hits returns when the fault hit.
func (ft *Fault) Hits() []time.Time {
	ft.mu.Lock()
	defer ft.mu.Unlock()
	return append([]time.Time(nil), ft.hits...)
}

// Inject adds a fault; remove takes it away.
func (f *Fake) Inject(ft *Fault) (remove func()) {
	return faults.Add(&f.mu, &f.faults, ft)
}

// fault applies the first fault that matches; true when it answered.
func (f *Fake) fault(w http.ResponseWriter, r *http.Request) bool {
	f.mu.Lock()
	var hit *Fault
	for _, ft := range f.faults {
		if (ft.Method == "" || ft.Method == r.Method) && strings.HasPrefix(r.URL.Path, ft.Path) {
			ft.mu.Lock()
			if ft.Times == 0 || len(ft.hits) < ft.Times {
				ft.hits = append(ft.hits, time.Now())
				hit = ft
			}
			ft.mu.Unlock()
			if hit != nil {
				break
			}
		}
	}
	f.mu.Unlock()
	if hit == nil {
		return false
	}
	if retryafter.Wait(r.Context(), hit.Delay) != nil {
		return true // the client gave up
	}
	if hit.Status == 0 {
		return false
	}
	if hit.RetryAfter != "" {
		w.Header().Set("Retry-After", hit.RetryAfter)
	}
	writeError(w, hit.Status, "INJECTED_FAULT", fmt.Sprintf("injected fault: %d %s", hit.Status, http.StatusText(hit.Status)))
	return true
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, map[string]string{"code": code, "message": msg})
}

func newHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func newUUID() string {
	h := newHex(16)
	return h[:8] + "-" + h[8:12] + "-4" + h[13:16] + "-a" + h[17:20] + "-" + h[20:]
}

// Kubernetes label rules, which the server applies to metadata.
var (
	labelName   = regexp.MustCompile(`^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$`)
	labelPrefix = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`)
)

func validKey(k string) bool {
	prefix, name, ok := strings.Cut(k, "/")
	if !ok {
		name, prefix = k, ""
	} else if prefix == "" || len(prefix) > 253 || !labelPrefix.MatchString(prefix) {
		return false
	}
	return len(name) <= 63 && labelName.MatchString(name)
}

func validValue(v string) bool { return v == "" || len(v) <= 63 && labelName.MatchString(v) }

// checkMetadata applies the server's metadata rules; "" when they hold.
func checkMetadata(md map[string]string) string {
	for k, v := range md {
		switch {
		case strings.HasPrefix(k, "opensandbox.io/"):
			return fmt.Sprintf("Metadata key '%s' uses the reserved prefix 'opensandbox.io/'.", k)
		case !validKey(k):
			return fmt.Sprintf("Metadata key '%s' is invalid: must be a name or a DNS-subdomain prefix and a name separated by /.", k)
		case !validValue(v):
			return fmt.Sprintf("Metadata value '%s' is invalid: must be 63 characters or less, start and end with an alphanumeric character, and contain only alphanumeric, '-', '_', or '.' characters.", v)
		}
	}
	return ""
}

// sandbox JSON (Sandbox; full says whether the startup source is shown,
// which the create response leaves out).
func (s *sb) json(full bool) map[string]any {
	status := map[string]any{"state": s.state, "lastTransitionAt": s.transition.Format(time.RFC3339Nano)}
	if s.reason != "" {
		status["reason"] = s.reason
	}
	if s.msg != "" {
		status["message"] = s.msg
	}
	md := map[string]string{}
	for k, v := range s.metadata {
		md[k] = v
	}
	m := map[string]any{"id": s.id, "status": status, "metadata": md, "entrypoint": s.entrypoint, "createdAt": s.created.Format(time.RFC3339Nano)}
	if s.expires != nil {
		m["expiresAt"] = s.expires.Format(time.RFC3339Nano)
	}
	if full {
		if s.snapshotID != "" {
			m["snapshotId"] = s.snapshotID
		}
		if s.image != "" {
			m["image"] = map[string]string{"uri": s.image}
		}
	}
	return m
}

func (s *sb) set(state, reason, msg string) {
	s.state, s.reason, s.msg, s.transition = state, reason, msg, time.Now().UTC()
}

// lookup finds a sandbox or answers 404.
func (f *Fake) lookup(w http.ResponseWriter, id string) *sb {
	s := f.sandboxes[id]
	if s == nil {
		writeError(w, http.StatusNotFound, "SANDBOX_NOT_FOUND", fmt.Sprintf("Sandbox %s not found", id))
	}
	return s
}

// dropLocked removes a sandbox from the fake.
func (f *Fake) dropLocked(s *sb) {
	s.gone = true
	if s.timer != nil {
		s.timer.Stop()
	}
	delete(f.sandboxes, s.id)
}

// armLocked sets the server's own expiry of a sandbox: at expiresAt it is
// removed, with its backend sandbox.
func (f *Fake) armLocked(s *sb) {
	if s.expires == nil || f.closed {
		return
	}
	d := time.Until(*s.expires)
	if s.timer != nil {
		s.timer.Reset(d)
		return
	}
	s.timer = time.AfterFunc(d, func() {
		f.mu.Lock()
		if f.closed || s.gone || s.expires == nil || time.Now().Before(*s.expires) {
			f.mu.Unlock()
			return
		}
		f.dropLocked(s)
		f.wg.Add(1)
		f.mu.Unlock()
		defer f.wg.Done()
		if s.backend != "" {
			_ = f.o.Backend.Delete(context.Background(), s.backend)
		}
	})
}

func (f *Fake) backendExpiry(s *sb) time.Time {
	if s.expires != nil {
		return *s.expires
	}
	return time.Now().Add(f.o.MaxTimeout)
}

// Request bodies, read with strictjson (member names exactly as the
// specification spells them, as the reference server reads them).

// createRequest is CreateSandboxRequest.
type createRequest struct {
	Image *struct {
		URI string `json:"uri"`
	} `json:"image"`
	SnapshotID     string            `json:"snapshotId"`
	Timeout        *int              `json:"timeout"`
	ResourceLimits map[string]string `json:"resourceLimits"`
	Env            map[string]string `json:"env"`
	Metadata       map[string]string `json:"metadata"`
	Entrypoint     []string          `json:"entrypoint"`
	Extensions     map[string]string `json:"extensions"`
}

// renewRequest is RenewSandboxExpirationRequest.
type renewRequest struct {
	ExpiresAt *time.Time `json:"expiresAt"`
}

// snapshotRequest is CreateSnapshotRequest.
type snapshotRequest struct {
	Name *string `json:"name"`
}

// readJSON reads a request body into v with strictjson; an empty body is
// io.EOF. closed refuses members v does not name (a schema with
// additionalProperties: false).
func readJSON(r *http.Request, v any, closed bool) error {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		return err
	}
	if len(bytes.TrimSpace(b)) == 0 {
		return io.EOF
	}
	if err := strictjson.Unmarshal(b, v); err != nil || !closed {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	return dec.Decode(reflect.New(reflect.TypeOf(v).Elem()).Interface())
}

func (f *Fake) createSandbox(w http.ResponseWriter, r *http.Request) {
	var req createRequest
	if err := readJSON(r, &req, false); err != nil {
		writeError(w, http.StatusBadRequest, "SANDBOX::INVALID_PARAMETER", "invalid request body: "+err.Error())
		return
	}
	if code, msg := req.check(f.o.MaxTimeout); msg != "" {
		writeError(w, http.StatusBadRequest, code, msg)
		return
	}
	s := req.sandbox()
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		writeError(w, http.StatusServiceUnavailable, "SERVER_CLOSED", "the server is shutting down")
		return
	}
	var fromSnap *snap
	injected := false
	if req.SnapshotID != "" {
		fromSnap = f.snapshots[req.SnapshotID]
		if fromSnap == nil {
			f.mu.Unlock()
			writeError(w, http.StatusNotFound, "SNAPSHOT::NOT_FOUND", fmt.Sprintf("Snapshot %s not found", req.SnapshotID))
			return
		}
		if f.snapStateLocked(fromSnap) != "Ready" {
			f.mu.Unlock()
			writeError(w, http.StatusConflict, "SNAPSHOT::NOT_READY", fmt.Sprintf("Snapshot %s is not ready for restore.", req.SnapshotID))
			return
		}
		if ff := f.failFork[req.SnapshotID]; ff != nil {
			injected = ff.seen == ff.k
			ff.seen++
		}
	}
	f.sandboxes[s.id] = s
	f.armLocked(s)
	f.wg.Add(1)
	backendSnap := ""
	if fromSnap != nil {
		backendSnap = fromSnap.backend
	}
	resp := s.json(false)
	f.mu.Unlock()
	go f.provision(s, backendSnap, injected)
	w.Header().Set("Location", "/v1/sandboxes/"+s.id)
	writeJSON(w, http.StatusAccepted, resp)
}

// hasImage says whether the request names an image.
func (req *createRequest) hasImage() bool {
	return req.Image != nil && strings.TrimSpace(req.Image.URI) != ""
}

// check checks a create request as the server does: the error's code and
// message, or "" for a good one.
func (req *createRequest) check(maxTimeout time.Duration) (code, msg string) {
	hasImage := req.hasImage()
	pool := req.Extensions["poolRef"] != ""
	switch {
	case hasImage == (req.SnapshotID != "") && !pool:
		return "SANDBOX::INVALID_PARAMETER", "Exactly one of image or snapshotId must be provided."
	case hasImage && len(req.Entrypoint) == 0 && !pool:
		return "SANDBOX::INVALID_PARAMETER", "entrypoint is required when image is provided."
	case len(req.ResourceLimits) == 0 && !pool:
		return "SANDBOX::INVALID_PARAMETER", "resourceLimits is required."
	case req.Timeout != nil && *req.Timeout < 60:
		return "SANDBOX::INVALID_PARAMETER", "timeout must be at least 60 seconds."
	case req.Timeout != nil && time.Duration(*req.Timeout)*time.Second > maxTimeout:
		return "SANDBOX::INVALID_PARAMETER", fmt.Sprintf("timeout exceeds the server's maximum of %d seconds.", int(maxTimeout.Seconds()))
	}
	if msg := checkMetadata(req.Metadata); msg != "" {
		return "INVALID_METADATA_LABEL", msg
	}
	return "", ""
}

// sandbox is the Pending sandbox a checked request makes.
func (req *createRequest) sandbox() *sb {
	now := time.Now().UTC()
	s := &sb{id: newUUID(), token: newHex(16), snapshotID: req.SnapshotID, entrypoint: req.Entrypoint, metadata: map[string]string{}, env: req.Env, created: now}
	if len(s.entrypoint) == 0 {
		// A restore, or a pool's sandbox: the server's default entry
		// process (the specification has entrypoint in every answer, never
		// null).
		s.entrypoint = []string{"tail", "-f", "/dev/null"}
	}
	for k, v := range req.Metadata {
		s.metadata[k] = v
	}
	if req.hasImage() {
		s.image = req.Image.URI
	}
	if req.Timeout != nil {
		t := now.Add(time.Duration(*req.Timeout) * time.Second)
		s.expires = &t
	}
	s.set("Pending", "SANDBOX_SCHEDULED", "Sandbox is being provisioned.")
	return s
}

// provision makes the backend sandbox of a Pending one.
func (f *Fake) provision(s *sb, backendSnap string, injected bool) {
	defer f.wg.Done()
	if f.o.ProvisionDelay > 0 {
		time.Sleep(f.o.ProvisionDelay) // the fake's provisioning time, not a synchronisation
	}
	ctx := context.Background()
	var id string
	var err error
	expiry := f.backendExpiry(s)
	switch {
	case injected:
		err = errors.New("injected provisioning failure")
	case backendSnap != "":
		var infos []sandbox.Info
		if infos, err = f.o.Backend.Fork(ctx, backendSnap, 1, sandbox.ForkSpec{Labels: map[string]string{"osfake": s.id}, Expiry: expiry}); err == nil {
			id = infos[0].ID
		}
	default:
		var info sandbox.Info
		if info, err = f.o.Backend.Create(ctx, sandbox.Spec{Env: s.env, Labels: map[string]string{"osfake": s.id}, Expiry: expiry}); err == nil {
			id = info.ID
		}
	}
	f.mu.Lock()
	if s.gone || f.closed {
		f.mu.Unlock()
		if id != "" {
			_ = f.o.Backend.Delete(ctx, id)
		}
		return
	}
	if err != nil {
		s.set("Failed", "provision_failed", err.Error())
	} else {
		s.backend = id
		s.set("Running", "", "")
	}
	f.mu.Unlock()
}

func (f *Fake) getSandbox(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s := f.lookup(w, r.PathValue("id")); s != nil {
		writeJSON(w, http.StatusOK, s.json(true))
	}
}

// page reads page and pageSize (1 ≤ pageSize ≤ 200, as the server).
func page(w http.ResponseWriter, q url.Values) (int, int, bool) {
	pg, size := 1, 20
	var err error
	if v := q.Get("page"); v != "" {
		if pg, err = strconv.Atoi(v); err != nil || pg < 1 {
			writeError(w, http.StatusBadRequest, "INVALID_PARAMETER", "page must be an integer of at least 1")
			return 0, 0, false
		}
	}
	if v := q.Get("pageSize"); v != "" {
		if size, err = strconv.Atoi(v); err != nil || size < 1 || size > 200 {
			writeError(w, http.StatusBadRequest, "INVALID_PARAMETER", "pageSize must be an integer from 1 to 200")
			return 0, 0, false
		}
	}
	return pg, size, true
}

// listPage is the body of a list answer: page pg (of size) of items,
// newest first by key's time (ties by its id), each as toJSON makes it.
func listPage[T any](items []T, pg, size int, key func(T) (time.Time, string), toJSON func(T) map[string]any) map[string]any {
	sort.Slice(items, func(i, j int) bool {
		ti, idi := key(items[i])
		tj, idj := key(items[j])
		if !ti.Equal(tj) {
			return ti.After(tj)
		}
		return idi < idj
	})
	total := len(items)
	pages := (total + size - 1) / size
	start := min((pg-1)*size, total)
	end := min(start+size, total)
	out := make([]map[string]any, 0, end-start)
	for _, x := range items[start:end] {
		out = append(out, toJSON(x))
	}
	return map[string]any{"items": out, "pagination": map[string]any{"page": pg, "pageSize": size, "totalItems": total, "totalPages": pages, "hasNextPage": pg < pages}}
}

func (f *Fake) listSandboxes(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	pg, size, ok := page(w, q)
	if !ok {
		return
	}
	var filter url.Values
	if md := q.Get("metadata"); md != "" {
		var err error
		if filter, err = url.ParseQuery(md); err != nil {
			writeError(w, http.StatusBadRequest, "INVALID_METADATA_FORMAT", "Invalid metadata format: "+err.Error())
			return
		}
	}
	states := q["state"]
	f.mu.Lock()
	var match []*sb
	for _, s := range f.sandboxes {
		if len(states) > 0 && !contains(states, s.state) {
			continue
		}
		ok := true
		for k := range filter {
			if v, has := s.metadata[k]; !has || v != filter.Get(k) {
				ok = false
			}
		}
		if ok {
			match = append(match, s)
		}
	}
	body := listPage(match, pg, size, func(s *sb) (time.Time, string) { return s.created, s.id }, func(s *sb) map[string]any { return s.json(true) })
	f.mu.Unlock()
	writeJSON(w, http.StatusOK, body)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if strings.EqualFold(x, s) {
			return true
		}
	}
	return false
}

func (f *Fake) deleteSandbox(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	s := f.lookup(w, r.PathValue("id"))
	if s == nil {
		f.mu.Unlock()
		return
	}
	f.dropLocked(s)
	f.retired[s.id]++
	backend := s.backend
	f.mu.Unlock()
	if backend != "" {
		if err := f.o.Backend.Delete(r.Context(), backend); err != nil {
			writeError(w, http.StatusInternalServerError, "SANDBOX_DELETE_FAILED", "Failed to delete sandbox: "+err.Error())
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}

func (f *Fake) patchMetadata(w http.ResponseWriter, r *http.Request) {
	var patch map[string]*string
	if err := readJSON(r, &patch, false); err != nil {
		writeError(w, http.StatusBadRequest, "INVALID_PARAMETER", "invalid merge patch: "+err.Error())
		return
	}
	add := map[string]string{}
	for k, v := range patch {
		if v != nil {
			add[k] = *v
		} else if strings.HasPrefix(k, "opensandbox.io/") {
			add[k] = ""
		}
	}
	if msg := checkMetadata(add); msg != "" {
		writeError(w, http.StatusBadRequest, "INVALID_METADATA_LABEL", msg)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.lookup(w, r.PathValue("id"))
	if s == nil {
		return
	}
	for k, v := range patch {
		if v == nil {
			delete(s.metadata, k)
		} else {
			s.metadata[k] = *v
		}
	}
	writeJSON(w, http.StatusOK, s.json(true))
}

func (f *Fake) pause(w http.ResponseWriter, r *http.Request) {
	f.transition(w, r, "Running", "Pausing", "Paused", "SANDBOX_NOT_RUNNING", "Sandbox is not in a running state.", "STOP")
}

func (f *Fake) resume(w http.ResponseWriter, r *http.Request) {
	f.transition(w, r, "Paused", "Resuming", "Running", "SANDBOX_NOT_PAUSED", "Sandbox is not in a paused state.", "CONT")
}

// transition moves a sandbox from one stable state through an intermediate
// one to the next, stopping or continuing every process in it.
func (f *Fake) transition(w http.ResponseWriter, r *http.Request, from, via, to, code, msg, signal string) {
	f.mu.Lock()
	s := f.lookup(w, r.PathValue("id"))
	if s == nil {
		f.mu.Unlock()
		return
	}
	if s.state != from {
		f.mu.Unlock()
		writeError(w, http.StatusConflict, code, msg)
		return
	}
	s.set(via, "", "")
	backend := s.backend
	f.wg.Add(1)
	f.mu.Unlock()
	go func() {
		defer f.wg.Done()
		ctx := context.Background()
		// kill -1 reaches every process of the sandbox but its init and
		// the shell sending it.
		_, _ = f.o.Backend.Exec(ctx, backend, sandbox.ExecRequest{User: execUser, Argv: []string{"/bin/sh", "-c", "kill -" + signal + " -1 2>/dev/null; true"}, Timeout: 30 * time.Second})
		time.Sleep(f.o.TransitionDelay) // the fake's transition time, not a synchronisation
		f.mu.Lock()
		if !s.gone && s.state == via {
			s.set(to, "", "")
		}
		f.mu.Unlock()
	}()
	w.WriteHeader(http.StatusAccepted)
}

func (f *Fake) renew(w http.ResponseWriter, r *http.Request) {
	var req renewRequest
	if err := readJSON(r, &req, false); err != nil || req.ExpiresAt == nil {
		writeError(w, http.StatusBadRequest, "INVALID_EXPIRATION", "expiresAt is required, as an RFC 3339 time")
		return
	}
	t := req.ExpiresAt.UTC()
	f.mu.Lock()
	s := f.lookup(w, r.PathValue("id"))
	if s == nil {
		f.mu.Unlock()
		return
	}
	switch {
	case !t.After(time.Now()):
		f.mu.Unlock()
		writeError(w, http.StatusBadRequest, "INVALID_EXPIRATION", "New expiration time must be in the future.")
		return
	case s.expires == nil:
		f.mu.Unlock()
		writeError(w, http.StatusConflict, "INVALID_EXPIRATION", fmt.Sprintf("Sandbox %s does not have automatic expiration enabled.", s.id))
		return
	case !t.After(*s.expires):
		f.mu.Unlock()
		writeError(w, http.StatusConflict, "INVALID_EXPIRATION", "New expiration time must be after the current expiresAt.")
		return
	case t.Sub(s.created) > f.o.MaxTimeout:
		f.mu.Unlock()
		writeError(w, http.StatusBadRequest, "INVALID_EXPIRATION", "New expiration time exceeds the server's maximum sandbox lifetime.")
		return
	}
	s.expires = &t
	f.armLocked(s)
	backend := s.backend
	f.mu.Unlock()
	if backend != "" {
		if err := f.o.Backend.SetExpiry(r.Context(), backend, t); err != nil {
			writeError(w, http.StatusInternalServerError, "RENEW_FAILED", err.Error())
			return
		}
	}
	writeJSON(w, http.StatusOK, map[string]string{"expiresAt": t.Format(time.RFC3339Nano)})
}

func (f *Fake) endpoint(w http.ResponseWriter, r *http.Request) {
	port, err := strconv.Atoi(r.PathValue("port"))
	if err != nil || port < 1 || port > 65535 {
		writeError(w, http.StatusBadRequest, "INVALID_PARAMETER", "port must be from 1 to 65535")
		return
	}
	if r.URL.Query().Get("use_server_proxy") == "true" && r.URL.Query().Get("expires") != "" {
		writeError(w, http.StatusBadRequest, "INVALID_PARAMETER", "use_server_proxy cannot be combined with expires; signed endpoints require the gateway route.")
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.lookup(w, r.PathValue("id"))
	if s == nil {
		return
	}
	route := "/port/"
	if r.URL.Query().Get("use_server_proxy") == "true" {
		route = "/proxy/"
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"endpoint": r.Host + "/sandboxes/" + s.id + route + strconv.Itoa(port),
		"headers":  map[string]string{execdTokenHeader: s.token},
	})
}

// snapStateLocked settles a snapshot whose capture ended: Ready unless it
// is held in Creating.
func (f *Fake) snapStateLocked(s *snap) string {
	if s.state == "Creating" && s.captured && f.stuck[""] == 0 && f.stuck[s.sandboxID] == 0 {
		s.state, s.reason, s.msg, s.transition = "Ready", "snapshot_ready", "Snapshot is ready.", time.Now().UTC()
	}
	return s.state
}

func (s *snap) json() map[string]any {
	status := map[string]any{"state": s.state, "lastTransitionAt": s.transition.Format(time.RFC3339Nano)}
	if s.reason != "" {
		status["reason"] = s.reason
	}
	if s.msg != "" {
		status["message"] = s.msg
	}
	m := map[string]any{"id": s.id, "sandboxId": s.sandboxID, "status": status, "createdAt": s.created.Format(time.RFC3339Nano)}
	if s.name != "" {
		m["name"] = s.name
	}
	return m
}

func (f *Fake) createSnapshot(w http.ResponseWriter, r *http.Request) {
	var req snapshotRequest
	if err := readJSON(r, &req, true); err != nil && !errors.Is(err, io.EOF) {
		writeError(w, http.StatusBadRequest, "INVALID_PARAMETER", "invalid request body: "+err.Error())
		return
	}
	if req.Name != nil && *req.Name == "" {
		writeError(w, http.StatusBadRequest, "INVALID_PARAMETER", "name must not be empty")
		return
	}
	f.mu.Lock()
	s := f.lookup(w, r.PathValue("id"))
	if s == nil {
		f.mu.Unlock()
		return
	}
	if s.state != "Running" {
		f.mu.Unlock()
		writeError(w, http.StatusConflict, "SANDBOX_NOT_RUNNING", fmt.Sprintf("Sandbox %s is %s; snapshots need a Running sandbox.", s.id, s.state))
		return
	}
	now := time.Now().UTC()
	sn := &snap{id: newUUID(), sandboxID: s.id, state: "Creating", reason: "snapshot_accepted", msg: "Snapshot creation accepted.", transition: now, created: now}
	if req.Name != nil {
		sn.name = *req.Name
	}
	f.snapshots[sn.id] = sn
	backend := s.backend
	f.wg.Add(1)
	resp := sn.json()
	f.mu.Unlock()
	go func() {
		defer f.wg.Done()
		info, err := f.o.Backend.Snapshot(context.Background(), backend, sn.name)
		f.mu.Lock()
		defer f.mu.Unlock()
		if err != nil {
			sn.state, sn.reason, sn.msg, sn.transition = "Failed", "snapshot_capture_failed", err.Error(), time.Now().UTC()
			return
		}
		sn.backend, sn.captured = info.ID, true
	}()
	w.Header().Set("Location", "/v1/snapshots/"+sn.id)
	writeJSON(w, http.StatusAccepted, resp)
}

func (f *Fake) getSnapshot(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := r.PathValue("sid")
	s := f.snapshots[id]
	if s == nil {
		writeError(w, http.StatusNotFound, "SNAPSHOT::NOT_FOUND", fmt.Sprintf("Snapshot %s not found", id))
		return
	}
	f.snapStateLocked(s)
	writeJSON(w, http.StatusOK, s.json())
}

func (f *Fake) listSnapshots(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	pg, size, ok := page(w, q)
	if !ok {
		return
	}
	f.mu.Lock()
	var match []*snap
	for _, s := range f.snapshots {
		f.snapStateLocked(s)
		if src := q.Get("sandboxId"); src != "" && s.sandboxID != src {
			continue
		}
		if st := q["state"]; len(st) > 0 && !contains(st, s.state) {
			continue
		}
		match = append(match, s)
	}
	body := listPage(match, pg, size, func(s *snap) (time.Time, string) { return s.created, s.id }, (*snap).json)
	f.mu.Unlock()
	writeJSON(w, http.StatusOK, body)
}

func (f *Fake) deleteSnapshot(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("sid")
	f.mu.Lock()
	s := f.snapshots[id]
	if s == nil {
		f.mu.Unlock()
		writeError(w, http.StatusNotFound, "SNAPSHOT::NOT_FOUND", fmt.Sprintf("Snapshot %s not found", id))
		return
	}
	if f.snapStateLocked(s) == "Creating" {
		f.mu.Unlock()
		writeError(w, http.StatusConflict, "SNAPSHOT::INVALID_STATE", fmt.Sprintf("Snapshot %s is still being created and cannot be deleted", id))
		return
	}
	delete(f.snapshots, id)
	backend := s.backend
	f.mu.Unlock()
	if backend != "" {
		if err := f.o.Backend.DeleteSnapshot(r.Context(), backend); err != nil {
			writeError(w, http.StatusInternalServerError, "SNAPSHOT_DELETE_FAILED", err.Error())
			return
		}
	}
	w.WriteHeader(http.StatusNoContent)
}
