// Package opensandbox is the sandbox provider for OpenSandbox servers: a
// client of the OpenSandbox Lifecycle API (sandboxes, snapshots, expiry,
// pause and resume, endpoints) and of execd, the agent in every sandbox
// (commands with streamed output, files), mapped onto sandbox.Provider.
//
// It owns the mapping, not the service: what stasis asks of a sandbox
// (argv, stdin, exact output, exit codes, tar streams, an absolute expiry
// that may move earlier) is built from what the APIs give.
//
//   - Exec runs argv through execd's POST /command in a small shell
//     wrapper: stdin, when given, is uploaded to a file first; the wrapper
//     prints an end marker with the exit code on stdout and stderr, which
//     restores the output exactly as written (execd streams it as lines
//     without terminators) and the exit code. A timeout is sent to execd,
//     which kills the command, and enforced here too (interrupting the
//     command). Background commands start under setsid and report their
//     PID; their output goes to LogPath.
//   - Files go through execd's upload and download; Upload and Download of
//     tar streams move the tar as a file and run tar in the sandbox.
//   - Expiry: stasis keeps the absolute expiry in the sandbox's metadata
//     (stasis.internal/expiry-ms). The server's own expiry is renewed (with
//     absolute times) only ever later, to the stasis expiry plus a margin;
//     stasis deletes a sandbox itself once past its expiry — any call on it
//     does, and a timer per sandbox this process knows — and every call on
//     it then fails with errdefs.ErrExpired (or ErrNotFound from another
//     process).
//   - Labels are metadata, encoded to fit Kubernetes label rules (see
//     labels.go).
//   - Snapshots are the server's (a committed image); a fork creates N
//     sandboxes from the snapshot id, all or nothing. The reference server
//     keeps a snapshot after a restore (it resolves the id to an image), so
//     ConsumesSnapshotOnRestore is false unless Options say otherwise.
//
// Configuration: OPENSANDBOX_URL (the server, with or without /v1) and
// OPENSANDBOX_API_KEY; see FromEnv. The fake server for tests is
// internal/providers/opensandbox/osfake.
package opensandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
)

// Name is the provider's name in records and on the command line.
const Name = "opensandbox"

// ExecdPort is the port execd listens on inside every sandbox.
const ExecdPort = 44772

// Defaults.
const (
	DefaultImage = "debian:12"
	// serverMargin is how much later than stasis's expiry the server's own
	// expiry is set, so that stasis, not the server, ends the sandbox
	// (clocks differ).
	serverMargin = 30 * time.Second
)

// ErrUnauthorized matches errors of a server that refused the API key (401)
// or the operation (403).
var ErrUnauthorized = errors.New("unauthorized")

// Options configure the provider.
type Options struct {
	// URL is the OpenSandbox server (OPENSANDBOX_URL), with or without the
	// /v1 of the Lifecycle API. Required.
	URL string
	// APIKey is sent as OPEN-SANDBOX-API-KEY (OPENSANDBOX_API_KEY); empty
	// for a server without keys.
	APIKey string
	// Image is the image of sandboxes whose Spec names none
	// (OPENSANDBOX_IMAGE; default DefaultImage). It needs sh, tar, mkdir
	// and, for background commands, setsid.
	Image string
	// Entrypoint of sandboxes made from an image (default: tail -f
	// /dev/null, as the server uses for restores).
	Entrypoint []string
	// Resources are the resourceLimits of every sandbox (default cpu 1,
	// memory 2Gi).
	Resources map[string]string
	// WorkDir is the default working directory of commands, where
	// Spec.Root lands (default /work); Create makes it.
	WorkDir string
	// UseServerProxy reaches execd through the server's proxy route rather
	// than the sandbox's own endpoint.
	UseServerProxy bool
	// ConsumesSnapshotOnRestore: set it for a backend that deletes a
	// snapshot once a sandbox is restored from it. The reference server
	// does not (a snapshot is an image, restored any number of times).
	ConsumesSnapshotOnRestore bool
	// HTTPClient (default: a client of its own).
	HTTPClient *http.Client
	// MaxAttempts bounds the tries of one request (default 5); RetryBase
	// is the first backoff (default 250ms, doubling, at most 5s);
	// MaxRetryWait caps a Retry-After (default 30s).
	MaxAttempts  int
	RetryBase    time.Duration
	MaxRetryWait time.Duration
	// RequestTimeout bounds one request that is not a stream (default 60s).
	RequestTimeout time.Duration
	// PollInterval is how often state transitions are polled (default
	// 250ms). ReadyTimeout bounds a create, a pause or a resume (default
	// 5m); SnapshotTimeout bounds a snapshot's Creating (default 10m).
	PollInterval    time.Duration
	ReadyTimeout    time.Duration
	SnapshotTimeout time.Duration
	// CacheTTL is how long a sandbox's state, expiry and endpoint are
	// trusted before they are read again (default 30s).
	CacheTTL time.Duration
	// PageSize is the page size of listings (default 100; the API allows
	// 1 to 200).
	PageSize int
	// ForkConcurrency bounds the sandboxes a Fork creates at once
	// (default 8).
	ForkConcurrency int
	// ForkHook, when set, is called before each sandbox of a Fork is made,
	// with the snapshot and the sandbox's index; an error makes that one
	// fail (tests use it to prove a partial fork leaves nothing).
	ForkHook func(snapshot string, i int) error
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// FromEnv makes a provider from OPENSANDBOX_URL, OPENSANDBOX_API_KEY and
// (optional) OPENSANDBOX_IMAGE.
func FromEnv() (*Provider, error) {
	o := Options{URL: os.Getenv("OPENSANDBOX_URL"), APIKey: os.Getenv("OPENSANDBOX_API_KEY"), Image: os.Getenv("OPENSANDBOX_IMAGE")}
	if o.URL == "" {
		return nil, errors.New("opensandbox provider: set OPENSANDBOX_URL to the OpenSandbox server (and OPENSANDBOX_API_KEY to its API key)")
	}
	return New(o)
}

// Provider is the OpenSandbox provider. Close it to stop its expiry timers.
type Provider struct {
	o      Options
	base   string // the Lifecycle API, ending in /v1
	scheme string // for endpoints given without one
	hc     *http.Client

	mu      sync.Mutex
	known   map[string]*known
	expired map[string]time.Time // sandboxes this process deleted at their expiry
	closed  bool
}

// known is what this process knows of one sandbox.
type known struct {
	expiry       time.Time // stasis's
	serverExpiry time.Time
	state        string
	read         time.Time // when state and expiry were read
	ep           *endpoint
	timer        *time.Timer
}

// New makes a provider.
func New(o Options) (*Provider, error) {
	u, err := url.Parse(strings.TrimSpace(o.URL))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("opensandbox provider: OPENSANDBOX_URL %q is not an http(s) URL of the OpenSandbox server", o.URL)
	}
	base := strings.TrimRight(u.String(), "/")
	if !strings.HasSuffix(base, "/v1") {
		base += "/v1"
	}
	if o.Image == "" {
		o.Image = DefaultImage
	}
	if len(o.Entrypoint) == 0 {
		o.Entrypoint = []string{"tail", "-f", "/dev/null"}
	}
	if o.Resources == nil {
		o.Resources = map[string]string{"cpu": "1", "memory": "2Gi"}
	}
	if o.WorkDir == "" {
		o.WorkDir = "/work"
	}
	positiveOr(&o.MaxAttempts, 5)
	positiveOr(&o.RetryBase, 250*time.Millisecond)
	positiveOr(&o.MaxRetryWait, 30*time.Second)
	positiveOr(&o.RequestTimeout, 60*time.Second)
	positiveOr(&o.PollInterval, 250*time.Millisecond)
	positiveOr(&o.ReadyTimeout, 5*time.Minute)
	positiveOr(&o.SnapshotTimeout, 10*time.Minute)
	positiveOr(&o.CacheTTL, 30*time.Second)
	if o.PageSize <= 0 || o.PageSize > 200 {
		o.PageSize = 100
	}
	positiveOr(&o.ForkConcurrency, 8)
	if o.Now == nil {
		o.Now = time.Now
	}
	hc := o.HTTPClient
	if hc == nil {
		hc = &http.Client{}
	}
	return &Provider{o: o, base: base, scheme: u.Scheme, hc: hc, known: map[string]*known{}, expired: map[string]time.Time{}}, nil
}

// positiveOr sets *v to def unless it is above zero.
func positiveOr[T int | time.Duration](v *T, def T) {
	if *v <= 0 {
		*v = def
	}
}

func (p *Provider) Name() string { return Name }

func (p *Provider) Capabilities() sandbox.Capabilities {
	return sandbox.Capabilities{KeepsProcesses: false, SnapshotOutlivesSource: true, ConsumesSnapshotOnRestore: p.o.ConsumesSnapshotOnRestore}
}

// Close stops the expiry timers of this process (the sandboxes stay; the
// server ends them at its own expiry, and any later call on one past
// stasis's expiry deletes it).
func (p *Provider) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, k := range p.known {
		if k.timer != nil {
			k.timer.Stop()
			k.timer = nil
		}
	}
	return nil
}

func what(id string) string     { return "sandbox " + id }
func snapWhat(id string) string { return "snapshot " + id }

func newHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// fail turns an error of the API into one that says what went wrong with
// what, and what to do.
func (p *Provider) fail(op, what string, err error) error {
	if err == nil {
		return nil
	}
	var se *sandbox.Error
	if errors.As(err, &se) {
		return err
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%s %s: %w", op, what, err)
	}
	var te *transportError
	if errors.As(err, &te) {
		return fmt.Errorf("%s %s: no answer from the OpenSandbox server at %s after %d attempt(s): %v; check OPENSANDBOX_URL and that the server (or the sandbox's execd) is reachable", op, what, p.o.URL, te.Attempts, te.Err)
	}
	var he *httpError
	if !errors.As(err, &he) {
		return fmt.Errorf("%s %s: %w", op, what, err)
	}
	d := he.detail()
	switch he.Status {
	case http.StatusUnauthorized:
		return fmt.Errorf("%s %s: %w: the OpenSandbox server at %s refused the API key (%s); set OPENSANDBOX_API_KEY to a key it accepts", op, what, ErrUnauthorized, p.o.URL, d)
	case http.StatusForbidden:
		return fmt.Errorf("%s %s: %w: the OpenSandbox server at %s forbids this (%s); check the permissions of the key in OPENSANDBOX_API_KEY", op, what, ErrUnauthorized, p.o.URL, d)
	case http.StatusNotFound:
		return sandbox.Errorf(errdefs.ErrNotFound, op, what, "the server has no such thing: deleted, expired, or never made (%s)", d)
	case http.StatusConflict:
		return sandbox.Errorf(errdefs.ErrConflict, op, what, "the server refused it in the current state (%s)", d)
	case http.StatusBadRequest, http.StatusUnprocessableEntity:
		return sandbox.Errorf(errdefs.ErrInvalid, op, what, "the server refused the request (%s)", d)
	case http.StatusNotImplemented:
		return sandbox.Errorf(errdefs.ErrUnsupported, op, what, "this OpenSandbox server does not support it (%s)", d)
	case http.StatusTooManyRequests:
		return sandbox.Errorf(errdefs.ErrUnavailable, op, what, "the OpenSandbox server kept answering %s after %d attempts (Retry-After honoured); lower stasis's concurrency or raise the server's rate limit, then retry", d, he.Attempts)
	}
	if he.Status >= 500 {
		return sandbox.Errorf(errdefs.ErrUnavailable, op, what, "the OpenSandbox server failed: %s (after %d attempt(s)); check the server's logs, then retry", d, he.Attempts)
	}
	return fmt.Errorf("%s %s: unexpected answer from the OpenSandbox server: %s", op, what, d)
}

// descriptor is Info.Descriptor.
func (p *Provider) descriptor(id string) json.RawMessage {
	b, _ := json.Marshal(map[string]string{"id": id, "url": p.base})
	return b
}

// info maps a server sandbox to stasis's view.
func (p *Provider) info(s apiSandbox) sandbox.Info {
	labels, expiry := decodeLabels(s.Metadata)
	if expiry.IsZero() && s.ExpiresAt != nil {
		expiry = s.ExpiresAt.UTC()
	}
	state := sandbox.State(strings.ToLower(s.Status.State))
	if s.Status.State == stateRunning {
		state = sandbox.StateRunning
	}
	if !expiry.IsZero() && !p.o.Now().Before(expiry) {
		state = sandbox.StateExpired
	}
	return sandbox.Info{ID: s.ID, Provider: Name, State: state, Labels: labels, Created: s.CreatedAt.UTC(), Expiry: expiry, Source: s.SnapshotID, Descriptor: p.descriptor(s.ID)}
}

// remember records what was just read of a sandbox, arms its expiry timer
// and returns a copy of the record.
func (p *Provider) remember(s apiSandbox) known {
	_, expiry := decodeLabels(s.Metadata)
	p.mu.Lock()
	defer p.mu.Unlock()
	k := p.known[s.ID]
	if k == nil {
		k = &known{}
		p.known[s.ID] = k
	}
	k.state, k.read = s.Status.State, p.o.Now()
	k.serverExpiry = time.Time{}
	if s.ExpiresAt != nil {
		k.serverExpiry = s.ExpiresAt.UTC()
	}
	k.expiry = expiry
	if k.expiry.IsZero() {
		k.expiry = k.serverExpiry
	}
	p.armLocked(s.ID, k)
	return *k
}

// armLocked sets the timer that deletes the sandbox at its expiry.
func (p *Provider) armLocked(id string, k *known) {
	if p.closed || k.expiry.IsZero() {
		return
	}
	d := k.expiry.Sub(p.o.Now())
	if k.timer != nil {
		k.timer.Reset(d)
		return
	}
	k.timer = time.AfterFunc(d, func() { p.reap(id) })
}

// forget drops what this process knows of a sandbox.
func (p *Provider) forget(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if k := p.known[id]; k != nil && k.timer != nil {
		k.timer.Stop()
	}
	delete(p.known, id)
}

// reap runs at a sandbox's expiry: it reads the sandbox again (another
// process may have moved the expiry) and deletes it when it is past.
func (p *Provider) reap(id string) {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	_, _ = p.Get(ctx, id) // deletes it when it is past its expiry
}

// expire deletes a sandbox past its expiry and says so.
func (p *Provider) expire(ctx context.Context, op, id string, expiry time.Time) error {
	p.mu.Lock()
	p.expired[id] = expiry
	p.mu.Unlock()
	p.forget(id)
	if err := p.deleteSandbox(ctx, id); err != nil {
		return fmt.Errorf("%s %s: it expired at %s, and deleting it failed: %w", op, what(id), expiry.Format(time.RFC3339), err)
	}
	return p.expiredErr(op, id, expiry)
}

func (p *Provider) expiredErr(op, id string, expiry time.Time) error {
	return sandbox.Errorf(errdefs.ErrExpired, op, what(id), "it expired at %s and stasis deleted it; make a new one (or fork a snapshot)", expiry.Format(time.RFC3339))
}

// getSandbox reads a sandbox from the server.
func (p *Provider) getSandbox(ctx context.Context, op, id string) (apiSandbox, error) {
	return get[apiSandbox](ctx, p, op, "/sandboxes/", "sandbox", id, what(id), func() error {
		p.forget(id)
		p.mu.Lock()
		exp, ok := p.expired[id]
		p.mu.Unlock()
		if ok {
			return p.expiredErr(op, id, exp)
		}
		return sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "the OpenSandbox server has no such sandbox: deleted, expired, or never made; `stasis sandbox ls --provider opensandbox` lists them")
	})
}

// get reads the server's object at path+id, a kind (sandbox or snapshot)
// that name names in errors; notFound makes the error for a 404.
func get[T any](ctx context.Context, p *Provider, op, path, kind, id, name string, notFound func() error) (T, error) {
	var v T
	if id == "" || strings.ContainsAny(id, "/?#") {
		return v, sandbox.Errorf(errdefs.ErrNotFound, op, name, "not an OpenSandbox %s id", kind)
	}
	err := p.do(ctx, call{method: http.MethodGet, url: p.base + path + url.PathEscape(id), apiKey: true, idempotent: true, retry500: true}, &v)
	if isStatus(err, http.StatusNotFound) {
		return v, notFound()
	}
	if err != nil {
		return v, p.fail(op, name, err)
	}
	return v, nil
}

// live reads a sandbox (or trusts what was read lately) and checks that it
// runs and has not passed stasis's expiry, deleting it if it has.
func (p *Provider) live(ctx context.Context, op, id string) (known, error) {
	now := p.o.Now()
	p.mu.Lock()
	var k known
	kp := p.known[id]
	fresh := kp != nil && kp.state == stateRunning && now.Sub(kp.read) < p.o.CacheTTL && (kp.expiry.IsZero() || now.Before(kp.expiry))
	if fresh {
		k = *kp
	}
	p.mu.Unlock()
	if fresh {
		return k, nil
	}
	s, err := p.getSandbox(ctx, op, id)
	if err != nil {
		return k, err
	}
	k = p.remember(s)
	return k, p.check(ctx, op, s, k.expiry)
}

// check says whether a sandbox just read can be used.
func (p *Provider) check(ctx context.Context, op string, s apiSandbox, expiry time.Time) error {
	id := s.ID
	if !expiry.IsZero() && !p.o.Now().Before(expiry) {
		return p.expire(ctx, op, id, expiry)
	}
	st := s.Status
	why := st.Reason
	if st.Message != "" {
		why += ": " + st.Message
	}
	switch st.State {
	case stateRunning:
		return nil
	case statePaused, statePausing:
		return sandbox.Errorf(errdefs.ErrConflict, op, what(id), "it is %s; resume it first", st.State)
	case statePending, stateResuming:
		return sandbox.Errorf(errdefs.ErrConflict, op, what(id), "it is %s (not running yet); retry shortly", st.State)
	case stateStopping, stateTerminated:
		if st.Reason == "ttl_expiry" {
			return sandbox.Errorf(errdefs.ErrExpired, op, what(id), "the server ended it at its expiry (%s)", why)
		}
		return sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "it is %s (%s)", st.State, why)
	case stateFailed:
		return sandbox.Errorf(errdefs.ErrConflict, op, what(id), "the server reports it Failed (%s); delete it", why)
	}
	return sandbox.Errorf(errdefs.ErrConflict, op, what(id), "it is in state %q (%s), not Running", st.State, why)
}

// vanished classifies an error of execd: when the sandbox itself is gone
// (or no longer runs), that is the error; else the original one.
func (p *Provider) vanished(ctx context.Context, op, id string, orig error) error {
	p.mu.Lock()
	var expiry time.Time
	if k := p.known[id]; k != nil {
		expiry = k.expiry
	}
	p.mu.Unlock()
	p.forget(id)
	s, err := p.getSandbox(ctx, op, id)
	if errors.Is(err, errdefs.ErrNotFound) && !expiry.IsZero() && p.o.Now().Before(expiry) {
		return sandbox.Errorf(errdefs.ErrNotFound, op, what(id), "it disappeared from the OpenSandbox server before its expiry %s (deleted outside stasis, or lost by the server); its work is gone: restore it from a snapshot", expiry.Format(time.RFC3339))
	}
	if err != nil {
		return err
	}
	if err := p.check(ctx, op, s, p.remember(s).expiry); err != nil {
		return err
	}
	return orig
}
