package hostkeep

import (
	"context"
	"errors"
	"sort"
	"time"

	"golang.org/x/sys/unix"

	"stasis/errdefs"
	"stasis/sandbox"
)

// Calls answers the calls of the provider contract that need nothing of a
// provider's own but its Sandboxes and Snapshots: Get, List, SetExpiry,
// GetSnapshot, DeleteSnapshot and CollectBlobs, and Retired (for the
// conformance suite). A provider embeds it (NewCalls).
type Calls[M any, PM MetaOf[M], K any, S any, PS SnapOf[S]] struct {
	s *Sandboxes[M, PM, K]
	x *Snapshots[S, PS]
}

// NewCalls are the Calls of sandboxes s and snapshots x.
func NewCalls[M any, PM MetaOf[M], K any, S any, PS SnapOf[S]](s *Sandboxes[M, PM, K], x *Snapshots[S, PS]) Calls[M, PM, K, S, PS] {
	return Calls[M, PM, K, S, PS]{s, x}
}

// Get finds a sandbox by id; an expired one is described, with
// errdefs.ErrExpired.
func (c Calls[M, PM, K, S, PS]) Get(_ context.Context, id string) (sandbox.Info, error) {
	s := c.s
	m, _, err := s.Live("get", id)
	if errors.Is(err, errdefs.ErrExpired) {
		return s.Info(m, sandbox.StateExpired), err
	}
	if err != nil {
		return sandbox.Info{}, err
	}
	return s.Info(m, sandbox.StateRunning), nil
}

// List describes the sandboxes that carry every label given, oldest
// first: expired ones included (State expired), and those whose keeper is
// gone or that were ended (State lost).
func (c Calls[M, PM, K, S, PS]) List(_ context.Context, labels map[string]string) ([]sandbox.Info, error) {
	s := c.s
	ms, err := s.All()
	if err != nil {
		return nil, err
	}
	var out []sandbox.Info
	for _, m := range ms {
		if !MatchLabels(PM(&m).meta().Labels, labels) {
			continue
		}
		state := sandbox.StateRunning
		if _, err := s.Running("list", m); err != nil {
			state = sandbox.StateExpired
			if errors.Is(err, errdefs.ErrConflict) {
				state = sandbox.StateLost
			}
		}
		out = append(out, s.Info(m, state))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

// SetExpiry moves a running sandbox's absolute expiry, under its lock,
// and has its keeper re-read it (SIGHUP).
func (c Calls[M, PM, K, S, PS]) SetExpiry(_ context.Context, id string, t time.Time) error {
	const op = "set-expiry"
	s := c.s
	unlock, err := s.lock(op, id)
	if err != nil {
		return err
	}
	defer unlock()
	m, k, err := s.Live(op, id)
	if err != nil {
		return err
	}
	if !t.After(s.Now()) {
		return sandbox.Errorf(errdefs.ErrInvalid, op, what(id), "the expiry %s is not in the future; delete the sandbox instead", t.Format(time.RFC3339))
	}
	PM(&m).meta().Expiry = t.UTC()
	if err := s.write(m); err != nil {
		return err
	}
	keeper, _ := s.Procs(k)
	return unix.Kill(keeper.PID, unix.SIGHUP)
}

// Retired says how many times the Sandboxes retired sandbox id (for the
// conformance suite: a sandbox is retired exactly once).
func (c Calls[M, PM, K, S, PS]) Retired(id string) int {
	s := c.s
	s.retiredMu.Lock()
	defer s.retiredMu.Unlock()
	return s.retired[id]
}

// FindSnapshots returns the snapshots (not deleted) taken of sandbox id
// under name, oldest first: how a caller that lost a Snapshot's answer
// (its process died) finds what it made.
func (c Calls[M, PM, K, S, PS]) FindSnapshots(_ context.Context, id, name string) ([]sandbox.SnapshotInfo, error) {
	return c.x.Find(id, name)
}

// GetSnapshot describes snapshot id.
func (c Calls[M, PM, K, S, PS]) GetSnapshot(_ context.Context, id string) (sandbox.SnapshotInfo, error) {
	s, err := c.x.Read("get", id)
	if err != nil {
		return sandbox.SnapshotInfo{}, err
	}
	return c.x.Info(s), nil
}

// DeleteSnapshot deletes snapshot id (Snapshots.Delete).
func (c Calls[M, PM, K, S, PS]) DeleteSnapshot(ctx context.Context, id string) error {
	return c.x.Delete(ctx, id)
}

// DeleteSnapshots deletes the snapshots ids and collects their blobs once
// (Snapshots.DeleteMany): sandbox.SnapshotsDeleter.
func (c Calls[M, PM, K, S, PS]) DeleteSnapshots(ctx context.Context, ids []string) error {
	return c.x.DeleteMany(ctx, ids)
}

// CollectBlobs deletes the blobs that no snapshot and no sandbox's
// incremental base references (Snapshots.CollectBlobs).
func (c Calls[M, PM, K, S, PS]) CollectBlobs(ctx context.Context) (int, int64, error) {
	return c.x.CollectBlobs(ctx)
}

// ForgetHome removes the bases another state directory published in a
// shared blob store (Snapshots.ForgetHome): for an operator, once that
// directory's machine is gone for good.
func (c Calls[M, PM, K, S, PS]) ForgetHome(ctx context.Context, home string) (int, error) {
	return c.x.ForgetHome(ctx, home)
}
