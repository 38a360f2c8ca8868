package local

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"stasis/atomicfile"
	"stasis/internal/flock"
	"stasis/sandbox"
	"stasis/sandbox/hostkeep"
)

// snapMeta is snapshots/local/ID.json. A deleted snapshot keeps its file as
// a tombstone, so its id is never handed out again.
type snapMeta struct {
	ID       string    `json:"id"`
	Name     string    `json:"name,omitempty"`
	Sandbox  string    `json:"sandbox"`
	Manifest string    `json:"manifest"`
	Created  time.Time `json:"created"`
	Bytes    int64     `json:"bytes"`
	NewBytes int64     `json:"new_bytes"`
	Deleted  bool      `json:"deleted,omitempty"`
	// Image is the source sandbox's image digest (its root; the snapshot
	// holds only the writable places), which every fork uses.
	Image string `json:"image,omitempty"`
}

func (p *Provider) snapPath(id string) string { return filepath.Join(p.snapDir, id+".json") }

func (s snapMeta) info() sandbox.SnapshotInfo {
	return sandbox.SnapshotInfo{ID: s.ID, Name: s.Name, Sandbox: s.Sandbox, Provider: Name, Created: s.Created, Bytes: s.Bytes, NewBytes: s.NewBytes, Image: s.Image}
}

func (p *Provider) readSnap(op, id string) (snapMeta, error) {
	var s snapMeta
	if !hostkeep.ValidID(id, "snap-") {
		return s, sandbox.Errorf(sandbox.ErrNotFound, op, "snapshot "+id, "not a local snapshot id (snap- and 16 hex digits)")
	}
	b, err := os.ReadFile(p.snapPath(id))
	if errors.Is(err, os.ErrNotExist) {
		return s, sandbox.Errorf(sandbox.ErrNotFound, op, "snapshot "+id, "no such snapshot")
	}
	if err != nil {
		return s, err
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("%s snapshot %s: %w", op, id, err)
	}
	if s.Deleted {
		return s, sandbox.Errorf(sandbox.ErrNotFound, op, "snapshot "+id, "it was deleted")
	}
	return s, nil
}

// blobLock takes the cross-process lock on the blob store: shared while a
// snapshot adds blobs, exclusive while garbage is collected.
func (p *Provider) blobLock(exclusive bool) (func(), error) {
	return flock.Lock(filepath.Join(p.o.Home, "blobs.lock"), exclusive)
}

// Snapshot stores the sandbox's writable places (/work, $HOME, /tmp). It is
// file-only: processes are not kept. Files unchanged since the sandbox's
// last snapshot are not read again.
func (p *Provider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	m, _, err := p.live("snapshot", id)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	unlock, err := p.blobLock(false)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	defer unlock()
	manifest, st, err := p.cas.Snapshot(ctx, filepath.Join(p.sbDir(id), rootDir), m.LastManifest)
	if err != nil {
		return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: %w", what(id), err)
	}
	s := snapMeta{Name: name, Sandbox: id, Manifest: manifest, Created: p.o.Now().UTC(), Bytes: st.Bytes, NewBytes: st.NewBytes, Image: m.Image}
	for {
		s.ID = hostkeep.NewID("snap-")
		f, err := os.OpenFile(p.snapPath(s.ID), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, os.ErrExist) {
			continue // an id is never reused, not even a deleted one's
		}
		if err != nil {
			return sandbox.SnapshotInfo{}, err
		}
		f.Close()
		break
	}
	if err := writeJSON(p.snapPath(s.ID), s); err != nil {
		_ = os.Remove(p.snapPath(s.ID))
		return sandbox.SnapshotInfo{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if m2, err := p.readMeta("snapshot", id); err == nil {
		m2.LastManifest = manifest
		if err := p.writeMeta(m2); err != nil {
			return sandbox.SnapshotInfo{}, err
		}
	}
	return s.info(), nil
}

// GetSnapshot describes a snapshot.
func (p *Provider) GetSnapshot(ctx context.Context, id string) (sandbox.SnapshotInfo, error) {
	s, err := p.readSnap("get", id)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	return s.info(), nil
}

// Fork starts n sandboxes from a snapshot, all or nothing.
func (p *Provider) Fork(ctx context.Context, snap string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	if n < 1 {
		return nil, sandbox.Errorf(sandbox.ErrInvalid, "fork", "snapshot "+snap, "count %d: fork at least one", n)
	}
	if spec.Expiry.IsZero() || !spec.Expiry.After(p.o.Now()) {
		return nil, sandbox.Errorf(sandbox.ErrInvalid, "fork", "snapshot "+snap, "the expiry %s is not in the future", spec.Expiry.Format(time.RFC3339))
	}
	s, err := p.readSnap("fork", snap)
	if err != nil {
		return nil, err
	}
	var made []sandbox.Info
	fail := func(i int, err error) ([]sandbox.Info, error) {
		for _, info := range made {
			_ = p.retire(info.ID)
		}
		return nil, fmt.Errorf("fork %s: sandbox %d of %d failed, so none was kept: %w", snap, i+1, n, err)
	}
	for i := 0; i < n; i++ {
		if p.o.ForkHook != nil {
			if err := p.o.ForkHook(snap, i); err != nil {
				return fail(i, err)
			}
		}
		info, err := p.forkOne(ctx, s, spec)
		if err != nil {
			return fail(i, err)
		}
		made = append(made, info)
	}
	return made, nil
}

func (p *Provider) forkOne(ctx context.Context, s snapMeta, spec sandbox.ForkSpec) (sandbox.Info, error) {
	m := p.newMeta(spec.Labels, spec.Expiry)
	m.Source = s.ID
	m.Limits = spec.Limits
	if src, err := p.readMeta("fork", s.Sandbox); err == nil {
		m.Env = src.Env
		m.Limits = withDefaults(m.Limits, src.Limits)
	}
	if err := checkLimits(spec.Limits); err != nil {
		return sandbox.Info{}, sandbox.Errorf(sandbox.ErrInvalid, "fork", s.ID, "%v", err)
	}
	m.Limits = withDefaults(m.Limits, p.o.Limits)
	if s.Image != "" {
		// The snapshot holds only the writable places; its image must
		// still be here.
		if err := p.useImage(ctx, &m, s.Image); err != nil {
			return sandbox.Info{}, fmt.Errorf("fork %s: its image: %w", s.ID, err)
		}
	}
	dir := p.sbDir(m.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return sandbox.Info{}, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = p.retire(m.ID)
		}
	}()
	// The index (the snapshot's manifest with this tree's inodes and ctimes)
	// lets the fork's first snapshot read only what changed since the fork.
	// The shared blob lock keeps a garbage collection from taking the index
	// before meta.json names it.
	unlock, err := p.blobLock(false)
	if err != nil {
		return sandbox.Info{}, err
	}
	index, _, err := p.cas.RestoreIndexed(ctx, s.Manifest, filepath.Join(dir, rootDir))
	if err == nil {
		err = p.prepareDir(&m)
	}
	if err == nil {
		m.LastManifest = index
		err = p.writeMeta(m)
	}
	unlock()
	if err != nil {
		return sandbox.Info{}, err
	}
	if err := p.startKeeper(ctx, m.ID); err != nil {
		return sandbox.Info{}, err
	}
	ok = true
	return p.info(m, sandbox.StateRunning), nil
}

// DeleteSnapshot deletes a snapshot (idempotent) and frees the blobs that
// nothing else references.
func (p *Provider) DeleteSnapshot(ctx context.Context, id string) error {
	s, err := p.readSnap("delete", id)
	if errors.Is(err, sandbox.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	s.Deleted = true
	if err := writeJSON(p.snapPath(id), s); err != nil {
		return err
	}
	_, _, err = p.CollectBlobs(ctx)
	return err
}

// FindSnapshots returns the snapshots (not deleted) taken of sandbox id
// under name, oldest first: how a caller that lost a Snapshot's answer
// (its process died) finds what it made.
func (p *Provider) FindSnapshots(ctx context.Context, id, name string) ([]sandbox.SnapshotInfo, error) {
	ents, err := os.ReadDir(p.snapDir)
	if err != nil {
		return nil, err
	}
	var out []sandbox.SnapshotInfo
	for _, e := range ents {
		sid, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok {
			continue
		}
		if s, err := p.readSnap("find", sid); err == nil && s.Sandbox == id && s.Name == name {
			out = append(out, s.info())
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

// CollectBlobs deletes blobs that no snapshot and no sandbox's incremental
// base references.
func (p *Provider) CollectBlobs(ctx context.Context) (int, int64, error) {
	unlock, err := p.blobLock(true)
	if err != nil {
		return 0, 0, err
	}
	defer unlock()
	var live []string
	ents, err := os.ReadDir(p.snapDir)
	if err != nil {
		return 0, 0, err
	}
	for _, e := range ents {
		id := strings.TrimSuffix(e.Name(), ".json")
		if s, err := p.readSnap("gc", id); err == nil && s.Manifest != "" {
			live = append(live, s.Manifest)
		}
	}
	sbs, err := os.ReadDir(p.dir)
	if err != nil {
		return 0, 0, err
	}
	for _, e := range sbs {
		if m, err := readMetaAt(filepath.Join(p.dir, e.Name())); err == nil && m.LastManifest != "" {
			live = append(live, m.LastManifest)
		}
	}
	return p.cas.GC(ctx, live)
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return atomicfile.Write(path, append(b, '\n'), 0o600)
}
