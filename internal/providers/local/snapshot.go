package local

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"stasis/errdefs"
	"stasis/internal/providers/hostkeep"
	"stasis/sandbox"
)

// snapMeta is snapshots/local/ID.json.
type snapMeta struct {
	hostkeep.SnapMeta
	// Image is the source sandbox's image digest (its root; the snapshot
	// holds only the writable places), which every fork uses.
	Image string `json:"image,omitempty"`
}

func (s snapMeta) info() sandbox.SnapshotInfo {
	in := s.Info(Name)
	in.Image = s.Image
	return in
}

// Snapshot stores the sandbox's writable places (/work, $HOME, /tmp). It is
// file-only: processes are not kept. Files unchanged since the sandbox's
// last snapshot are not read again.
func (p *Provider) Snapshot(ctx context.Context, id, name string) (sandbox.SnapshotInfo, error) {
	m, _, err := p.sbs.Live("snapshot", id)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	unlock, err := p.snaps.LockBlobs(false)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	defer unlock()
	manifest, st, err := p.snaps.CAS.Snapshot(ctx, filepath.Join(p.sbDir(id), rootDir), m.LastManifest)
	if err != nil {
		return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: %w", what(id), err)
	}
	if p.o.SnapshotHook != nil {
		if err := p.o.SnapshotHook(id); err != nil {
			return sandbox.SnapshotInfo{}, fmt.Errorf("snapshot %s: %w", what(id), err)
		}
	}
	s := snapMeta{SnapMeta: hostkeep.SnapMeta{Name: name, Sandbox: id, Manifest: manifest, Created: p.o.Now().UTC(), Bytes: st.Bytes, NewBytes: st.NewBytes}, Image: m.Image}
	if err := p.snaps.Add(&s); err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	if err := p.sbs.SetBase(id, manifest); err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	return s.info(), nil
}

// Fork starts n sandboxes from a snapshot, all or nothing.
func (p *Provider) Fork(ctx context.Context, snap string, n int, spec sandbox.ForkSpec) ([]sandbox.Info, error) {
	s, err := p.snaps.ForFork(snap, n, spec.Expiry)
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
	if src, err := p.sbs.Read("fork", s.Sandbox); err == nil {
		m.Env = src.Env
		m.Limits = withDefaults(m.Limits, src.Limits)
	}
	if err := checkLimits(spec.Limits); err != nil {
		return sandbox.Info{}, sandbox.Errorf(errdefs.ErrInvalid, "fork", s.ID, "%v", err)
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
	// On a shared store, the snapshot's manifest is published as the
	// sandbox's base before its blobs are read (PinFork), and the index
	// beside it before meta.json names it.
	unlock, err := p.snaps.LockBlobs(false)
	if err != nil {
		return sandbox.Info{}, err
	}
	err = p.snaps.PinFork(ctx, m.ID, s)
	var index string
	if err == nil {
		index, _, err = p.snaps.CAS.RestoreIndexed(ctx, s.Manifest, filepath.Join(dir, rootDir))
	}
	if err == nil {
		err = p.prepareDir(&m)
	}
	if err == nil {
		err = p.sbs.Pin(ctx, m.ID, s.Manifest, index)
	}
	if err == nil {
		m.LastManifest = index
		err = p.sbs.Write(m)
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
