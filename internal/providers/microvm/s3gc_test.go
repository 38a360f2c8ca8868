package microvm_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"stasis/internal/providers/hostkeep"
	"stasis/internal/providers/local"
	"stasis/internal/providers/microvm"
	"stasis/internal/s3test"
	"stasis/internal/stasistest"
	"stasis/internal/storage/blob"
	"stasis/internal/storage/cas"
	"stasis/internal/testwait"
	"stasis/sandbox"
)

// vmBucket is one S3 bucket prefix that several nodes (providers on state
// directories of their own) share, on the test's Versity Gateway, with a
// grace period of seconds (ShareOptions): a collection frees what nothing
// marks as soon as it is that old.
type vmBucket struct {
	srv       *s3test.Server
	name, url string
	prefix    string
	share     hostkeep.ShareOptions
}

func newVMBucket(t *testing.T) *vmBucket {
	url, srv, bucket := s3Blobs(t)
	return &vmBucket{srv: srv, name: bucket, url: url, prefix: "vms",
		share: hostkeep.ShareOptions{Reuse: time.Second, Grace: 3 * time.Second}}
}

// node opens a microVM provider on a fresh state directory over the
// bucket; its sandboxes are deleted and it is closed when t ends.
func (b *vmBucket) node(t *testing.T, o microvm.Options) *microvm.Provider {
	t.Helper()
	o.Blobs, o.Share = b.url, b.share
	p := newProvider(t, o)
	t.Cleanup(func() { deleteAll(t, p) })
	return p
}

// deleteAll deletes p's sandboxes and closes p.
func deleteAll(t *testing.T, p sandbox.Provider) {
	ctx := context.Background()
	infos, _ := p.List(ctx, nil)
	for _, in := range infos {
		if err := p.Delete(ctx, in.ID); err != nil {
			t.Errorf("delete %s: %v", in.ID, err)
		}
	}
	p.Close()
}

// packBytes is the size of every pack object under the prefix.
func (b *vmBucket) packBytes(t *testing.T) int64 {
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

// collectUntil collects with c until no manifest of gone is in the
// bucket (blobs younger than the grace period are kept: the last ones
// stored may need a moment more), and returns the blobs and bytes the
// collections freed.
func (b *vmBucket) collectUntil(t *testing.T, c sandbox.Provider, gone ...string) (int, int64) {
	t.Helper()
	var n int
	var freed int64
	testwait.Until(t, fmt.Sprintf("a collection frees %v", gone), time.Minute, func() bool {
		k, f, err := c.CollectBlobs(ctx)
		if err != nil {
			t.Fatal(err)
		}
		n, freed = n+k, freed+f
		s, err := blob.OpenS3(ctx, b.url, blob.S3Options{}) // a view of the bucket as it is now
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		for _, m := range gone {
			if has, err := s.Has(ctx, m); err != nil || has {
				return false
			}
		}
		return true
	})
	return n, freed
}

// record is the record of snapshot id of provider, as the bucket holds
// it.
func (b *vmBucket) record(t *testing.T, provider, id string) hostkeep.SnapMeta {
	t.Helper()
	raw, err := os.ReadFile(b.srv.ObjectPath(b.name, b.prefix+"/records/snapshots/"+provider+"/"+id+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var m hostkeep.SnapMeta
	if err := json.Unmarshal(raw, &m); err != nil || m.Manifest == "" {
		t.Fatalf("record of %s: %s %v", id, raw, err)
	}
	return m
}

// pin is the base sandbox id of state directory home published.
func (b *vmBucket) pin(t *testing.T, home, id string) []string {
	t.Helper()
	homeID, err := hostkeep.HomeID(home)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(b.srv.ObjectPath(b.name, b.prefix+"/records/bases/microvm/"+homeID+"/"+id+".json"))
	if err != nil {
		t.Fatalf("the published base of %s: %v", id, err)
	}
	var p struct {
		Manifests []string `json:"manifests"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		t.Fatal(err)
	}
	return p.Manifests
}

// restorable says whether manifest restores whole from the bucket, as a
// node without a read cache reads it.
func (b *vmBucket) restorable(t *testing.T, manifest string) error {
	t.Helper()
	s, err := blob.OpenS3(ctx, b.url, blob.S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, err = cas.New(s).Restore(ctx, manifest, filepath.Join(t.TempDir(), "r"))
	return err
}

// counting starts a process in guest id that counts in a file, and
// returns its identity (guestProcess).
func counting(t *testing.T, p sandbox.Provider, id string) string {
	t.Helper()
	sh(t, p, id, `setsid sh -c 'echo $$ > /tmp/pid.new; mv /tmp/pid.new /tmp/pid; i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done' </dev/null >/dev/null 2>&1 &
		until [ -s /tmp/count ] && [ -s /tmp/pid ]; do sleep 0.05; done`)
	return guestProcess(t, p, id)
}

// goesOn checks that sandbox id, forked from a guest whose counting
// process was ident, runs that process in place, counting on, and reads
// its image's files.
func goesOn(t *testing.T, p sandbox.Provider, id, ident string) {
	t.Helper()
	if got := guestProcess(t, p, id); got != ident {
		t.Fatalf("the process in %s is %q, before it was %q: not resumed in place", id, got, ident)
	}
	first := count(t, p, id)
	waitFor(t, "the counter goes on", func() bool { return count(t, p, id) > first })
	if got := sh(t, p, id, "cat /etc/os-release"); !strings.Contains(got, stasistest.BusyboxText) {
		t.Fatalf("the image's /etc/os-release in %s reads %q", id, got)
	}
}

func vmSnapshot(t *testing.T, p sandbox.Provider, id string) sandbox.SnapshotInfo {
	t.Helper()
	s, err := p.Snapshot(ctx, id, "")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func vmFork(t *testing.T, p sandbox.Provider, snap string) string {
	t.Helper()
	infos, err := p.Fork(ctx, snap, 1, sandbox.ForkSpec{Expiry: time.Now().Add(15 * time.Minute)})
	if err != nil {
		t.Fatalf("fork %s: %v", snap, err)
	}
	return infos[0].ID
}

const garbageMiB = 8

// TestSharedCollectsMicroVMSnapshots: on a bucket prefix of microVM
// snapshots, deleting a snapshot whose sandbox is gone frees its state's
// own blobs once they are past the grace period (ShareOptions); a
// sandbox forked on another node from a snapshot that is then deleted
// and collected has kept what it builds on (the saved state and the
// image's disk, published as its base), runs on, and snapshots again:
// on that base, its disk not stored again, and a third node with a cold
// cache forks the new snapshot with its process in place.
func TestSharedCollectsMicroVMSnapshots(t *testing.T) {
	b := newVMBucket(t)
	homeA, homeB := t.TempDir(), t.TempDir()
	nodeA := b.node(t, microvm.Options{Home: homeA, MemMiB: 256})
	src, err := nodeA.Create(ctx, sandbox.Spec{Image: stasistest.BusyboxImage(t), Expiry: time.Now().Add(15 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	x := src.ID
	ident := counting(t, nodeA, x)
	s1 := vmSnapshot(t, nodeA, x).ID
	rec1 := b.record(t, microvm.Name, s1)
	if len(rec1.Uses) != 1 {
		t.Fatalf("snapshot %s uses %v: want its image's disk stored", s1, rec1.Uses)
	}
	if got := b.pin(t, homeA, x); !slices.Equal(got, rec1.Roots()) {
		t.Fatalf("the published base of %s after its snapshot: %v, want %v", x, got, rec1.Roots())
	}
	// Garbage in the guest's memory, which only the next snapshot holds.
	sh(t, nodeA, x, fmt.Sprintf("head -c %d /dev/urandom > /tmp/garbage", garbageMiB<<20))
	g := vmSnapshot(t, nodeA, x).ID
	recG := b.record(t, microvm.Name, g)

	nodeB := b.node(t, microvm.Options{Home: homeB})
	y := vmFork(t, nodeB, s1)
	if got := b.pin(t, homeB, y); !slices.Equal(got, rec1.Roots()) {
		t.Fatalf("the published base of fork %s: %v, want its snapshot's state and disk %v", y, got, rec1.Roots())
	}

	if err := nodeA.Delete(ctx, x); err != nil {
		t.Fatal(err)
	}
	before := b.packBytes(t)
	for _, s := range []string{g, s1} {
		if err := nodeA.DeleteSnapshot(ctx, s); err != nil {
			t.Fatal(err)
		}
	}
	n, freed := b.collectUntil(t, nodeA, recG.Manifest)
	after := b.packBytes(t)
	t.Logf("the collections after the deletions freed %d blobs, %d bytes more; packs %d → %d bytes", n, freed, before, after)
	if before-after < garbageMiB<<20 {
		t.Fatalf("packs %d → %d bytes: want the deleted snapshot's %d MiB of garbage gone", before, after, garbageMiB)
	}
	if err := b.restorable(t, recG.Manifest); err == nil {
		t.Fatalf("the deleted snapshot %s still restores", g)
	}
	for _, m := range rec1.Roots() {
		if err := b.restorable(t, m); err != nil {
			t.Fatalf("%s, the published base of fork %s, lost blobs to the collection: %v", m, y, err)
		}
	}

	// The fork runs on and snapshots again; its disk is not stored again.
	goesOn(t, nodeB, y, ident)
	s3 := vmSnapshot(t, nodeB, y)
	rec3 := b.record(t, microvm.Name, s3.ID)
	t.Logf("the fork's snapshot on its base: %d bytes, %d new", s3.Bytes, s3.NewBytes)
	if !slices.Equal(rec3.Uses, rec1.Uses) {
		t.Fatalf("the fork's snapshot uses %v, want the disk it was forked with, %v", rec3.Uses, rec1.Uses)
	}
	if got := b.pin(t, homeB, y); !slices.Equal(got, rec3.Roots()) {
		t.Fatalf("the published base of %s after its snapshot: %v, want %v", y, got, rec3.Roots())
	}
	nodeC := b.node(t, microvm.Options{})
	goesOn(t, nodeC, vmFork(t, nodeC, s3.ID), ident)
}

// TestSharedMixedPrefix: a bucket prefix holding snapshots of local and
// microVM nodes is collected, by a node of either provider: the live
// snapshots of both (a microVM snapshot's saved state and its image's
// disk, which its record alone names once its sandbox is gone) are kept
// and fork on nodes with cold caches, the deleted ones of both are
// freed.
func TestSharedMixedPrefix(t *testing.T) {
	b := newVMBucket(t)
	vm := b.node(t, microvm.Options{MemMiB: 256})
	newLocal := func() *local.Provider {
		t.Helper()
		p, err := local.New(local.Options{Home: t.TempDir(), Exe: stasistest.Exe(), ExeEnv: stasistest.Env, Blobs: b.url, Share: b.share})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { deleteAll(t, p) })
		return p
	}
	loc := newLocal()

	src, err := vm.Create(ctx, sandbox.Spec{Image: stasistest.BusyboxImage(t), Expiry: time.Now().Add(15 * time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	ident := counting(t, vm, src.ID)
	k := vmSnapshot(t, vm, src.ID).ID
	recK := b.record(t, microvm.Name, k)
	sh(t, vm, src.ID, fmt.Sprintf("head -c %d /dev/urandom > /tmp/garbage", garbageMiB<<20))
	g := vmSnapshot(t, vm, src.ID).ID
	recG := b.record(t, microvm.Name, g)
	if err := vm.Delete(ctx, src.ID); err != nil {
		t.Fatal(err)
	}

	localSnap := func(file string, size int) (string, []byte) {
		t.Helper()
		in, err := loc.Create(ctx, sandbox.Spec{Expiry: time.Now().Add(15 * time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		data := make([]byte, size)
		if _, err := rand.Read(data); err != nil {
			t.Fatal(err)
		}
		if err := loc.WriteFile(ctx, in.ID, file, data, 0o644); err != nil {
			t.Fatal(err)
		}
		s := vmSnapshot(t, loc, in.ID).ID
		if err := loc.Delete(ctx, in.ID); err != nil {
			t.Fatal(err)
		}
		return s, data
	}
	ls, kept := localSnap("/work/kept", 1<<20)
	lg, _ := localSnap("/work/garbage", 4<<20)
	lsManifest, lgManifest := b.record(t, local.Name, ls).Manifest, b.record(t, local.Name, lg).Manifest

	before := b.packBytes(t)
	for _, del := range []func() error{
		func() error { return vm.DeleteSnapshot(ctx, g) },
		func() error { return loc.DeleteSnapshot(ctx, lg) },
	} {
		if err := del(); err != nil {
			t.Fatal(err)
		}
	}
	// What the deletions collected, and then a local node's collection.
	n, freed := b.collectUntil(t, loc, recG.Manifest, lgManifest)
	after := b.packBytes(t)
	t.Logf("the local node's collections freed %d blobs, %d bytes; packs %d → %d bytes", n, freed, before, after)
	if want := int64(garbageMiB+4) << 20; before-after < want {
		t.Fatalf("packs %d → %d bytes: want both deleted snapshots' garbage (%d bytes) gone", before, after, want)
	}
	if _, _, err := vm.CollectBlobs(ctx); err != nil {
		t.Fatalf("the microVM node's collection of the mixed prefix: %v", err)
	}
	for _, m := range []string{recG.Manifest, lgManifest} {
		if err := b.restorable(t, m); err == nil {
			t.Errorf("deleted snapshot %s still restores", m)
		}
	}
	for _, m := range append(recK.Roots(), lsManifest) {
		if err := b.restorable(t, m); err != nil {
			t.Fatalf("live %s after the collections: %v", m, err)
		}
	}

	// Both live snapshots fork on nodes with cold caches.
	vm2 := b.node(t, microvm.Options{})
	goesOn(t, vm2, vmFork(t, vm2, k), ident)
	loc2 := newLocal()
	f := vmFork(t, loc2, ls)
	if got, err := loc2.ReadFile(ctx, f, "/work/kept"); err != nil || !slices.Equal(got, kept) {
		t.Fatalf("the local snapshot's file in its fork: %d bytes, %v", len(got), err)
	}
}
