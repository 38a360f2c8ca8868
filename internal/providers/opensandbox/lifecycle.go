package opensandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/sandbox"
)

// serverTimeout is the timeout (seconds) to create a sandbox with so that
// the server's expiry falls serverMargin after stasis's; the API's minimum
// is 60.
func (p *Provider) serverTimeout(expiry time.Time) int {
	s := math.Ceil((expiry.Sub(p.o.Now()) + serverMargin).Seconds())
	return max(60, int(s))
}

// Create makes a sandbox from an image (Spec.Image, else Options.Image)
// and returns once it runs and its execd answers, with the work directory
// made, Spec.Root uploaded into it and Spec.Files written.
func (p *Provider) Create(ctx context.Context, spec sandbox.Spec) (sandbox.Info, error) {
	if spec.Expiry.IsZero() || !spec.Expiry.After(p.o.Now()) {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "the expiry %s is not in the future", spec.Expiry.Format(time.RFC3339))
	}
	md, err := encodeLabels(spec.Labels, spec.Expiry)
	if err != nil {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "%v", err)
	}
	var rootTar func() (io.ReadCloser, error)
	if spec.Root != "" {
		if rootTar, err = tarDir(spec.Root); err != nil {
			return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "create", "", "seed directory: %v", err)
		}
	}
	image := spec.Image
	if image == "" {
		image = p.o.Image
	}
	req := createSandboxRequest{
		Image: &imageSpec{URI: image}, Entrypoint: p.o.Entrypoint, Timeout: p.serverTimeout(spec.Expiry),
		ResourceLimits: p.o.Resources, Env: spec.Env, Metadata: md,
	}
	s, err := p.createAndWait(ctx, "create", req)
	if err != nil {
		return sandbox.Info{}, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = p.Delete(context.WithoutCancel(ctx), s.ID)
		}
	}()
	if err := p.mkdirWork(ctx, s.ID); err != nil {
		return sandbox.Info{}, err
	}
	if rootTar != nil {
		r, err := rootTar()
		if err != nil {
			return sandbox.Info{}, fmt.Errorf("create %s: seed from %s: %w", what(s.ID), spec.Root, err)
		}
		err = p.Upload(ctx, s.ID, p.o.WorkDir, r)
		if cerr := r.Close(); err == nil && cerr != nil {
			err = cerr
		}
		if err != nil {
			return sandbox.Info{}, fmt.Errorf("create %s: seed %s from %s: %w", what(s.ID), p.o.WorkDir, spec.Root, err)
		}
	}
	paths := make([]string, 0, len(spec.Files))
	for path := range spec.Files {
		paths = append(paths, path)
	}
	sort.Strings(paths)
	for _, path := range paths {
		if err := p.WriteFile(ctx, s.ID, path, spec.Files[path], 0o644); err != nil {
			return sandbox.Info{}, fmt.Errorf("create %s: write %s: %w", what(s.ID), path, err)
		}
	}
	ok = true
	return p.info(s), nil
}

// mkdirWork makes the work directory (an image need not have it).
func (p *Provider) mkdirWork(ctx context.Context, id string) error {
	var errb strings.Builder
	res, err := p.Exec(ctx, id, sandbox.ExecRequest{Argv: []string{"mkdir", "-p", "--", p.o.WorkDir}, Cwd: "/", Stderr: &errb, Timeout: time.Minute})
	if err != nil {
		return fmt.Errorf("create %s: make %s: %w", what(id), p.o.WorkDir, err)
	}
	if res.ExitCode != 0 {
		return fmt.Errorf("create %s: make %s: mkdir exited %d: %s", what(id), p.o.WorkDir, res.ExitCode, strings.TrimSpace(errb.String()))
	}
	return nil
}

// createAndWait creates a sandbox and waits until it runs and its execd
// answers; a sandbox that fails to get there is deleted.
func (p *Provider) createAndWait(ctx context.Context, op string, req createSandboxRequest) (apiSandbox, error) {
	var s apiSandbox
	whatNew := "sandbox"
	if req.SnapshotID != "" {
		whatNew = "sandbox from " + snapWhat(req.SnapshotID)
	}
	// Not idempotent: retried only after a 429, which made nothing.
	err := p.do(ctx, call{method: http.MethodPost, url: p.base + "/sandboxes", body: jsonBody(req), contentType: "application/json", apiKey: true}, &s)
	if err != nil {
		if req.SnapshotID != "" && isStatus(err, http.StatusNotFound) {
			return s, sandbox.Errorf(errdefs.ErrNotFound, op, snapWhat(req.SnapshotID), "the OpenSandbox server has no such snapshot (deleted, or never made)")
		}
		return s, p.fail(op, whatNew, err)
	}
	if s.ID == "" {
		return s, fmt.Errorf("%s %s: the server's answer names no sandbox", op, whatNew)
	}
	s, err = p.waitState(ctx, op, s.ID, stateRunning, statePending)
	var ep *endpoint
	if err == nil {
		ep, err = p.waitExecd(ctx, op, s.ID)
	}
	if err != nil {
		if derr := p.deleteSandbox(context.WithoutCancel(ctx), s.ID); derr != nil {
			err = fmt.Errorf("%w (and deleting it failed: %v; delete %s by hand)", err, derr, s.ID)
		}
		p.forget(s.ID)
		return s, err
	}
	p.remember(s)
	p.setEndpoint(s.ID, ep)
	return s, nil
}

// waitState polls a sandbox until it is in state want, while it is in one
// of the passing states; bounded by ReadyTimeout.
func (p *Provider) waitState(ctx context.Context, op, id, want string, passing ...string) (apiSandbox, error) {
	deadline := p.o.Now().Add(p.o.ReadyTimeout)
	for {
		s, err := p.getSandbox(ctx, op, id)
		if err != nil {
			return s, err
		}
		if s.ID == "" {
			s.ID = id
		}
		st := s.Status.State
		if st == want {
			return s, nil
		}
		if !contains(passing, st) && !contains(unknownStates, st) {
			why := s.Status.Reason
			if s.Status.Message != "" {
				why += ": " + s.Status.Message
			}
			return s, sandbox.Errorf(errdefs.ErrConflict, op, what(id), "it went %s (%s) instead of %s", st, why, want)
		}
		if p.o.Now().After(deadline) {
			return s, sandbox.Errorf(errdefs.ErrTimeout, op, what(id), "still %s after %s, waiting for %s; check the OpenSandbox server", st, p.o.ReadyTimeout, want)
		}
		if err := p.sleep(ctx, p.o.PollInterval); err != nil {
			return s, fmt.Errorf("%s %s: waiting for %s: %w", op, what(id), want, err)
		}
	}
}

// unknownStates: an empty state (a server that has not filled it in yet)
// is waited through like a passing one. The specification asks clients to
// bear new state names, but a state it does not name is not waited for.
var unknownStates = []string{""}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// Get reads a sandbox. One past stasis's expiry is deleted, and Get
// returns its Info (State "expired") with an error matching ErrExpired.
func (p *Provider) Get(ctx context.Context, id string) (sandbox.Info, error) {
	s, err := p.getSandbox(ctx, "get", id)
	if err != nil {
		return sandbox.Info{}, err
	}
	k := p.remember(s)
	info := p.info(s)
	if err := p.check(ctx, "get", s, k.expiry); err != nil {
		if errors.Is(err, errdefs.ErrExpired) {
			info.State = sandbox.StateExpired
			return info, err
		}
		if errors.Is(err, errdefs.ErrNotFound) {
			return sandbox.Info{}, err
		}
	}
	// Paused, Pending, Failed: Info says so in State.
	return info, nil
}

// List returns stasis's sandboxes (those carrying its expiry entry) with
// every given label, through the API's metadata filter and pagination.
// Sandboxes past stasis's expiry are listed with State "expired".
func (p *Provider) List(ctx context.Context, labels map[string]string) ([]sandbox.Info, error) {
	md, err := encodeLabels(labels, time.Time{})
	if err != nil {
		return nil, sandbox.Errorf(errdefs.ErrInvalid, "list", "", "%v", err)
	}
	filter := url.Values{}
	for k, v := range md {
		filter.Set(k, v)
	}
	var out []sandbox.Info
	for page := 1; ; page++ {
		q := url.Values{"page": {strconv.Itoa(page)}, "pageSize": {strconv.Itoa(p.o.PageSize)}}
		if len(filter) > 0 {
			q.Set("metadata", filter.Encode())
		}
		var r listSandboxesResponse
		if err := p.do(ctx, call{method: http.MethodGet, url: p.base + "/sandboxes", query: q, apiKey: true, idempotent: true, retry500: true}, &r); err != nil {
			return nil, p.fail("list", "sandboxes", err)
		}
		for _, s := range r.Items {
			if _, ok := s.Metadata[expiryKey]; !ok {
				continue // not stasis's
			}
			if s.Status.State == stateStopping || s.Status.State == stateTerminated {
				continue
			}
			info := p.info(s)
			match := true
			for k, v := range labels { // the server filtered already; a server that ignores the filter must not widen the answer
				if info.Labels[k] != v {
					match = false
				}
			}
			if match {
				out = append(out, info)
			}
		}
		if !r.Pagination.HasNextPage || len(r.Items) == 0 || page >= 10000 {
			break
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

// CollectBlobs is the contract's: the OpenSandbox server keeps the
// snapshots' data, and a snapshot's deletion frees it there; nothing is
// stored here.
func (p *Provider) CollectBlobs(context.Context) (int, int64, error) { return 0, 0, nil }

// GC deletes stasis's sandboxes that are past stasis's expiry (those no
// process's timer has deleted: their process ended) and returns their ids.
func (p *Provider) GC(ctx context.Context) ([]string, error) {
	list, err := p.List(ctx, nil)
	if err != nil {
		return nil, err
	}
	var reaped []string
	for _, in := range list {
		if in.State != sandbox.StateExpired {
			continue
		}
		p.mu.Lock()
		p.expired[in.ID] = in.Expiry
		p.mu.Unlock()
		if err := p.Delete(ctx, in.ID); err != nil {
			return reaped, err
		}
		reaped = append(reaped, in.ID)
	}
	return reaped, nil
}

// Delete deletes a sandbox; one already gone is no error.
func (p *Provider) Delete(ctx context.Context, id string) error {
	if id == "" || strings.ContainsAny(id, "/?#") {
		return sandbox.Errorf(errdefs.ErrNotFound, "delete", what(id), "not an OpenSandbox sandbox id")
	}
	p.forget(id)
	return p.deleteSandbox(ctx, id)
}

func (p *Provider) deleteSandbox(ctx context.Context, id string) error {
	err := p.do(ctx, call{method: http.MethodDelete, url: p.base + "/sandboxes/" + url.PathEscape(id), apiKey: true, idempotent: true, retry500: true}, nil)
	if err == nil || isStatus(err, http.StatusNotFound) {
		return nil
	}
	return p.fail("delete", what(id), err)
}

// SetExpiry moves stasis's absolute expiry, earlier or later: it is kept in
// the sandbox's metadata, and the server's own expiry is renewed (to t plus
// a margin) when t passes it. The server's expiry never moves earlier.
func (p *Provider) SetExpiry(ctx context.Context, id string, t time.Time) error {
	k, err := p.liveAny(ctx, "set-expiry", id)
	if err != nil {
		return err
	}
	if !t.After(p.o.Now()) {
		return sandbox.Errorf(errdefs.ErrInvalid, "set-expiry", what(id), "the expiry %s is not in the future; delete the sandbox instead", t.Format(time.RFC3339))
	}
	serverExpiry := k.serverExpiry
	if !serverExpiry.IsZero() && t.Add(serverMargin).After(serverExpiry) {
		want := t.Add(serverMargin).UTC()
		var r struct {
			ExpiresAt apiTime `json:"expiresAt"`
		}
		err := p.do(ctx, call{method: http.MethodPost, url: p.base + "/sandboxes/" + url.PathEscape(id) + "/renew-expiration",
			body: jsonBody(renewExpirationRequest{ExpiresAt: apiTime{want}}), contentType: "application/json", apiKey: true, idempotent: true, retry500: true}, &r)
		if err != nil {
			if isStatus(err, http.StatusNotFound) {
				p.forget(id)
			}
			return p.fail("set-expiry", what(id), err)
		}
		serverExpiry = want
		if !r.ExpiresAt.IsZero() {
			serverExpiry = r.ExpiresAt.UTC()
		}
	}
	var s apiSandbox
	err = p.do(ctx, call{method: http.MethodPatch, url: p.base + "/sandboxes/" + url.PathEscape(id) + "/metadata",
		body: jsonBody(map[string]string{expiryKey: expiryValue(t)}), contentType: "application/json", apiKey: true, idempotent: true, retry500: true}, &s)
	if err != nil {
		if isStatus(err, http.StatusNotFound) {
			p.forget(id)
		}
		return p.fail("set-expiry", what(id), err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if k := p.known[id]; k != nil {
		k.expiry, k.serverExpiry = t.UTC(), serverExpiry
		p.armLocked(id, k)
	}
	return nil
}

// liveAny is live for operations that any state but gone or expired
// allows (a paused sandbox's expiry can move).
func (p *Provider) liveAny(ctx context.Context, op, id string) (known, error) {
	k, err := p.live(ctx, op, id)
	if errors.Is(err, errdefs.ErrConflict) {
		return k, nil
	}
	return k, err
}

// Pause pauses a running sandbox and waits until it is Paused (through
// Pausing). Pausing one already paused is no error.
func (p *Provider) Pause(ctx context.Context, id string) error {
	return p.transition(ctx, "pause", id, statePaused, statePausing)
}

// Resume resumes a paused sandbox and waits until it runs again (through
// Resuming) and its execd answers.
func (p *Provider) Resume(ctx context.Context, id string) error {
	if err := p.transition(ctx, "resume", id, stateRunning, stateResuming); err != nil {
		return err
	}
	ep, err := p.waitExecd(ctx, "resume", id)
	if err != nil {
		return err
	}
	p.setEndpoint(id, ep)
	return nil
}

func (p *Provider) transition(ctx context.Context, op, id, want, passing string) error {
	if _, err := p.liveAny(ctx, op, id); err != nil {
		return err
	}
	p.forget(id) // the state changes, and a resumed sandbox may have a new endpoint
	err := p.do(ctx, call{method: http.MethodPost, url: p.base + "/sandboxes/" + url.PathEscape(id) + "/" + op, apiKey: true, idempotent: true, retry500: true}, nil)
	if isStatus(err, http.StatusConflict) {
		// Already there or on the way: the state says which.
		s, gerr := p.getSandbox(ctx, op, id)
		if gerr != nil {
			return gerr
		}
		if s.Status.State != want && s.Status.State != passing {
			return p.fail(op, what(id), err)
		}
	} else if err != nil {
		return p.fail(op, what(id), err)
	}
	s, err := p.waitState(ctx, op, id, want, passing, stateRunning, statePaused, statePausing, stateResuming)
	if err != nil {
		return err
	}
	p.remember(s)
	return nil
}

// Snapshot asks the server for a snapshot and polls it from Creating until
// Ready (or Failed), bounded by SnapshotTimeout.
func (p *Provider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	if _, err := p.live(ctx, "snapshot", id); err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	var s apiSnapshot
	err := p.do(ctx, call{method: http.MethodPost, url: p.base + "/sandboxes/" + url.PathEscape(id) + "/snapshots",
		body: jsonBody(createSnapshotRequest{Name: name}), contentType: "application/json", apiKey: true}, &s)
	if err != nil {
		if isStatus(err, http.StatusNotFound) {
			return sandbox.SnapshotInfo{}, p.vanished(ctx, "snapshot", id, p.fail("snapshot", what(id), err))
		}
		return sandbox.SnapshotInfo{}, p.fail("snapshot", what(id), err)
	}
	if s.ID == "" {
		return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: the server's answer names no snapshot", what(id))
	}
	start := p.o.Now()
	for {
		switch s.Status.State {
		case snapReady:
			return p.snapInfo(s), nil
		case snapFailed:
			return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s of %s: the server reports it Failed (%s: %s); delete it and retry", s.ID, what(id), s.Status.Reason, s.Status.Message)
		case snapDeleting:
			return sandbox.SnapshotInfo{}, sandbox.Errorf(errdefs.ErrNotFound, "snapshot", snapWhat(s.ID), "it is being deleted while it was being made")
		}
		if p.o.Now().Sub(start) > p.o.SnapshotTimeout {
			return sandbox.SnapshotInfo{}, sandbox.Errorf(errdefs.ErrTimeout, "snapshot", snapWhat(s.ID)+" of "+what(id),
				"still %s after %s (%s); the server has not finished it: check the OpenSandbox server, and delete the snapshot once it leaves Creating (the server refuses to delete one in Creating)", s.Status.State, p.o.SnapshotTimeout, s.Status.Reason)
		}
		if err := p.sleep(ctx, p.o.PollInterval); err != nil {
			return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s of %s: waiting for it to be Ready: %w", s.ID, what(id), err)
		}
		next, err := p.getSnap(ctx, "snapshot", s.ID)
		if err != nil {
			return sandbox.SnapshotInfo{}, err
		}
		s = next
	}
}

func (p *Provider) snapInfo(s apiSnapshot) sandbox.SnapshotInfo {
	return sandbox.SnapshotInfo{ID: s.ID, Name: s.Name, Sandbox: s.SandboxID, Provider: Name, Created: s.CreatedAt.UTC()}
}

func (p *Provider) getSnap(ctx context.Context, op, id string) (apiSnapshot, error) {
	return get[apiSnapshot](ctx, p, op, "/snapshots/", "snapshot", id, snapWhat(id), func() error {
		return sandbox.Errorf(errdefs.ErrNotFound, op, snapWhat(id), "the OpenSandbox server has no such snapshot (deleted, or never made)")
	})
}

// GetSnapshot reads a snapshot; one not Ready is an ErrWrongState error
// (ErrNotFound while it is being deleted).
func (p *Provider) GetSnapshot(ctx context.Context, id string) (sandbox.SnapshotInfo, error) {
	s, err := p.getSnap(ctx, "get-snapshot", id)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	return p.snapInfo(s), p.snapReady("get-snapshot", s)
}

func (p *Provider) snapReady(op string, s apiSnapshot) error {
	switch s.Status.State {
	case snapReady:
		return nil
	case snapDeleting:
		return sandbox.Errorf(errdefs.ErrNotFound, op, snapWhat(s.ID), "it is being deleted")
	}
	return sandbox.Errorf(errdefs.ErrConflict, op, snapWhat(s.ID), "it is %s (%s %s), not Ready", s.Status.State, s.Status.Reason, s.Status.Message)
}

// DeleteSnapshot deletes a snapshot; one already gone is no error, one
// still in Creating is an ErrWrongState error.
func (p *Provider) DeleteSnapshot(ctx context.Context, id string) error {
	if id == "" || strings.ContainsAny(id, "/?#") {
		return sandbox.Errorf(errdefs.ErrNotFound, "delete-snapshot", snapWhat(id), "not an OpenSandbox snapshot id")
	}
	err := p.do(ctx, call{method: http.MethodDelete, url: p.base + "/snapshots/" + url.PathEscape(id), apiKey: true, idempotent: true, retry500: true}, nil)
	if err == nil || isStatus(err, http.StatusNotFound) {
		return nil
	}
	if isStatus(err, http.StatusConflict) {
		return sandbox.Errorf(errdefs.ErrConflict, "delete-snapshot", snapWhat(id), "the server refuses while it is still being made (Creating); retry once it is Ready or Failed")
	}
	return p.fail("delete-snapshot", snapWhat(id), err)
}

// Fork creates n sandboxes from a snapshot, at most ForkConcurrency at a
// time. All or nothing: if any fails, every sandbox made is deleted and
// the error names the one that failed.
func (p *Provider) Fork(ctx context.Context, snap string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	if n < 1 {
		return nil, sandbox.Errorf(errdefs.ErrInvalid, "fork", snapWhat(snap), "asked for %d sandboxes; at least 1", n)
	}
	if spec.Expiry.IsZero() || !spec.Expiry.After(p.o.Now()) {
		return nil, sandbox.Errorf(errdefs.ErrInvalid, "fork", snapWhat(snap), "the expiry %s is not in the future", spec.Expiry.Format(time.RFC3339))
	}
	md, err := encodeLabels(spec.Labels, spec.Expiry)
	if err != nil {
		return nil, sandbox.Errorf(errdefs.ErrInvalid, "fork", snapWhat(snap), "%v", err)
	}
	s, err := p.getSnap(ctx, "fork", snap)
	if err != nil {
		return nil, err
	}
	if err := p.snapReady("fork", s); err != nil {
		return nil, err
	}
	results := p.forkEach(ctx, snap, n, spec, md)
	failed, made := -1, 0
	for i, r := range results {
		if r.err != nil && (failed < 0 || results[failed].err == errStopped && r.err != errStopped) {
			failed = i
		}
		if r.err == nil {
			made++
		}
	}
	if failed < 0 {
		out := make([]sandbox.Info, n)
		for i, r := range results {
			out[i] = p.info(r.s)
		}
		return out, nil
	}
	// All or nothing.
	var leftErr []string
	for _, r := range results {
		if r.err == nil {
			if err := p.Delete(context.WithoutCancel(ctx), r.s.ID); err != nil {
				leftErr = append(leftErr, fmt.Sprintf("%s (%v)", r.s.ID, err))
			}
		}
	}
	msg := fmt.Sprintf("fork %s ×%d: sandbox %d of %d failed, so none was kept (%d made and deleted): %v", snapWhat(snap), n, failed+1, n, made, results[failed].err)
	if len(leftErr) > 0 {
		msg += "; deleting these failed, delete them by hand: " + strings.Join(leftErr, ", ")
	}
	return nil, &forkError{msg: msg, err: results[failed].err}
}

// forkResult is one sandbox of a fork: made, or why not.
type forkResult struct {
	s   apiSandbox
	err error
}

// forkEach creates the n sandboxes of a fork, at most ForkConcurrency at
// a time; after a failure no more are started (errStopped).
func (p *Provider) forkEach(ctx context.Context, snap string, n int, spec sandbox.ForkSpec, md map[string]string) []forkResult {
	results := make([]forkResult, n)
	// After a failure no more sandboxes are started; those under way
	// finish (a create cut off mid-request could leave one unknown here)
	// and are deleted with the rest.
	stop := make(chan struct{})
	var once sync.Once
	halt := func() { once.Do(func() { close(stop) }) }
	sem := make(chan struct{}, p.o.ForkConcurrency)
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case sem <- struct{}{}:
			case <-stop:
				results[i].err = errStopped
				return
			}
			defer func() { <-sem }()
			select {
			case <-stop:
				results[i].err = errStopped
				return
			default:
			}
			if p.o.ForkHook != nil {
				if err := p.o.ForkHook(snap, i); err != nil {
					results[i].err = err
					halt()
					return
				}
			}
			req := createSandboxRequest{SnapshotID: snap, Timeout: p.serverTimeout(spec.Expiry), ResourceLimits: p.o.Resources, Metadata: md}
			s, err := p.createAndWait(ctx, "fork", req)
			results[i] = forkResult{s, err}
			if err != nil {
				halt()
			}
		}()
	}
	wg.Wait()
	return results
}

// errStopped marks the sandboxes of a fork not started after another failed.
var errStopped = errors.New("not started: another sandbox of the fork failed")

// forkError says which sandbox of a fork failed; it matches what that
// failure matches.
type forkError struct {
	msg string
	err error
}

func (e *forkError) Error() string { return e.msg }
func (e *forkError) Unwrap() error { return e.err }
