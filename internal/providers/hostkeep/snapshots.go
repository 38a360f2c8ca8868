package hostkeep

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"stasis/errdefs"
	"stasis/internal/flock"
	"stasis/internal/storage/atomicfile"
	"stasis/internal/storage/cas"
	"stasis/sandbox"
)

// SnapMeta is what every snapshot's record (Snapshots.Dir/ID.json)
// holds. A provider's own record embeds it. A deleted snapshot keeps its
// record as a tombstone, so that its id is never handed out again.
type SnapMeta struct {
	ID       string    `json:"id"`
	Name     string    `json:"name,omitempty"`
	Sandbox  string    `json:"sandbox"`
	Manifest string    `json:"manifest"`
	Created  time.Time `json:"created"`
	Bytes    int64     `json:"bytes"`
	NewBytes int64     `json:"new_bytes"`
	// Uses are the other manifests the snapshot needs besides Manifest
	// (microvm: its guest's read-only disks, stored in a shared store):
	// every collection keeps them while the snapshot lives, whichever
	// provider's node collects, and a fork publishes them with Manifest
	// (PinFork).
	Uses    []string `json:"uses,omitempty"`
	Deleted bool     `json:"deleted,omitempty"`
	// DeletedAt is when the snapshot was deleted (a tombstone of a shared
	// store is removed once it is older than the collections' grace
	// period: see dropTombstones).
	DeletedAt time.Time `json:"deleted_at,omitzero"`
}

func (s *SnapMeta) snap() *SnapMeta { return s }

// Roots are the manifests snapshot s keeps in the blob store: Manifest
// and Uses.
func (s SnapMeta) Roots() []string {
	if s.Manifest == "" {
		return s.Uses
	}
	return append([]string{s.Manifest}, s.Uses...)
}

// Info is the part of a sandbox.SnapshotInfo that s holds.
func (s SnapMeta) Info(provider string) sandbox.SnapshotInfo {
	return sandbox.SnapshotInfo{ID: s.ID, Name: s.Name, Sandbox: s.Sandbox, Provider: provider, Created: s.Created, Bytes: s.Bytes, NewBytes: s.NewBytes}
}

// SnapOf is a provider's snapshot record type S, as its pointer PS: one
// that embeds SnapMeta.
type SnapOf[S any] interface {
	*S
	snap() *SnapMeta
}

// Snapshots are one provider's snapshot records (S) and the blob store
// (a cas.Store) their manifests are in, with the cross-process lock that
// keeps a collection of the store from taking what a snapshot or a fork
// is using. Set the fields before use.
type Snapshots[S any, PS SnapOf[S]] struct {
	Provider string // in messages: "not a local snapshot id"
	Dir      string
	Prefix   string // of ids: "snap-"
	Now      func() time.Time
	// Info describes a snapshot (SnapMeta.Info and what the provider adds).
	Info func(S) sandbox.SnapshotInfo
	CAS  *cas.Store
	// BlobLock is the blob store's lock file: shared while a snapshot adds
	// blobs or a fork reads them, exclusive while garbage is collected.
	BlobLock string
	// Bases are the manifests the store keeps besides the snapshots':
	// the sandboxes' incremental bases (Sandboxes.Manifests).
	Bases func() ([]string, error)
	// Shared, set by ShareBlobs, keeps the records in a blob store that
	// the providers of several nodes share (the one CAS is on), instead of
	// files in Dir: any node can then fork any node's snapshot, and
	// collections mark from what every node published (see shared.go).
	Shared SharedRecords

	share     ShareOptions
	pins      *Pins
	reconcile func(context.Context) error
	// tombstones are the shared snapshot records seen deleted, never
	// read again: each one's name, and when it was deleted (or, for a
	// tombstone that does not say, first seen).
	tombstones sync.Map
	// collections counts the collections deletions asked for (tests).
	collections atomic.Int64
	// lastCollect is when this node's last collection of a shared store
	// began (Unix nanoseconds; 0: none yet).
	lastCollect atomic.Int64
}

// Path is snapshot id's record file (without Shared).
func (x *Snapshots[S, PS]) Path(id string) string { return filepath.Join(x.Dir, id+".json") }

// sharedName is snapshot id's record in Shared.
func (x *Snapshots[S, PS]) sharedName(id string) string {
	return "snapshots/" + x.Provider + "/" + id + ".json"
}

// readRecord returns snapshot id's record (fs.ErrNotExist when none).
func (x *Snapshots[S, PS]) readRecord(id string) ([]byte, error) {
	if x.Shared != nil {
		return x.Shared.GetRecord(context.Background(), x.sharedName(id))
	}
	return os.ReadFile(x.Path(id))
}

// writeRecord writes snapshot id's record.
func (x *Snapshots[S, PS]) writeRecord(id string, s any) error {
	if x.Shared != nil {
		b, err := json.Marshal(s)
		if err != nil {
			return err
		}
		return x.Shared.PutRecord(context.Background(), x.sharedName(id), b)
	}
	return atomicfile.WriteJSON(x.Path(id), s, 0o600)
}

// ids lists the snapshots that have records.
func (x *Snapshots[S, PS]) ids() ([]string, error) {
	var names []string
	if x.Shared != nil {
		ns, err := x.Shared.ListRecords(context.Background(), "snapshots/"+x.Provider+"/")
		if err != nil {
			return nil, err
		}
		for _, n := range ns {
			names = append(names, filepath.Base(n))
		}
	} else {
		ents, err := os.ReadDir(x.Dir)
		if err != nil {
			return nil, err
		}
		for _, e := range ents {
			names = append(names, e.Name())
		}
	}
	var out []string
	for _, n := range names {
		if id, ok := strings.CutSuffix(n, ".json"); ok && ValidID(id, x.Prefix) {
			out = append(out, id)
		}
	}
	return out, nil
}

// Read reads snapshot id's record; a snapshot never made or deleted is
// errdefs.ErrNotFound.
func (x *Snapshots[S, PS]) Read(op, id string) (S, error) {
	var s S
	what := "snapshot " + id
	if !ValidID(id, x.Prefix) {
		return s, sandbox.Errorf(errdefs.ErrNotFound, op, what, "not a %s snapshot id (%s and 16 hex digits)", x.Provider, x.Prefix)
	}
	b, err := x.readRecord(id)
	if errors.Is(err, os.ErrNotExist) {
		return s, sandbox.Errorf(errdefs.ErrNotFound, op, what, "no such snapshot")
	}
	if err != nil {
		return s, err
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("%s %s: %w", op, what, err)
	}
	if PS(&s).snap().Deleted {
		return s, sandbox.Errorf(errdefs.ErrNotFound, op, what, "it was deleted")
	}
	return s, nil
}

// Find returns the snapshots (not deleted) taken of sandbox id under
// name, oldest first.
func (x *Snapshots[S, PS]) Find(id, name string) ([]sandbox.SnapshotInfo, error) {
	ids, err := x.ids()
	if err != nil {
		return nil, err
	}
	var out []sandbox.SnapshotInfo
	for _, sid := range ids {
		s, err := x.Read("find", sid)
		if err != nil {
			continue // deleted, or another's
		}
		if m := PS(&s).snap(); m.Sandbox == id && m.Name == name {
			out = append(out, x.Info(s))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Created.Before(out[j].Created) })
	return out, nil
}

// Add gives s an id that no snapshot here ever had (not even a deleted
// one) and writes its record.
func (x *Snapshots[S, PS]) Add(s PS) error {
	b := s.snap()
	if x.Shared != nil {
		// 64 random bits: no two nodes hand out the same id.
		b.ID = NewID(x.Prefix)
		return x.writeRecord(b.ID, s)
	}
	for {
		b.ID = NewID(x.Prefix)
		f, err := os.OpenFile(x.Path(b.ID), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
		if errors.Is(err, os.ErrExist) {
			continue
		}
		if err != nil {
			return err
		}
		f.Close()
		break
	}
	if err := atomicfile.WriteJSON(x.Path(b.ID), s, 0o600); err != nil {
		_ = os.Remove(x.Path(b.ID))
		return err
	}
	return nil
}

// ForFork reads the snapshot that n sandboxes are to be forked from, with
// the expiry given, after checking both.
func (x *Snapshots[S, PS]) ForFork(snap string, n int, expiry time.Time) (S, error) {
	var s S
	if n < 1 {
		return s, sandbox.Errorf(errdefs.ErrInvalid, "fork", "snapshot "+snap, "count %d: fork at least one", n)
	}
	if expiry.IsZero() || !expiry.After(x.Now()) {
		return s, sandbox.Errorf(errdefs.ErrInvalid, "fork", "snapshot "+snap, "the expiry %s is not in the future", expiry.Format(time.RFC3339))
	}
	return x.Read("fork", snap)
}

// Delete deletes snapshot id, leaving its record as a tombstone (in a
// shared store, until a collection after the grace period removes it),
// and collects the blobs nothing references any more. Deleting a snapshot
// that is gone is nil.
func (x *Snapshots[S, PS]) Delete(ctx context.Context, id string) error {
	return x.DeleteMany(ctx, []string{id})
}

// DeleteMany deletes the snapshots ids, leaving their records as
// tombstones, then collects the blobs nothing references any more, once
// for them all: deleting a checkpoint's snapshots one by one would walk
// the whole blob store once per snapshot. A snapshot that is gone is
// skipped; one that cannot be deleted is an error, the others deleted
// and collected all the same.
func (x *Snapshots[S, PS]) DeleteMany(ctx context.Context, ids []string) error {
	var errs []error
	deleted := 0
	for _, id := range ids {
		s, err := x.Read("delete", id)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		PS(&s).snap().Deleted, PS(&s).snap().DeletedAt = true, time.Now().UTC()
		if err := x.writeRecord(id, s); err != nil {
			errs = append(errs, err)
			continue
		}
		deleted++
	}
	if deleted == 0 {
		return errors.Join(errs...)
	}
	x.collections.Add(1)
	if x.Shared != nil {
		if x.pins == nil {
			return errors.Join(errs...) // a provider that publishes no bases collects nothing
		}
		if last := x.lastCollect.Load(); last != 0 && x.share.CollectEvery > 0 && time.Since(time.Unix(0, last)) < x.share.CollectEvery {
			// A later deletion's collection, or an explicit one
			// (CollectBlobs, `stasis sandbox gc`), frees their blobs.
			slog.Debug("shared blob store: deleted snapshots' blobs left to a later collection", "snapshots", deleted, "last_collection", time.Unix(0, last).UTC())
			return errors.Join(errs...)
		}
		// Left to another node's collection if one is under way.
		_, _, err := x.collectShared(ctx, false)
		return errors.Join(append(errs, err)...)
	}
	_, _, err := x.CollectBlobs(ctx)
	return errors.Join(append(errs, err)...)
}

// Collections is how many collections deletions have asked for.
func (x *Snapshots[S, PS]) Collections() int64 { return x.collections.Load() }

// LockBlobs takes the blob store's lock, shared or exclusive, until the
// returned function is called.
func (x *Snapshots[S, PS]) LockBlobs(exclusive bool) (func(), error) {
	return flock.Lock(x.BlobLock, exclusive)
}

// CollectBlobs deletes, under the exclusive blob lock, the blobs that no
// snapshot (SnapMeta.Roots) and no sandbox's base references; it returns how
// many it deleted and their bytes. On a shared store it marks from every
// node's snapshots and published bases and spares recent blobs instead
// (see shared.go), without the lock: snapshots and forks go on meanwhile,
// here and elsewhere. It waits for another node's collection to finish
// (ShareOptions.LeaseWait).
func (x *Snapshots[S, PS]) CollectBlobs(ctx context.Context) (int, int64, error) {
	if x.Shared != nil {
		if x.pins == nil {
			// A provider that publishes no bases (not ShareBlobs's)
			// cannot tell what other nodes' sandboxes build on: it
			// collects nothing.
			slog.Info("shared blob store: not collected: this provider publishes no sandbox bases", "provider", x.Provider)
			return 0, 0, nil
		}
		return x.collectShared(ctx, true)
	}
	unlock, err := x.LockBlobs(true)
	if err != nil {
		return 0, 0, err
	}
	defer unlock()
	ids, err := x.ids()
	if err != nil {
		return 0, 0, err
	}
	var live []string
	for _, id := range ids {
		if s, err := x.Read("gc", id); err == nil {
			live = append(live, PS(&s).snap().Roots()...)
		}
	}
	bases, err := x.Bases()
	if err != nil {
		return 0, 0, err
	}
	return x.CAS.GC(ctx, append(live, bases...))
}
