package local_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/errdefs"
	"stasis/internal/providers/hostkeep"
	"stasis/internal/providers/local"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/blob"
	"stasis/internal/storage/cas"
	"stasis/internal/testwait"
	"stasis/sandbox"
)

// bucket is one S3 bucket that several "nodes" (local providers on
// state directories of their own) share, on the test's Versity Gateway.
type bucket struct {
	srv    *s3test.Server
	name   string
	url    string
	prefix string
}

func newBucket(t *testing.T) *bucket {
	srv := s3test.Start(t)
	srv.Setenv(t)
	b := &bucket{srv: srv, name: srv.Bucket(t), prefix: "stasis"}
	b.url = "s3://" + b.name + "/" + b.prefix
	return b
}

// node opens a local provider on a fresh state directory over the
// bucket, with o's collection; it is closed, its sandboxes deleted, when
// t ends.
func (b *bucket) node(t *testing.T, o local.Options) *local.Provider {
	t.Helper()
	o.Home, o.Exe, o.ExeEnv, o.Blobs = t.TempDir(), stasistest.Exe(), stasistest.Env, b.url
	p, err := local.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		infos, _ := p.List(ctx, nil)
		for _, in := range infos {
			if err := p.Delete(ctx, in.ID); err != nil {
				t.Errorf("delete %s: %v", in.ID, err)
			}
		}
		p.Close()
	})
	return p
}

// packBytes is the size of every pack object in the bucket.
func (b *bucket) packBytes(t *testing.T) int64 {
	t.Helper()
	var n int64
	err := filepath.WalkDir(b.srv.ObjectPath(b.name, b.prefix+"/packs"), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".pack") {
			return err
		}
		fi, err := d.Info()
		if err == nil {
			n += fi.Size()
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// age makes every blob in the bucket count as stored age ago: it sets the
// mtime, which Versity Gateway's posix backend gives as Last-Modified, of
// every pack index (a blob's store time is its index's).
func (b *bucket) age(t *testing.T, age time.Duration) {
	t.Helper()
	then := time.Now().Add(-age)
	dir := b.srv.ObjectPath(b.name, b.prefix+"/packs")
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".idx") {
			if err := os.Chtimes(filepath.Join(dir, e.Name()), then, then); err != nil {
				t.Fatal(err)
			}
			n++
		}
	}
	if n == 0 {
		t.Fatal("no pack index to age")
	}
}

// manifest is snapshot id's manifest, read from its record in the bucket.
func (b *bucket) manifest(t *testing.T, id string) string {
	t.Helper()
	raw, err := os.ReadFile(b.srv.ObjectPath(b.name, b.prefix+"/records/snapshots/local/"+id+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var m hostkeep.SnapMeta
	if err := json.Unmarshal(raw, &m); err != nil || m.Manifest == "" {
		t.Fatalf("record of %s: %s %v", id, raw, err)
	}
	return m.Manifest
}

// restorable says whether manifest restores whole from the bucket, as a
// node that opens it afresh reads it.
func (b *bucket) restorable(t *testing.T, manifest string) error {
	t.Helper()
	s, err := blob.OpenS3(context.Background(), b.url, blob.S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, err = cas.New(s).Restore(context.Background(), manifest, filepath.Join(t.TempDir(), "r"))
	return err
}

func randomBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func create(t *testing.T, p *local.Provider, files map[string][]byte) string {
	t.Helper()
	ctx := context.Background()
	in, err := p.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	write(t, p, in.ID, files)
	return in.ID
}

func write(t *testing.T, p *local.Provider, id string, files map[string][]byte) {
	t.Helper()
	for path, data := range files {
		if err := p.WriteFile(context.Background(), id, path, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func snapshot(t *testing.T, p *local.Provider, id string) string {
	t.Helper()
	s, err := p.Snapshot(context.Background(), id, "")
	if err != nil {
		t.Fatal(err)
	}
	return s.ID
}

func fork(t *testing.T, p *local.Provider, snap string) string {
	t.Helper()
	infos, err := p.Fork(context.Background(), snap, 1, sandbox.ForkSpec{Expiry: time.Now().Add(time.Hour)})
	if err != nil {
		t.Fatalf("fork %s: %v", snap, err)
	}
	return infos[0].ID
}

// check reads every file of want from sandbox id.
func check(t *testing.T, p *local.Provider, id string, want map[string][]byte) {
	t.Helper()
	for path, data := range want {
		got, err := p.ReadFile(context.Background(), id, path)
		if err != nil || !bytes.Equal(got, data) {
			t.Errorf("%s in %s: %d bytes, %v; want the %d bytes written", path, id, len(got), err, len(data))
		}
	}
}

// A sandbox on node A forked from snapshot S keeps S's blobs after node
// B deletes S (and B's collection runs with every blob past the grace
// period), and A's next snapshot of it, whose unchanged files reuse those
// blobs, restores on B.
func TestSharedBaseOutlivesItsSnapshot(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	nodeA, nodeB := b.node(t, local.Options{}), b.node(t, local.Options{})
	files := map[string][]byte{"/work/big": randomBytes(t, 3<<20), "/work/small": []byte("from B")}
	x := create(t, nodeB, files)
	s := snapshot(t, nodeB, x)
	sManifest := b.manifest(t, s)
	y := fork(t, nodeA, s)

	if err := nodeB.Delete(ctx, x); err != nil {
		t.Fatal(err)
	}
	b.age(t, 3*time.Hour) // past the grace period: only the mark keeps blobs
	if err := nodeB.DeleteSnapshot(ctx, s); err != nil {
		t.Fatal(err)
	}
	if _, err := nodeB.GetSnapshot(ctx, s); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("deleted snapshot: %v", err)
	}
	if err := b.restorable(t, sManifest); err != nil {
		t.Fatalf("the base of A's sandbox lost blobs to B's collection: %v", err)
	}

	files["/work/small"] = []byte("changed on A")
	write(t, nodeA, y, map[string][]byte{"/work/small": files["/work/small"]})
	s2 := snapshot(t, nodeA, y)
	if n, _, err := nodeB.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("B's second collection freed %d blobs", n)
	}
	if err := b.restorable(t, b.manifest(t, s2)); err != nil {
		t.Fatalf("A's snapshot after B's collection: %v", err)
	}
	z := fork(t, nodeB, s2)
	check(t, nodeB, z, files)
}

// The blobs of a deleted snapshot that nothing else uses are collected
// once past the grace period (the bucket's bytes go down), and not
// before.
func TestSharedCollectsGarbage(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	nodeA, nodeB := b.node(t, local.Options{}), b.node(t, local.Options{})
	keep := map[string][]byte{"/work/keep": randomBytes(t, 1<<20)}
	kept := snapshot(t, nodeA, create(t, nodeA, keep))

	w := create(t, nodeB, map[string][]byte{"/work/garbage": randomBytes(t, 4<<20)})
	g := snapshot(t, nodeB, w)
	gManifest := b.manifest(t, g)
	if err := nodeB.Delete(ctx, w); err != nil {
		t.Fatal(err)
	}
	before := b.packBytes(t)
	if err := nodeB.DeleteSnapshot(ctx, g); err != nil {
		t.Fatal(err)
	}
	if after := b.packBytes(t); after != before {
		t.Fatalf("blobs within the grace period were collected: %d bytes before, %d after", before, after)
	}
	b.age(t, 3*time.Hour)
	// A provider whose nodes publish no bases keeps snapshots in the
	// bucket too: no collection runs, nothing is freed.
	other, err := blob.OpenS3(ctx, b.url, blob.S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.PutRecord(ctx, "snapshots/microvm/vms-1.json", []byte(`{"id":"vms-1","manifest":"x"}`)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := nodeA.CollectBlobs(ctx); !errors.Is(err, errdefs.ErrConflict) || !strings.Contains(err.Error(), "microvm provider, whose nodes publish no sandbox bases") {
		t.Fatalf("a collection with another provider's snapshots in the bucket: %v", err)
	}
	if after := b.packBytes(t); after != before {
		t.Fatalf("a refused collection freed blobs: %d bytes before, %d after", before, after)
	}
	if err := other.DeleteRecord(ctx, "snapshots/microvm/vms-1.json"); err != nil {
		t.Fatal(err)
	}
	n, freed, err := nodeA.CollectBlobs(ctx)
	if err != nil {
		t.Fatal(err)
	}
	after := b.packBytes(t)
	t.Logf("freed %d blobs, %d bytes; packs %d → %d bytes", n, freed, before, after)
	if n == 0 || freed < 4<<20 || before-after < 4<<20 {
		t.Fatalf("freed %d blobs (%d bytes), packs %d → %d bytes: want the deleted snapshot's 4 MiB gone", n, freed, before, after)
	}
	if err := b.restorable(t, gManifest); err == nil {
		t.Fatal("the deleted snapshot still restores")
	}
	check(t, nodeB, fork(t, nodeB, kept), keep)
	if n, _, err := nodeB.CollectBlobs(ctx); err != nil || n != 0 {
		t.Fatalf("a second collection freed %d blobs (%v)", n, err)
	}
}

// A snapshot written on node A while node B collects (between B's mark and
// its sweep) is whole afterwards, although one of its files has the
// content of old blobs that nothing references any more: A stores them
// anew instead of relying on copies the collector is deleting.
func TestSharedSnapshotDuringCollection(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	var (
		once   sync.Once
		during func()
	)
	nodeA := b.node(t, local.Options{})
	nodeB := b.node(t, local.Options{Share: hostkeep.ShareOptions{AfterMark: func() {
		once.Do(func() { during() })
	}}})
	once.Do(func() {}) // no hook until the collection under test
	old, other := randomBytes(t, 2<<20), randomBytes(t, 1<<20)
	w := create(t, nodeB, map[string][]byte{"/work/old": old, "/work/other": other})
	g := snapshot(t, nodeB, w)
	gManifest := b.manifest(t, g)
	if err := nodeB.Delete(ctx, w); err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{"/work/base": []byte("A's own"), "/work/copy": old, "/work/new": randomBytes(t, 1<<20)}
	y := create(t, nodeA, map[string][]byte{"/work/base": files["/work/base"]})
	base := snapshot(t, nodeA, y)
	write(t, nodeA, y, map[string][]byte{"/work/copy": old, "/work/new": files["/work/new"]})
	b.age(t, 3*time.Hour)
	// A collection on A while g is live: A's view of the bucket then has
	// g's blobs, with their (aged) store times.
	if _, _, err := nodeA.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	}

	// B deletes g; its collection marks, A snapshots, B sweeps.
	once = sync.Once{}
	var s2 string
	during = func() {
		s, err := nodeA.Snapshot(ctx, y, "")
		if err != nil {
			t.Errorf("snapshot during the collection: %v", err)
			return
		}
		s2 = s.ID
	}
	if err := nodeB.DeleteSnapshot(ctx, g); err != nil {
		t.Fatal(err)
	}
	if s2 == "" {
		t.Fatal("no snapshot was made during the collection")
	}
	if err := b.restorable(t, gManifest); err == nil {
		t.Fatal("the deleted snapshot was not collected")
	}
	// The nodes' read caches may hold what the bucket lost: read it as a
	// node without one.
	if err := b.restorable(t, b.manifest(t, s2)); err != nil {
		t.Fatalf("the snapshot made during the collection: %v", err)
	}
	check(t, nodeB, fork(t, nodeB, s2), files)
	check(t, nodeB, fork(t, nodeB, base), map[string][]byte{"/work/base": files["/work/base"]})
}

// A fork on node A of a snapshot that node B deletes and collects after A
// read its record, but before A pinned it, fails as not found and leaves
// nothing; it never makes a sandbox from blobs being collected.
func TestSharedForkOfSnapshotBeingDeleted(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	var nodeB *local.Provider
	var deleteS func()
	nodeA := b.node(t, local.Options{ForkHook: func(string, int) error {
		deleteS()
		return nil
	}})
	nodeB = b.node(t, local.Options{})
	x := create(t, nodeB, map[string][]byte{"/work/f": randomBytes(t, 1<<20)})
	s := snapshot(t, nodeB, x)
	if err := nodeB.Delete(ctx, x); err != nil {
		t.Fatal(err)
	}
	b.age(t, 3*time.Hour)
	deleteS = func() {
		if err := nodeB.DeleteSnapshot(ctx, s); err != nil {
			t.Errorf("delete during the fork: %v", err)
		}
	}
	_, err := nodeA.Fork(ctx, s, 1, sandbox.ForkSpec{Expiry: time.Now().Add(time.Hour)})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("fork of a snapshot deleted meanwhile: %v, want not found", err)
	}
	if infos, err := nodeA.List(ctx, nil); err != nil || len(infos) != 0 {
		t.Fatalf("the failed fork left %v (%v)", infos, err)
	}
	if err := b.restorable(t, b.manifest(t, s)); err == nil {
		t.Fatal("the deleted snapshot's blobs were not collected")
	}
}

// Two nodes collecting at once: one waits for the other's lease (a node
// that may not wait long gives up, with a conflict naming the holder),
// an expired lease of a dead collector does not stop them, and neither
// deletes a live blob.
func TestSharedTwoCollectors(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	var during func()
	var once sync.Once
	impatient := b.node(t, local.Options{Share: hostkeep.ShareOptions{LeaseWait: time.Second}})
	nodeA := b.node(t, local.Options{})
	nodeB := b.node(t, local.Options{Share: hostkeep.ShareOptions{AfterMark: func() { once.Do(func() { during() }) }}})
	once.Do(func() {}) // no hook until the first explicit collection
	liveA := map[string][]byte{"/work/a": randomBytes(t, 1<<20)}
	liveB := map[string][]byte{"/work/b": randomBytes(t, 1<<20)}
	sa := snapshot(t, nodeA, create(t, nodeA, liveA))
	yb := create(t, nodeB, liveB)
	sbOld := snapshot(t, nodeB, yb)
	ybBase := b.manifest(t, sbOld)
	if err := nodeB.DeleteSnapshot(ctx, sbOld); err != nil {
		t.Fatal(err) // yb's base alone keeps its blobs
	}
	var garbage []string
	for _, p := range []*local.Provider{nodeA, nodeB} {
		w := create(t, p, map[string][]byte{"/work/g": randomBytes(t, 1<<20)})
		g := snapshot(t, p, w)
		garbage = append(garbage, b.manifest(t, g))
		if err := p.Delete(ctx, w); err != nil {
			t.Fatal(err)
		}
		if err := p.DeleteSnapshot(ctx, g); err != nil {
			t.Fatal(err)
		}
	}
	b.age(t, 3*time.Hour)

	// A collector that died holding the lease, long ago.
	s3, err := blob.OpenS3(ctx, b.url, blob.S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	stale, _ := json.Marshal(map[string]any{"home": "h-0000000000000000", "host": "gone", "expires": time.Now().Add(-time.Hour)})
	if err := s3.PutRecord(ctx, "gc/lock/h-0000000000000000-dead.json", stale); err != nil {
		t.Fatal(err)
	}

	// One that cannot wait long enough for B's collection, which holds
	// the lease until it has given up.
	once = sync.Once{}
	var waitErr error
	during = func() { _, _, waitErr = impatient.CollectBlobs(ctx) }
	if _, _, err := nodeB.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	}
	if !errors.Is(waitErr, errdefs.ErrConflict) || !strings.Contains(waitErr.Error(), "another collection") {
		t.Fatalf("collecting while B held the lease: %v, want a conflict", waitErr)
	}
	if names, err := s3.ListRecords(ctx, "gc/lock/"); err != nil || len(names) != 0 {
		t.Fatalf("leases left: %v (%v)", names, err)
	}

	// Both at once, for real: each waits its turn or collects.
	once = sync.Once{}
	during = func() {}
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for i, p := range []*local.Provider{nodeA, nodeB} {
		wg.Go(func() { _, _, errs[i] = p.CollectBlobs(ctx) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("collector %d: %v", i, err)
		}
	}
	for _, m := range garbage {
		if err := b.restorable(t, m); err == nil {
			t.Errorf("garbage %s was not collected", m)
		}
	}
	if err := b.restorable(t, ybBase); err != nil {
		t.Fatalf("the base of B's sandbox after two collections: %v", err)
	}
	sb := snapshot(t, nodeB, yb)
	for _, s := range []string{sa, sb} {
		if err := b.restorable(t, b.manifest(t, s)); err != nil {
			t.Fatalf("live snapshot %s after two collections: %v", s, err)
		}
	}
	check(t, nodeB, fork(t, nodeB, sa), liveA)
	check(t, nodeA, fork(t, nodeA, sb), liveB)
}

// A node's pins follow its sandboxes: one a crash left behind is removed
// when its state directory is opened again; another home's pins stay
// until an operator forgets that home, and then their blobs go.
func TestSharedPinsOfAGoneHome(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	nodeB := b.node(t, local.Options{})
	dirA := t.TempDir()
	openA := func() *local.Provider {
		t.Helper()
		p, err := local.New(local.Options{Home: dirA, Exe: stasistest.Exe(), ExeEnv: stasistest.Env, Blobs: b.url})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	nodeA := openA()
	files := map[string][]byte{"/work/f": randomBytes(t, 1<<20)}
	x := create(t, nodeB, files)
	s := snapshot(t, nodeB, x)
	if err := nodeB.Delete(ctx, x); err != nil {
		t.Fatal(err)
	}
	y := fork(t, nodeA, s)
	t.Cleanup(func() {
		if err := nodeA.Delete(context.Background(), y); err != nil {
			t.Error(err)
		}
		nodeA.Close()
	})
	homeA, err := hostkeep.HomeID(dirA)
	if err != nil {
		t.Fatal(err)
	}
	s3, err := blob.OpenS3(ctx, b.url, blob.S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	pins := func() []string {
		t.Helper()
		names, err := s3.ListRecords(ctx, "bases/local/"+homeA+"/")
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	if got := pins(); len(got) != 1 || !strings.Contains(got[0], y) {
		t.Fatalf("A's pins: %v, want %s's", got, y)
	}
	// A crash left a pin of a sandbox that is gone; opening the state
	// directory again removes it.
	crashed := "bases/local/" + homeA + "/" + hostkeep.NewID("sb-") + ".json"
	if err := s3.PutRecord(ctx, crashed, []byte(`{"manifests":["`+b.manifest(t, s)+`"]}`)); err != nil {
		t.Fatal(err)
	}
	nodeA.Close()
	nodeA = openA()
	if got := pins(); len(got) != 1 || !strings.Contains(got[0], y) {
		t.Fatalf("A's pins after it opened again: %v, want %s's alone", got, y)
	}

	// A pin whose manifest a collection freed before it was published
	// (a fork that lost its snapshot, and then its process) stops no
	// collection.
	lost := "bases/local/" + hostkeep.NewID("h-") + "/" + hostkeep.NewID("sb-") + ".json"
	if err := s3.PutRecord(ctx, lost, []byte(`{"manifests":["`+strings.Repeat("ab", 32)+`"]}`)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := nodeB.CollectBlobs(ctx); err != nil {
		t.Fatalf("a collection with a pin of a missing manifest: %v", err)
	}

	// Node A's machine is gone, its sandbox with it, but not its pin.
	sManifest := b.manifest(t, s)
	if err := nodeB.DeleteSnapshot(ctx, s); err != nil {
		t.Fatal(err)
	}
	b.age(t, 3*time.Hour)
	if _, _, err := nodeB.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.restorable(t, sManifest); err != nil {
		t.Fatalf("a live home's base lost blobs: %v", err)
	}
	if _, err := nodeB.ForgetHome(ctx, "h-0123456789abcdef"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("forget an unknown home: %v", err)
	}
	if _, err := nodeA.ForgetHome(ctx, homeA); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("a home forgetting itself: %v", err)
	}
	if n, err := nodeB.ForgetHome(ctx, homeA); err != nil || n != 1 {
		t.Fatalf("forget home A: %d pins, %v", n, err)
	}
	if _, _, err := nodeB.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.restorable(t, sManifest); err == nil {
		t.Fatal("the forgotten home's base was not collected")
	}
}

// A collection on a local node keeps every manifest a live snapshot
// record of another provider names, its own and those it uses (a microVM
// snapshot's read-only disks), once that provider's nodes publish their
// bases; when the record becomes a tombstone, all of them go.
func TestSharedKeepsWhatAnotherProvidersSnapshotUses(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	node := b.node(t, local.Options{})
	s3, err := blob.OpenS3(ctx, b.url, blob.S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s3.Close()
	var roots []string
	for _, size := range []int{1 << 20, 2 << 20} {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "f"), randomBytes(t, size), 0o600); err != nil {
			t.Fatal(err)
		}
		m, _, err := cas.New(s3).Snapshot(ctx, dir, "")
		if err != nil {
			t.Fatal(err)
		}
		roots = append(roots, m)
	}
	rec := hostkeep.SnapMeta{ID: "vms-0123456789abcdef", Manifest: roots[0], Uses: roots[1:]}
	put := func() {
		t.Helper()
		raw, _ := json.Marshal(rec)
		if err := s3.PutRecord(ctx, "snapshots/microvm/"+rec.ID+".json", raw); err != nil {
			t.Fatal(err)
		}
	}
	put()
	if err := s3.PutRecord(ctx, "collectors/microvm.json", []byte(`{"publishes_bases":true}`)); err != nil {
		t.Fatal(err)
	}
	b.age(t, 3*time.Hour)
	if _, _, err := node.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	}
	for _, m := range roots {
		if err := b.restorable(t, m); err != nil {
			t.Fatalf("%s, named by another provider's live snapshot: %v", m, err)
		}
	}
	rec.Deleted = true
	put()
	if _, _, err := node.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	}
	for _, m := range roots {
		if err := b.restorable(t, m); err == nil {
			t.Fatalf("%s, named by a deleted snapshot alone, was not collected", m)
		}
	}
}

// A deleted snapshot's record stays a tombstone until a collection after
// the grace period removes it, so that the records every collection lists
// do not grow with every snapshot ever deleted. A tombstone written
// before tombstones said when (no deleted_at) goes a grace period after
// a node first saw it. The snapshot reads as gone throughout.
func TestSharedTombstonesGoAfterTheGrace(t *testing.T) {
	b := newBucket(t)
	ctx := context.Background()
	const grace = 2 * time.Second
	const oldID = "snap-00000000000000aa"
	node := b.node(t, local.Options{Share: hostkeep.ShareOptions{Reuse: time.Second, Grace: grace}})
	sb := create(t, node, map[string][]byte{"/work/f": randomBytes(t, 4096)})
	snap := snapshot(t, node, sb)
	rec := b.srv.ObjectPath(b.name, b.prefix+"/records/snapshots/local/"+snap+".json")
	other, err := blob.OpenS3(ctx, b.url, blob.S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := other.PutRecord(ctx, "snapshots/local/"+oldID+".json", []byte(`{"id":"`+oldID+`","manifest":"x","deleted":true}`)); err != nil {
		t.Fatal(err)
	}
	old := b.srv.ObjectPath(b.name, b.prefix+"/records/snapshots/local/"+oldID+".json")
	deleted := time.Now()
	if err := node.DeleteSnapshot(ctx, snap); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(rec)
	if err != nil {
		t.Fatalf("no tombstone right after the deletion: %v", err)
	}
	var m hostkeep.SnapMeta
	if err := json.Unmarshal(raw, &m); err != nil || !m.Deleted || m.DeletedAt.Before(deleted.Add(-time.Second)) {
		t.Fatalf("the tombstone: %s (%v)", raw, err)
	}
	if _, err := node.GetSnapshot(ctx, snap); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a deleted snapshot: %v", err)
	}
	// Within the grace period a collection keeps both.
	if _, _, err := node.CollectBlobs(ctx); err != nil {
		t.Fatal(err)
	}
	if time.Since(deleted) < grace {
		for _, p := range []string{rec, old} {
			if _, err := os.Stat(p); err != nil {
				t.Fatalf("a tombstone younger than the grace period was removed: %v", err)
			}
		}
	}
	testwait.Until(t, "collections remove both tombstones once older than the grace period", time.Minute, func() bool {
		if _, _, err := node.CollectBlobs(ctx); err != nil {
			t.Fatal(err)
		}
		_, err1 := os.Stat(rec)
		_, err2 := os.Stat(old)
		return errors.Is(err1, fs.ErrNotExist) && errors.Is(err2, fs.ErrNotExist)
	})
	if time.Since(deleted) < grace {
		t.Fatalf("the tombstone went %s after the deletion, within the grace period of %s", time.Since(deleted), grace)
	}
	if _, err := node.GetSnapshot(ctx, snap); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a deleted snapshot, its tombstone gone: %v", err)
	}
	if found, err := node.FindSnapshots(ctx, sb, ""); err != nil || len(found) != 0 {
		t.Fatalf("FindSnapshots after: %v %v", found, err)
	}
}

// A snapshot's deletion collects the shared store only if this node has
// not collected within CollectEvery: a collection walks every blob of
// the grace period to free only older ones. The blobs left wait for a
// later collection, which an explicit one is. With a negative
// CollectEvery every deletion collects.
func TestSharedDeletionsCollectAtMostEveryCollectEvery(t *testing.T) {
	for _, every := range []time.Duration{0, -1} {
		t.Run(fmt.Sprintf("every=%s", every), func(t *testing.T) {
			b := newBucket(t)
			ctx := context.Background()
			node := b.node(t, local.Options{Share: hostkeep.ShareOptions{CollectEvery: every}})
			first := snapshot(t, node, create(t, node, map[string][]byte{"/work/a": randomBytes(t, 4096)}))
			if err := node.DeleteSnapshot(ctx, first); err != nil { // a collection: the node's first
				t.Fatal(err)
			}
			sb := create(t, node, map[string][]byte{"/work/garbage": randomBytes(t, 4<<20)})
			g := snapshot(t, node, sb)
			if err := node.Delete(ctx, sb); err != nil {
				t.Fatal(err)
			}
			b.age(t, 3*time.Hour)
			before := b.packBytes(t)
			if err := node.DeleteSnapshot(ctx, g); err != nil {
				t.Fatal(err)
			}
			freed := before - b.packBytes(t)
			if every < 0 {
				if freed < 4<<20 {
					t.Fatalf("a deletion with a negative CollectEvery freed %d bytes, want the snapshot's 4 MiB", freed)
				}
				return
			}
			if freed != 0 {
				t.Fatalf("a deletion right after a collection freed %d bytes: it collected again", freed)
			}
			if _, _, err := node.CollectBlobs(ctx); err != nil {
				t.Fatal(err)
			}
			if freed := before - b.packBytes(t); freed < 4<<20 {
				t.Fatalf("the explicit collection after it freed %d bytes, want the snapshot's 4 MiB", freed)
			}
		})
	}
}
