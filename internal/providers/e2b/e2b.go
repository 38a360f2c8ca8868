// Package e2b is the sandbox provider for E2B (hosted Firecracker microVM
// sandboxes), a client of E2B's REST API and of envd, the daemon inside
// every E2B sandbox. It owns the mapping of sandbox.Provider onto those two
// APIs, the absolute expiry stasis keeps over E2B's relative timeouts, and
// the background reaper that deletes this provider's sandboxes once their
// lease has ended. Its wire types are in internal/wire, which names the
// specification commit they follow. The fake server its tests run against
// is in internal/providers/e2b/e2bfake, with wire types of its own; both are held to
// the golden bodies in testdata/golden, written from the specifications.
//
// Mapping:
//
//   - Create: POST /sandboxes from a template (Spec.Image, else
//     Options.Template), with the labels, the absolute expiry and this
//     provider's mark as metadata and Spec.Env as envVars; then the work
//     directory is made and Spec.Root and Spec.Files are written through
//     envd. Get: GET /sandboxes/{id}; List: GET /v2/sandboxes filtered by
//     metadata, every page; Delete: DELETE /sandboxes/{id}.
//   - Snapshot: POST /sandboxes/{id}/snapshots; the snapshot id is E2B's
//     snapshotID, a template id. Fork: N × POST /sandboxes from that template,
//     all or nothing. DeleteSnapshot: DELETE /templates/{id}. ForkSandbox
//     forks a live sandbox (snapshot, then fork).
//   - Pause: POST /sandboxes/{id}/pause with memory; Resume: POST
//     /sandboxes/{id}/connect. The clock policy after a resume is the
//     episode's: the in-sandbox binary's `clock set`, run through envd.
//   - Exec: envd's process service (Connect protocol, JSON): Start streams
//     the output and the exit; SendInput and CloseStdin feed stdin;
//     SendSignal kills at a timeout. ReadFile and WriteFile: envd's /files.
//     Upload: the tar stream is written to a file with /files and extracted
//     by tar in the sandbox; Download: tar in the sandbox streams to stdout.
//
// Expiry: stasis's expiry is absolute; E2B's timeout is relative ("N seconds
// from this request"). The provider computes the timeout from the absolute
// expiry at the moment of each call that sets it (create, connect, timeout),
// sends it again when the expiry moves (SetExpiry), and never sends one on
// a pause, a snapshot or a fork's source, so neither shifts the expiry; a
// fork's sandboxes get the expiry of the ForkSpec. The expiry is also kept
// in the sandbox's metadata (stasis.expiry, RFC 3339) so another process
// finds it. E2B metadata cannot change after creation: after SetExpiry, the
// running sandbox's endAt (which the provider keeps equal to the expiry,
// rounded up to the second) is the record another process reads, and this
// process remembers the exact time. A paused sandbox has no end time at
// E2B, so another process knows its expiry only from stasis.expiry: one
// moved by SetExpiry before the pause is known to the process that moved
// it alone (SetExpiry refuses a paused sandbox).
//
// stasis deletes a sandbox at its expiry even when the service has not: any
// call on a sandbox past its expiry deletes it and returns an error matching
// errdefs.ErrExpired, and the reaper that New starts (stopped by Close)
// deletes this provider's sandboxes past their expiry.
package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/e2b/internal/wire"
	"stasis/sandbox"
)

// Name is the provider's name in records and on the command line.
const Name = "e2b"

// Metadata keys the provider keeps on every sandbox it makes. Labels are
// stored as metadata too, under their own keys; these keys are reserved.
const (
	MetaProvider = "stasis.provider" // always Name: what the reaper may delete
	MetaExpiry   = "stasis.expiry"   // the absolute expiry at creation, RFC 3339
	MetaSource   = "stasis.source"   // the snapshot a fork came from
	MetaScope    = "stasis.scope"    // Options.Scope, when set
)

// StatePaused is the State Get and List report for a paused sandbox.
const StatePaused = wire.StatePaused

// Environment variables FromEnv reads: the first four as E2B's SDKs name
// them; EnvFileOnlySnapshots is stasis's own (Options.FileOnlySnapshots).
const (
	EnvAPIKey            = "E2B_API_KEY"
	EnvDomain            = "E2B_DOMAIN"
	EnvAPIURL            = "E2B_API_URL"
	EnvSandboxURL        = "E2B_SANDBOX_URL"
	EnvFileOnlySnapshots = "E2B_FILE_ONLY_SNAPSHOTS"
)

// DefaultDomain is E2B's domain when neither Options.Domain nor E2B_DOMAIN
// says otherwise.
const DefaultDomain = "e2b.app"

// Options configure the provider.
type Options struct {
	// APIKey is the team's API key (E2B_API_KEY), sent as X-API-Key.
	APIKey string
	// Domain is E2B's domain (E2B_DOMAIN; default DefaultDomain). The REST
	// API is at https://api.<domain> and a sandbox's envd at
	// https://<port>-<sandbox id>.<domain>, where the domain is the one
	// the API gives for the sandbox, or this one.
	Domain string
	// BaseURL overrides the REST API's address (E2B_API_URL).
	BaseURL string
	// EnvdURL, when set, is the one address of every sandbox's envd (the
	// SDKs' E2B_SANDBOX_URL): requests carry the E2b-Sandbox-Id and
	// E2b-Sandbox-Port headers, which route them (E2B's sandbox proxy and
	// the fake both route by them).
	EnvdURL string
	// EnvdPort is envd's port in the sandbox (default 49983).
	EnvdPort int
	// Template makes sandboxes when Spec.Image is empty (default "base").
	Template string
	// User runs commands and owns written files (default "root": stasis
	// makes and writes its work directory, /work, outside any user's home).
	User string
	// Workdir is the default working directory of commands (default
	// "/work"); Create makes it.
	Workdir string
	// FileOnlySnapshots says the service's snapshots keep files only, not
	// running processes: for E2B-compatible services without memory
	// snapshots (and for the fake, which is backed by such sandboxes).
	// Capabilities then reports keeps_processes false.
	FileOnlySnapshots bool
	// Scope, when set, is stored as stasis.scope metadata on every sandbox
	// made, and List and the reaper see only sandboxes of the same scope
	// (several stasis deployments sharing one team).
	Scope string
	// HTTPClient makes every request (default: a client of its own).
	HTTPClient *http.Client
	// RequestTimeout bounds one REST request (default 60s); a command's
	// output stream is bounded by its own timeout only.
	RequestTimeout time.Duration
	// Retries is how many times a request is tried again after a 429, a
	// 503, or (idempotent requests only) another 5xx or a transport error
	// (default 4; negative: none).
	Retries int
	// Backoff is the first wait before a retry, doubled each time up to
	// 10s (default 250ms); a Retry-After header overrides it.
	Backoff time.Duration
	// MaxRetryAfter is the longest Retry-After honoured (default 60s); a
	// longer one ends the call with an error saying when to try again.
	MaxRetryAfter time.Duration
	// ReapInterval is how often the reaper looks for sandboxes past their
	// expiry (default 30s; negative: no reaper).
	ReapInterval time.Duration
	// ForkConcurrency bounds the creates one Fork has in flight (default 8).
	ForkConcurrency int
	// ForkHook, when set, is called before each sandbox of a Fork is made,
	// with the snapshot and the sandbox's index; an error makes that one
	// fail (tests against the real service use it to prove a partial fork
	// leaves nothing).
	ForkHook func(snapshot string, i int) error
	// Now is the clock (tests); time.Now when nil.
	Now func() time.Time
	// Logf reports what the reaper deleted or failed to (default: silent).
	Logf func(format string, args ...any)
}

// FromEnv returns Options from the environment variables E2B's SDKs read:
// E2B_API_KEY, E2B_DOMAIN, E2B_API_URL and E2B_SANDBOX_URL; and
// E2B_FILE_ONLY_SNAPSHOTS, for an E2B-compatible service whose snapshots
// and pauses keep files only (FileOnlySnapshots), on when set to anything
// but empty, 0, false, off or no (a misspelt value errs the safe way:
// pauses that stop the harness and restores that relaunch it, never a
// restore counting on processes that are not there).
func FromEnv() Options {
	return Options{
		APIKey:            os.Getenv(EnvAPIKey),
		Domain:            os.Getenv(EnvDomain),
		BaseURL:           os.Getenv(EnvAPIURL),
		EnvdURL:           os.Getenv(EnvSandboxURL),
		FileOnlySnapshots: envOn(os.Getenv(EnvFileOnlySnapshots)),
	}
}

// envOn reads a switch from the environment: on unless empty, 0, false,
// off or no.
func envOn(v string) bool {
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "0", "false", "off", "no":
		return false
	}
	return true
}

// Provider is the E2B provider.
type Provider struct {
	o    Options
	base string // REST API base, no trailing slash
	hc   *http.Client

	mu    sync.Mutex
	sbs   map[string]sbState
	snaps map[string]sandbox.SnapshotInfo

	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
}

// sbState is what the provider knows of one sandbox.
type sbState struct {
	id       string
	template string
	labels   map[string]string
	created  time.Time
	expiry   time.Time // zero: not a stasis sandbox (no expiry of ours)
	source   string
	state    string // wire.StateRunning or wire.StatePaused
	// conn: token and domain are known (from create, connect or get).
	conn   bool
	token  string
	domain string
	// expired: stasis deleted it at its expiry (a tombstone).
	expired bool
}

// New makes a provider and starts its reaper; Close stops it.
func New(o Options) (*Provider, error) {
	if o.APIKey == "" {
		return nil, fmt.Errorf("e2b provider: no API key: set %s (or Options.APIKey) to your team's key", EnvAPIKey)
	}
	if o.Domain == "" {
		o.Domain = DefaultDomain
	}
	if o.BaseURL == "" {
		o.BaseURL = "https://api." + o.Domain
	}
	if _, err := url.Parse(o.BaseURL); err != nil {
		return nil, fmt.Errorf("e2b provider: API URL %q: %v (check %s)", o.BaseURL, err, EnvAPIURL)
	}
	if o.EnvdPort == 0 {
		o.EnvdPort = wire.EnvdPort
	}
	if o.Template == "" {
		o.Template = "base"
	}
	if o.User == "" {
		o.User = "root"
	}
	if o.Workdir == "" {
		o.Workdir = "/work"
	}
	if o.RequestTimeout == 0 {
		o.RequestTimeout = 60 * time.Second
	}
	if o.Retries == 0 {
		o.Retries = 4
	} else if o.Retries < 0 {
		o.Retries = 0
	}
	if o.Backoff == 0 {
		o.Backoff = 250 * time.Millisecond
	}
	if o.MaxRetryAfter == 0 {
		o.MaxRetryAfter = 60 * time.Second
	}
	if o.ReapInterval == 0 {
		o.ReapInterval = 30 * time.Second
	}
	if o.ForkConcurrency <= 0 {
		o.ForkConcurrency = 8
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	hc := o.HTTPClient
	if hc == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConnsPerHost = 64
		hc = &http.Client{Transport: tr}
	}
	p := &Provider{
		o: o, base: strings.TrimRight(o.BaseURL, "/"), hc: hc,
		sbs: map[string]sbState{}, snaps: map[string]sandbox.SnapshotInfo{},
		stop: make(chan struct{}), done: make(chan struct{}),
	}
	if o.ReapInterval > 0 {
		go p.reapLoop()
	} else {
		close(p.done)
	}
	return p, nil
}

// Close stops the reaper and waits for it. Sandboxes are left as they are.
func (p *Provider) Close() error {
	p.closeOnce.Do(func() { close(p.stop) })
	<-p.done
	return nil
}

func (p *Provider) Name() string { return Name }

func (p *Provider) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{KeepsProcesses: !p.o.FileOnlySnapshots, SnapshotOutlivesSource: true}
}

func (p *Provider) now() time.Time { return p.o.Now() }

func what(id string) string { return "sandbox " + id }

func snapWhat(id string) string { return "snapshot " + id }

// The sandbox cache.

func (p *Provider) lookup(id string) (sbState, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	st, ok := p.sbs[id]
	return st, ok
}

func (p *Provider) remember(st sbState) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sbs[st.id] = st
}

func (p *Provider) forget(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.sbs, id)
}

// update changes a cached sandbox, if it is cached.
func (p *Provider) update(id string, f func(*sbState)) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if st, ok := p.sbs[id]; ok {
		f(&st)
		p.sbs[id] = st
	}
}

// timeoutFor is E2B's relative timeout for an absolute expiry, computed
// now: whole seconds, rounded up so the service never ends a sandbox before
// its expiry.
func (p *Provider) timeoutFor(expiry time.Time) (int32, bool) {
	d := expiry.Sub(p.now())
	if d <= 0 {
		return 0, false
	}
	secs := math.Ceil(d.Seconds())
	if secs > math.MaxInt32 {
		secs = math.MaxInt32
	}
	return int32(secs), true
}

func (p *Provider) pastExpiry(st sbState) bool {
	return !st.expiry.IsZero() && !p.now().Before(st.expiry)
}

// labelsOf is a sandbox's metadata without the provider's own keys.
func labelsOf(meta map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range meta {
		switch k {
		case MetaProvider, MetaExpiry, MetaSource, MetaScope:
			continue
		}
		out[k] = v
	}
	return out
}

func checkLabels(op, what string, labels map[string]string) error {
	for k := range labels {
		switch k {
		case MetaProvider, MetaExpiry, MetaSource, MetaScope:
			return sandbox.Errorf(errdefs.ErrInvalid, op, what, "label %q is reserved for the provider's own metadata; use another key", k)
		}
		if k == "" {
			return sandbox.Errorf(errdefs.ErrInvalid, op, what, "a label has an empty key")
		}
	}
	return nil
}

// metadata is what a new sandbox carries: its labels, the provider's mark,
// its expiry, and its source snapshot when it is a fork.
func (p *Provider) metadata(labels map[string]string, expiry time.Time, source string) map[string]string {
	m := map[string]string{}
	for k, v := range labels {
		m[k] = v
	}
	m[MetaProvider] = Name
	m[MetaExpiry] = expiry.UTC().Format(time.RFC3339Nano)
	if source != "" {
		m[MetaSource] = source
	}
	if p.o.Scope != "" {
		m[MetaScope] = p.o.Scope
	}
	return m
}

// fromDetail is the state of a sandbox as the API describes it, with what
// this process knows better (the exact expiry it set) kept.
func (p *Provider) fromDetail(d wire.SandboxDetail, withConn bool) sbState {
	cached, have := p.lookup(d.SandboxID)
	st := sbState{
		id: d.SandboxID, template: d.TemplateID, labels: labelsOf(d.Metadata),
		created: d.StartedAt, source: d.Metadata[MetaSource], state: d.State,
	}
	if st.state == "" {
		st.state = wire.StateRunning
	}
	if withConn {
		st.conn, st.token = true, d.EnvdAccessToken
		if d.Domain != nil {
			st.domain = *d.Domain
		}
	} else if have && cached.conn {
		st.conn, st.token, st.domain = true, cached.token, cached.domain
	}
	switch meta, err := time.Parse(time.RFC3339Nano, d.Metadata[MetaExpiry]); {
	case have && !cached.expiry.IsZero():
		st.expiry = cached.expiry
	case err != nil:
		// Not made by stasis: no expiry of ours.
	case st.state == wire.StatePaused || d.EndAt.IsZero():
		// A paused sandbox has no end time (E2B reports the pause time).
		st.expiry = meta
	case d.EndAt.Sub(meta).Abs() <= 2*time.Second:
		st.expiry = meta
	default:
		// The expiry moved since creation (SetExpiry, maybe by another
		// process): the service's end time, which stasis keeps equal to
		// it, is the record.
		st.expiry = d.EndAt
	}
	if have && st.created.IsZero() {
		st.created = cached.created
	}
	return st
}

func (p *Provider) info(st sbState) sandbox.Info {
	state := sandbox.State(st.state)
	if st.expired {
		state = sandbox.StateExpired
	}
	desc, _ := json.Marshal(map[string]string{"id": st.id, "template": st.template, "domain": st.domain})
	return sandbox.Info{
		ID: st.id, Provider: Name, State: state, Labels: st.labels,
		Created: st.created, Expiry: st.expiry, Source: st.source, Descriptor: desc,
	}
}

func expiredErr(op string, st sbState) error {
	return sandbox.Errorf(errdefs.ErrExpired, op, what(st.id), "its lease ended at %s and stasis deleted it; fork a snapshot for a new sandbox", st.expiry.UTC().Format(time.RFC3339))
}

// expire deletes a sandbox past its expiry and returns the error matching
// ErrExpired that the call reports.
func (p *Provider) expire(ctx context.Context, op string, st sbState) (sbState, error) {
	if err := p.retireExpired(ctx, st); err != nil {
		return st, sandbox.Errorf(errdefs.ErrExpired, op, what(st.id), "its lease ended at %s, but deleting it failed (%v); the reaper tries again, or run `stasis sandbox rm %s`", st.expiry.UTC().Format(time.RFC3339), err, st.id)
	}
	st.expired = true
	return st, expiredErr(op, st)
}

// retireExpired deletes a sandbox past its expiry and leaves a tombstone, so
// later calls in this process say it expired.
func (p *Provider) retireExpired(ctx context.Context, st sbState) error {
	if err := p.kill(ctx, "delete", st.id); err != nil {
		return err
	}
	st.expired = true
	p.remember(st)
	return nil
}

// sandbox finds a sandbox and checks its lease: from this process's cache
// when it knows how to reach it (unless fresh), else from the API. A
// sandbox past its expiry is deleted and the error matches ErrExpired.
func (p *Provider) sandbox(ctx context.Context, op, id string, fresh bool) (sbState, error) {
	cached, have := p.lookup(id)
	if have && cached.expired {
		return cached, expiredErr(op, cached)
	}
	if have && p.pastExpiry(cached) {
		return p.expire(ctx, op, cached)
	}
	if have && cached.conn && !fresh {
		return cached, nil
	}
	var d wire.SandboxDetail
	_, _, err := p.rest(ctx, restCall{op: op, what: what(id), method: http.MethodGet, path: "/sandboxes/" + url.PathEscape(id), out: &d, idempotent: true})
	if errors.Is(err, errdefs.ErrNotFound) {
		if have {
			p.forget(id)
			if p.pastExpiry(cached) {
				return cached, expiredErr(op, cached)
			}
			if !cached.expiry.IsZero() {
				return cached, sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "E2B no longer has it, though its lease ran to %s: the service lost or killed it early (or it was deleted elsewhere); restore from a snapshot", cached.expiry.UTC().Format(time.RFC3339))
			}
		}
		return sbState{}, err
	}
	if err != nil {
		return sbState{}, err
	}
	st := p.fromDetail(d, true)
	if p.pastExpiry(st) {
		return p.expire(ctx, op, st)
	}
	p.remember(st)
	return st, nil
}

// running is sandbox, for operations that need the sandbox running.
func (p *Provider) running(ctx context.Context, op, id string) (sbState, error) {
	st, err := p.sandbox(ctx, op, id, false)
	if err != nil {
		return st, err
	}
	if st.state == wire.StatePaused {
		return st, sandbox.Errorf(errdefs.ErrConflict, op, what(id), "it is paused; resume it first (Resume, which also restores its timeout)")
	}
	return st, nil
}

// Create makes a sandbox from a template and returns once it runs, its
// work directory made and its files written.
func (p *Provider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	secs, ok := p.timeoutFor(spec.Expiry)
	if spec.Expiry.IsZero() || !ok {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "the expiry %s is not in the future", spec.Expiry.Format(time.RFC3339))
	}
	if err := checkLabels("create", "", spec.Labels); err != nil {
		return sandbox.Info{}, err
	}
	if spec.Root != "" {
		if fi, err := os.Stat(spec.Root); err != nil || !fi.IsDir() {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "seed directory %q is not a directory", spec.Root)
		}
	}
	template := spec.Image
	if template == "" {
		template = p.o.Template
	}
	yes, no := true, false
	body := wire.NewSandbox{
		TemplateID: template, Timeout: &secs, AutoPause: &no, Secure: &yes,
		Metadata: p.metadata(spec.Labels, spec.Expiry, ""), EnvVars: spec.Env,
	}
	var sb wire.Sandbox
	_, _, err := p.rest(ctx, restCall{op: "create", what: "template " + template, method: http.MethodPost, path: "/sandboxes", body: body, out: &sb})
	if errors.Is(err, errdefs.ErrNotFound) {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "template "+template, "E2B has no such template for this API key; build it, or name another (Spec.Image, Options.Template)")
	}
	if err != nil {
		return sandbox.Info{}, err
	}
	st := p.fromSandbox(sb, spec.Labels, spec.Expiry, "")
	p.remember(st)
	if err := p.setup(ctx, st.id, spec); err != nil {
		if derr := p.Delete(context.WithoutCancel(ctx), st.id); derr != nil {
			err = fmt.Errorf("%w (and deleting the half-made sandbox failed: %v; run `stasis sandbox rm %s`)", err, derr, st.id)
		}
		return sandbox.Info{}, err
	}
	return p.info(st), nil
}

// fromSandbox is the state of a sandbox just made or connected.
func (p *Provider) fromSandbox(sb wire.Sandbox, labels map[string]string, expiry time.Time, source string) sbState {
	st := sbState{
		id: sb.SandboxID, template: sb.TemplateID, labels: map[string]string{}, created: p.now().UTC(),
		expiry: expiry, source: source, state: wire.StateRunning, conn: true, token: sb.EnvdAccessToken,
	}
	for k, v := range labels {
		st.labels[k] = v
	}
	if sb.Domain != nil {
		st.domain = *sb.Domain
	}
	return st
}

// setup makes the work directory and writes Spec.Root and Spec.Files.
func (p *Provider) setup(ctx context.Context, id string, spec sandbox.Spec) error {
	var errb strings.Builder
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"mkdir", "-p", "--", p.o.Workdir}, Cwd: "/", Stderr: &errb})
	if err != nil {
		return fmt.Errorf("create %s: make the work directory %s: %w", what(id), p.o.Workdir, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("create %s: make the work directory %s: mkdir exited %d: %s", what(id), p.o.Workdir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	if spec.Root != "" {
		if err := p.uploadDir(ctx, id, spec.Root, p.o.Workdir); err != nil {
			return fmt.Errorf("create %s: seed %s from %s: %w", what(id), p.o.Workdir, spec.Root, err)
		}
	}
	paths := make([]string, 0, len(spec.Files))
	for path := range spec.Files {
		paths = append(paths, path)
	}
	sort.Strings(paths)
	for _, path := range paths {
		if err := p.WriteFile(ctx, id, path, spec.Files[path], 0o644); err != nil {
			return fmt.Errorf("create %s: write %s: %w", what(id), path, err)
		}
	}
	return nil
}

// Get finds a sandbox by id (asking the API every time). A sandbox past its
// expiry is deleted; Get then reports it with State "expired" and an error
// matching ErrExpired.
func (p *Provider) Get(ctx context.Context, id string) (sandbox.Info, error) {
	st, err := p.sandbox(ctx, "get", id, true)
	if errors.Is(err, errdefs.ErrExpired) {
		st.expired = true
		return p.info(st), err
	}
	if err != nil {
		return sandbox.Info{}, err
	}
	return p.info(st), nil
}

// List returns this provider's sandboxes (of its scope) that carry every
// given label, running and paused. Sandboxes past their expiry are deleted,
// not listed.
func (p *Provider) List(ctx context.Context, labels map[string]string) ([]sandbox.Info, error) {
	sts, _, err := p.list(ctx, labels)
	if err != nil {
		return nil, err
	}
	out := make([]sandbox.Info, 0, len(sts))
	for _, st := range sts {
		out = append(out, p.info(st))
	}
	return out, nil
}

// filterSafe says whether a metadata key or value survives E2B's parsing of
// the metadata filter (it unescapes the whole query, then splits it on & and
// =, then unescapes each part again); labels that do not are matched here
// only.
func filterSafe(s string) bool {
	return s != "" && !strings.ContainsAny(s, "&=%+")
}

// list lists the provider's sandboxes with the labels, deleting those past
// their expiry; it returns the others and the ids it deleted.
func (p *Provider) list(ctx context.Context, labels map[string]string) ([]sbState, []string, error) {
	filter := map[string]string{MetaProvider: Name}
	if p.o.Scope != "" {
		filter[MetaScope] = p.o.Scope
	}
	for k, v := range labels {
		if filterSafe(k) && filterSafe(v) {
			filter[k] = v
		}
	}
	keys := make([]string, 0, len(filter))
	for k := range filter {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, url.QueryEscape(k)+"="+url.QueryEscape(filter[k]))
	}
	q := url.Values{"metadata": {strings.Join(parts, "&")}, "state": {wire.StateRunning + "," + wire.StatePaused}, "limit": {"100"}}
	var all []wire.ListedSandbox
	for page := 0; ; page++ {
		var items []wire.ListedSandbox
		_, hdr, err := p.rest(ctx, restCall{op: "list", method: http.MethodGet, path: "/v2/sandboxes", query: q, out: &items, idempotent: true})
		if err != nil {
			return nil, nil, err
		}
		all = append(all, items...)
		next := hdr.Get(wire.NextTokenHeader)
		if next == "" || len(items) == 0 {
			break
		}
		if page > 10000 {
			return nil, nil, fmt.Errorf("list: E2B kept returning pages (over 10000); giving up")
		}
		q.Set("nextToken", next)
	}
	var out []sbState
	var reaped []string
	seen := map[string]bool{}
	for _, d := range all {
		if seen[d.SandboxID] || d.Metadata[MetaProvider] != Name || (p.o.Scope != "" && d.Metadata[MetaScope] != p.o.Scope) {
			continue
		}
		seen[d.SandboxID] = true
		match := true
		for k, v := range labels {
			if got, ok := d.Metadata[k]; !ok || got != v {
				match = false
			}
		}
		if !match {
			continue
		}
		st := p.fromDetail(d, false)
		if p.pastExpiry(st) {
			if err := p.retireExpired(ctx, st); err != nil {
				p.o.Logf("e2b: %s passed its expiry %s, but deleting it failed: %v", what(st.id), st.expiry.UTC().Format(time.RFC3339), err)
			} else {
				reaped = append(reaped, st.id)
			}
			continue
		}
		p.remember(st)
		out = append(out, st)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].created.Before(out[j].created) })
	return out, reaped, nil
}

// Delete kills a sandbox. Deleting one already gone returns nil.
func (p *Provider) Delete(ctx context.Context, id string) error {
	if err := p.kill(ctx, "delete", id); err != nil {
		return err
	}
	p.forget(id)
	return nil
}

// kill is DELETE /sandboxes/{id}, with a 404 counted as done.
func (p *Provider) kill(ctx context.Context, op, id string) error {
	_, _, err := p.rest(ctx, restCall{op: op, what: what(id), method: http.MethodDelete, path: "/sandboxes/" + url.PathEscape(id), idempotent: true})
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	return err
}

// SetExpiry moves the absolute expiry and sends E2B the timeout computed
// from it now. A paused sandbox is refused: E2B keeps no timeout for it;
// resume it first.
func (p *Provider) SetExpiry(ctx context.Context, id string, t time.Time) error {
	if _, err := p.running(ctx, "set-expiry", id); err != nil {
		return err
	}
	secs, ok := p.timeoutFor(t)
	if !ok {
		return sandbox.Errorf(errdefs.ErrInvalid, "set-expiry", what(id), "the expiry %s is not in the future; delete the sandbox instead", t.Format(time.RFC3339))
	}
	if err := p.setTimeout(ctx, "set-expiry", id, secs); err != nil {
		return err
	}
	p.update(id, func(st *sbState) { st.expiry = t })
	return nil
}

func (p *Provider) setTimeout(ctx context.Context, op, id string, secs int32) error {
	_, _, err := p.rest(ctx, restCall{op: op, what: what(id), method: http.MethodPost, path: "/sandboxes/" + url.PathEscape(id) + "/timeout", body: wire.Timeout{Timeout: secs}, idempotent: true})
	if errors.Is(err, errdefs.ErrNotFound) {
		p.forget(id)
	}
	return err
}

// Pause pauses a running sandbox with its memory (E2B keeps its processes);
// its expiry does not move, and no timeout runs while it is paused. Pausing
// a paused sandbox returns nil.
func (p *Provider) Pause(ctx context.Context, id string) error {
	if _, err := p.running(ctx, "pause", id); err != nil {
		if errors.Is(err, errdefs.ErrConflict) {
			return nil
		}
		return err
	}
	yes := true
	code, _, err := p.rest(ctx, restCall{op: "pause", what: what(id), method: http.MethodPost, path: "/sandboxes/" + url.PathEscape(id) + "/pause", body: wire.PauseRequest{Memory: &yes}, idempotent: true, accept: []int{http.StatusNoContent, http.StatusOK, http.StatusConflict}})
	if errors.Is(err, errdefs.ErrNotFound) {
		p.forget(id)
	}
	if err != nil {
		return err
	}
	_ = code // 409: already paused
	p.update(id, func(st *sbState) { st.state = wire.StatePaused })
	return nil
}

// Resume connects to a sandbox, resuming it when paused, and sets its
// timeout from the absolute expiry, computed now. E2B syncs the sandbox's
// clock as it resumes; stasis's own clock policy follows (the in-sandbox
// binary's `clock set`, through Exec).
func (p *Provider) Resume(ctx context.Context, id string) (sandbox.Info, error) {
	st, err := p.sandbox(ctx, "resume", id, true)
	if err != nil {
		return sandbox.Info{}, err
	}
	if st.expiry.IsZero() {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "resume", what(id), "it has no %s metadata, so stasis did not make it and knows no lease for it", MetaExpiry)
	}
	secs, ok := p.timeoutFor(st.expiry)
	if !ok {
		st, err = p.expire(ctx, "resume", st)
		return sandbox.Info{}, err
	}
	var sb wire.Sandbox
	code, _, err := p.rest(ctx, restCall{op: "resume", what: what(id), method: http.MethodPost, path: "/sandboxes/" + url.PathEscape(id) + "/connect", body: wire.Timeout{Timeout: secs}, out: &sb, idempotent: true})
	if errors.Is(err, errdefs.ErrNotFound) {
		p.forget(id)
	}
	if err != nil {
		return sandbox.Info{}, err
	}
	if code == http.StatusOK {
		// It was running: connect only ever extends a timeout, so set it
		// exactly.
		if secs, ok = p.timeoutFor(st.expiry); ok {
			if err := p.setTimeout(ctx, "resume", id, secs); err != nil {
				return sandbox.Info{}, err
			}
		}
	}
	st.state, st.conn, st.token = wire.StateRunning, true, sb.EnvdAccessToken
	if sb.Domain != nil {
		st.domain = *sb.Domain
	}
	p.remember(st)
	return p.info(st), nil
}
