package e2b

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/e2b/internal/wire"
	"stasis/sandbox"
)

// Snapshot saves a running sandbox as an E2B snapshot (a template that
// sandboxes are made from); the sandbox keeps running and keeps its
// expiry. The snapshot id is E2B's snapshotID. name is kept in the returned
// SnapshotInfo only: E2B would reuse the template of an earlier snapshot of
// the same name, and stasis's snapshot ids are never reused.
func (p *Provider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	if _, err := p.running(ctx, "snapshot", id); err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	var si wire.SnapshotInfo
	_, _, err := p.rest(ctx, restCall{op: "snapshot", what: what(id), method: http.MethodPost, path: "/sandboxes/" + url.PathEscape(id) + "/snapshots", body: wire.SnapshotRequest{}, out: &si})
	if errors.Is(err, errdefs.ErrNotFound) {
		p.forget(id)
	}
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	if si.SnapshotID == "" {
		return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: E2B answered without a snapshot id", what(id))
	}
	info := sandbox.SnapshotInfo{ID: si.SnapshotID, Name: name, Sandbox: id, Provider: Name, Created: p.now().UTC(), KeepsProcesses: !p.o.FileOnlySnapshots}
	p.mu.Lock()
	p.snaps[info.ID] = info
	p.mu.Unlock()
	return info, nil
}

// GetSnapshot finds a snapshot among the team's (GET /snapshots). E2B keeps
// no source or creation time for a snapshot; a snapshot made by this
// process is described fully.
func (p *Provider) GetSnapshot(ctx context.Context, snap string) (sandbox.SnapshotInfo, error) {
	q := url.Values{"name": {snap}, "limit": {"100"}}
	for page := 0; page < 10000; page++ {
		var items []wire.SnapshotInfo
		_, hdr, err := p.rest(ctx, restCall{op: "get-snapshot", what: snapWhat(snap), method: http.MethodGet, path: "/snapshots", query: q, out: &items, idempotent: true})
		if err != nil {
			return sandbox.SnapshotInfo{}, err
		}
		for _, it := range items {
			if sameSnapshot(it, snap) {
				p.mu.Lock()
				info, ok := p.snaps[snap]
				p.mu.Unlock()
				if !ok {
					info = sandbox.SnapshotInfo{ID: snap, Provider: Name, KeepsProcesses: !p.o.FileOnlySnapshots}
				}
				return info, nil
			}
		}
		next := hdr.Get(wire.NextTokenHeader)
		if next == "" || len(items) == 0 {
			break
		}
		q.Set("nextToken", next)
	}
	p.mu.Lock()
	delete(p.snaps, snap)
	p.mu.Unlock()
	return sandbox.SnapshotInfo{}, sandbox.Errorf(errdefs.ErrNotFound, "get-snapshot", snapWhat(snap), "E2B has no such snapshot for this API key (deleted, or never made)")
}

func sameSnapshot(it wire.SnapshotInfo, id string) bool {
	if it.SnapshotID == id {
		return true
	}
	for _, n := range it.Names {
		if n == id || n+":default" == id {
			return true
		}
	}
	return false
}

// Fork starts n sandboxes from a snapshot: n creates from its template, at
// most ForkConcurrency at once, each with the timeout computed from
// spec.Expiry at its own moment. All or nothing: when one fails, no more
// are started, those made are deleted, and the error says which failed.
func (p *Provider) Fork(ctx context.Context, snap string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	if n < 1 {
		return nil, sandbox.Errorf(errdefs.ErrInvalid, "fork", snapWhat(snap), "count %d: fork at least one", n)
	}
	if _, ok := p.timeoutFor(spec.Expiry); spec.Expiry.IsZero() || !ok {
		return nil, sandbox.Errorf(errdefs.ErrInvalid, "fork", snapWhat(snap), "the expiry %s is not in the future", spec.Expiry.Format(time.RFC3339))
	}
	if err := checkLabels("fork", snapWhat(snap), spec.Labels); err != nil {
		return nil, err
	}
	made := make([]sbState, n)
	errs := make([]error, n)
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		failed bool
	)
	sem := make(chan struct{}, p.o.ForkConcurrency)
	for i := 0; i < n; i++ {
		sem <- struct{}{}
		mu.Lock()
		stop := failed || ctx.Err() != nil
		mu.Unlock()
		if stop {
			<-sem
			break
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			var st sbState
			var err error
			if p.o.ForkHook != nil {
				err = p.o.ForkHook(snap, i)
			}
			if err == nil {
				st, err = p.forkOne(ctx, snap, spec)
			}
			if err != nil {
				mu.Lock()
				errs[i], failed = err, true
				mu.Unlock()
				return
			}
			made[i] = st
		}(i)
	}
	wg.Wait()
	first := -1
	for i, err := range errs {
		if err != nil {
			first = i
			break
		}
	}
	if first < 0 && ctx.Err() != nil {
		for i := range made {
			if made[i].id == "" {
				first, errs[i] = i, ctx.Err()
				break
			}
		}
	}
	if first >= 0 {
		return nil, p.undoFork(ctx, snap, n, first, errs[first], made)
	}
	out := make([]sandbox.Info, n)
	for i, st := range made {
		out[i] = p.info(st)
	}
	return out, nil
}

// forkOne makes one sandbox from a snapshot. A create is not retried after
// a 5xx: it may have made a sandbox that the answer never named.
func (p *Provider) forkOne(ctx context.Context, snap string, spec sandbox.ForkSpec) (sbState, error) {
	secs, ok := p.timeoutFor(spec.Expiry)
	if !ok {
		return sbState{}, sandbox.Errorf(errdefs.ErrExpired, "fork", snapWhat(snap), "the expiry %s passed while the fork ran", spec.Expiry.Format(time.RFC3339))
	}
	yes, no := true, false
	body := wire.NewSandbox{TemplateID: snap, Timeout: &secs, AutoPause: &no, Secure: &yes, Metadata: p.metadata(spec.Labels, spec.Expiry, snap)}
	var sb wire.Sandbox
	_, _, err := p.rest(ctx, restCall{op: "fork", what: snapWhat(snap), method: http.MethodPost, path: "/sandboxes", body: body, out: &sb})
	if err != nil {
		return sbState{}, err
	}
	st := p.fromSandbox(sb, spec.Labels, spec.Expiry, snap)
	p.remember(st)
	return st, nil
}

// undoFork deletes what a failed fork made and says what failed.
func (p *Provider) undoFork(ctx context.Context, snap string, n, failed int, cause error, made []sbState) error {
	dctx := context.WithoutCancel(ctx)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		count    int
		leftover []string
	)
	for _, st := range made {
		if st.id == "" {
			continue
		}
		count++
		wg.Add(1)
		go func(id string) {
			defer wg.Done()
			if err := p.Delete(dctx, id); err != nil {
				mu.Lock()
				leftover = append(leftover, fmt.Sprintf("%s (%v)", id, err))
				mu.Unlock()
			}
		}(st.id)
	}
	wg.Wait()
	msg := fmt.Sprintf("fork %s: sandbox %d of %d failed, so none is kept (%d made and deleted)", snapWhat(snap), failed+1, n, count)
	if len(leftover) > 0 {
		msg += "; deleting these failed, delete them with `stasis sandbox rm`: " + strings.Join(leftover, ", ")
	}
	return fmt.Errorf("%s: %w", msg, cause)
}

// ForkSandbox forks a live sandbox: it snapshots it (the sandbox runs on,
// its expiry unchanged) and forks the snapshot n times. The snapshot is
// returned for the caller to delete; when the fork fails it is deleted
// here.
func (p *Provider) ForkSandbox(ctx context.Context, id string, n int, spec sandbox.ForkSpec) (sandbox.SnapshotInfo, []sandbox.Info, error) {
	if n < 1 {
		return sandbox.SnapshotInfo{}, nil, sandbox.Errorf(errdefs.ErrInvalid, "fork", what(id), "count %d: fork at least one", n)
	}
	snap, err := p.Snapshot(ctx, id, "")
	if err != nil {
		return sandbox.SnapshotInfo{}, nil, err
	}
	infos, err := p.Fork(ctx, snap.ID, n, spec)
	if err != nil {
		if derr := p.DeleteSnapshot(context.WithoutCancel(ctx), snap.ID); derr != nil {
			err = fmt.Errorf("%w (and deleting its snapshot %s failed: %v)", err, snap.ID, derr)
		}
		return sandbox.SnapshotInfo{}, nil, err
	}
	return snap, infos, nil
}

// DeleteSnapshot deletes a snapshot's template (DELETE /templates/{id});
// one already gone is no error. Sandboxes forked from it run on.
func (p *Provider) DeleteSnapshot(ctx context.Context, snap string) error {
	_, _, err := p.rest(ctx, restCall{op: "delete-snapshot", what: snapWhat(snap), method: http.MethodDelete, path: "/templates/" + url.PathEscape(snap), idempotent: true})
	if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return err
	}
	p.mu.Lock()
	delete(p.snaps, snap)
	p.mu.Unlock()
	return nil
}
