package hostkeep

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/storage/blob"
	"stasis/internal/storage/cas"
	"stasis/sandbox"
)

// A provider's own snapshot record.
type tsnap struct {
	SnapMeta
	Extra string `json:"extra,omitempty"`
}

// snapRig is a provider's snapshots over a real blob store, whose
// sandboxes' bases are what the test says.
type snapRig struct {
	x     *Snapshots[tsnap, *tsnap]
	c     Calls[tmeta, *tmeta, tkeeper, tsnap, *tsnap] // of x alone
	now   time.Time
	bases []string
}

func newSnapRig(t *testing.T) *snapRig {
	home := t.TempDir()
	bs, err := blob.NewDir(filepath.Join(home, "blobs"))
	if err != nil {
		t.Fatal(err)
	}
	r := &snapRig{now: time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)}
	r.x = &Snapshots[tsnap, *tsnap]{
		Provider: "test", Dir: filepath.Join(home, "snapshots"), Prefix: "snap-",
		Now:  func() time.Time { return r.now },
		Info: func(s tsnap) sandbox.SnapshotInfo { return s.Info("test") },
		CAS:  cas.New(bs), BlobLock: filepath.Join(home, "blobs.lock"),
		Bases: func() ([]string, error) { return r.bases, nil },
	}
	if err := os.Mkdir(r.x.Dir, 0o700); err != nil {
		t.Fatal(err)
	}
	r.c = NewCalls((*Sandboxes[tmeta, *tmeta, tkeeper])(nil), r.x)
	return r
}

// store snapshots a directory holding one file with content into the blob
// store and returns its manifest.
func (r *snapRig) store(t *testing.T, content string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	m, _, err := r.x.CAS.Snapshot(context.Background(), dir, "")
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// Ids are never handed out again, not even a deleted snapshot's: its
// record stays as a tombstone; reading it is ErrNotFound; deleting it
// again is nil.
func TestSnapshotRecords(t *testing.T) {
	r := newSnapRig(t)
	ctx := context.Background()
	s := tsnap{SnapMeta: SnapMeta{Name: "n", Sandbox: "sb-0123456789abcdef", Manifest: r.store(t, "a"), Created: r.now, Bytes: 1}, Extra: "x"}
	if err := r.x.Add(&s); err != nil {
		t.Fatal(err)
	}
	if !ValidID(s.ID, "snap-") {
		t.Fatalf("id %q", s.ID)
	}
	got, err := r.x.Read("get", s.ID)
	if err != nil || !reflect.DeepEqual(got, s) {
		t.Fatalf("read %+v (%v), want %+v", got, err, s)
	}
	if in, err := r.c.GetSnapshot(ctx, s.ID); err != nil || in.ID != s.ID || in.Provider != "test" || in.Name != "n" {
		t.Fatalf("GetSnapshot: %+v %v", in, err)
	}
	if err := r.c.DeleteSnapshot(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := r.c.GetSnapshot(ctx, s.ID); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "deleted") {
		t.Fatalf("a deleted snapshot: %v", err)
	}
	if _, err := os.Stat(r.x.Path(s.ID)); err != nil {
		t.Fatalf("no tombstone: %v", err)
	}
	if err := r.c.DeleteSnapshot(ctx, s.ID); err != nil {
		t.Fatalf("deleting again: %v", err)
	}
	for _, id := range []string{NewID("snap-"), "snap-../x", NewID("vms-")} {
		if _, err := r.c.GetSnapshot(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s: %v", id, err)
		}
		if err := r.c.DeleteSnapshot(ctx, id); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}
	for range 20 {
		n := tsnap{SnapMeta: SnapMeta{Manifest: s.Manifest}}
		if err := r.x.Add(&n); err != nil || n.ID == s.ID {
			t.Fatalf("a new snapshot: %s %v", n.ID, err)
		}
	}
}

// CollectBlobs keeps what a snapshot (its manifest and those it uses) or
// a sandbox's base references, and frees what a deleted snapshot alone
// did.
func TestCollectBlobs(t *testing.T) {
	r := newSnapRig(t)
	ctx := context.Background()
	kept := tsnap{SnapMeta: SnapMeta{Manifest: r.store(t, "kept"), Uses: []string{r.store(t, "used")}}}
	gone := tsnap{SnapMeta: SnapMeta{Manifest: r.store(t, "gone"), Uses: []string{r.store(t, "used by the deleted one")}}}
	for _, s := range []*tsnap{&kept, &gone} {
		if err := r.x.Add(s); err != nil {
			t.Fatal(err)
		}
	}
	r.bases = []string{r.store(t, "base")}
	if n, _, err := r.c.CollectBlobs(ctx); err != nil || n != 0 {
		t.Fatalf("freed %d (%v) of what everything references", n, err)
	}
	if err := r.c.DeleteSnapshot(ctx, gone.ID); err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{kept.Manifest, kept.Uses[0], r.bases[0]} {
		if _, err := r.x.CAS.Restore(ctx, m, filepath.Join(t.TempDir(), "r")); err != nil {
			t.Fatalf("%s: %v", m, err)
		}
	}
	for _, m := range gone.Roots() {
		if _, err := r.x.CAS.Restore(ctx, m, filepath.Join(t.TempDir(), "r")); err == nil {
			t.Fatalf("the deleted snapshot's blobs (%s) are still there", m)
		}
	}
}

// ForFork checks the count and the expiry before it reads the snapshot.
func TestForFork(t *testing.T) {
	r := newSnapRig(t)
	s := tsnap{SnapMeta: SnapMeta{Manifest: r.store(t, "a")}}
	if err := r.x.Add(&s); err != nil {
		t.Fatal(err)
	}
	later := r.now.Add(time.Hour)
	if got, err := r.x.ForFork(s.ID, 2, later); err != nil || got.ID != s.ID {
		t.Fatalf("%+v %v", got, err)
	}
	for _, tc := range []struct {
		n      int
		expiry time.Time
		kind   error
	}{{0, later, errdefs.ErrInvalid}, {1, r.now, errdefs.ErrInvalid}, {1, time.Time{}, errdefs.ErrInvalid}} {
		if _, err := r.x.ForFork(s.ID, tc.n, tc.expiry); !errors.Is(err, tc.kind) {
			t.Errorf("%d %v: %v", tc.n, tc.expiry, err)
		}
	}
	if _, err := r.x.ForFork(NewID("snap-"), 1, later); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a missing snapshot: %v", err)
	}
}

// DeleteSnapshots deletes many snapshots with one collection for them all
// (deleting a checkpoint's snapshots one by one walked the blob store
// once each), skips those already gone, and frees what they alone held.
func TestDeleteSnapshotsCollectsOnce(t *testing.T) {
	r := newSnapRig(t)
	ctx := context.Background()
	kept := tsnap{SnapMeta: SnapMeta{Manifest: r.store(t, "kept")}}
	if err := r.x.Add(&kept); err != nil {
		t.Fatal(err)
	}
	var gone []tsnap
	var ids []string
	for i := range 5 {
		s := tsnap{SnapMeta: SnapMeta{Manifest: r.store(t, strings.Repeat("g", i+1))}}
		if err := r.x.Add(&s); err != nil {
			t.Fatal(err)
		}
		gone, ids = append(gone, s), append(ids, s.ID)
	}
	var d sandbox.SnapshotsDeleter = r.c
	if err := d.DeleteSnapshots(ctx, append(ids, NewID("snap-"))); err != nil {
		t.Fatal(err)
	}
	if n := r.x.Collections(); n != 1 {
		t.Fatalf("%d collections for deleting %d snapshots, want 1", n, len(ids))
	}
	for _, s := range gone {
		if _, err := r.c.GetSnapshot(ctx, s.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("%s after the deletion: %v", s.ID, err)
		}
		if _, err := r.x.CAS.Restore(ctx, s.Manifest, filepath.Join(t.TempDir(), "r")); err == nil {
			t.Fatalf("the deleted snapshot %s's blobs are still there", s.ID)
		}
	}
	if _, err := r.x.CAS.Restore(ctx, kept.Manifest, filepath.Join(t.TempDir(), "r")); err != nil {
		t.Fatalf("the kept snapshot: %v", err)
	}
	// Again: everything is gone already, nothing to collect.
	if err := d.DeleteSnapshots(ctx, ids); err != nil || r.x.Collections() != 1 {
		t.Fatalf("deleting them again: %v, %d collections", err, r.x.Collections())
	}
}
