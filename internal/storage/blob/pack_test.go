package blob

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/zeebo/blake3"
)

// blobOf is a blob of n bytes made of s, and its real key.
func blobOf(s string, n int) (string, []byte) {
	data := bytes.Repeat([]byte(s), n)[:n]
	sum := blake3.Sum256(data)
	return fmt.Sprintf("%x", sum[:]), data
}

// packFiles lists the packs directory's names, sorted.
func packFiles(t *testing.T, d *Dir) []string {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(d.Path(), packsDir))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	return names
}

// A Dir's batch is one pack and its index, whatever number of blobs it
// holds (the conformance tests check that another Dir finds them all).
func TestBatchIsOnePack(t *testing.T) {
	d := newDir(t)
	blobs := map[string][]byte{}
	for i := 0; i < 200; i++ {
		k, data := blobOf(strconv.Itoa(i), 1+i*37)
		blobs[k] = data
	}
	stageAll(t, d, blobs)
	files := packFiles(t, d)
	if len(files) != 2 || !strings.HasSuffix(files[0], idxExt) || !strings.HasSuffix(files[1], packExt) {
		t.Fatalf("packs directory holds %v, want one index and one pack", files)
	}
	if subs, _ := os.ReadDir(d.Path()); len(subs) != 2 { // packs and .staging
		t.Fatalf("store directory holds %v", subs)
	}
}

// However soon after its own last look, a Dir sees another's commit and
// delete (the packs directory's mtime says so), and a delete of every
// blob leaves no pack file.
func TestPacksSeenAcrossDirsAtOnce(t *testing.T) {
	ctx := context.Background()
	a := newDir(t)
	b, err := NewDir(a.Path())
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20; i++ {
		k, data := blobOf("round"+strconv.Itoa(i), 100)
		if has, _ := a.Has(ctx, k); has {
			t.Fatalf("round %d: %s is there before it was stored", i, k[:8])
		}
		stageAll(t, b, map[string][]byte{k: data})
		if has, err := a.Has(ctx, k); !has || err != nil {
			t.Fatalf("round %d: another Dir's commit is not seen: %v %v", i, has, err)
		}
		if err := b.Delete(ctx, k); err != nil {
			t.Fatal(err)
		}
		if has, err := a.Has(ctx, k); has || err != nil {
			t.Fatalf("round %d: another Dir's delete is not seen: %v %v", i, has, err)
		}
	}
	if files := packFiles(t, a); len(files) != 0 {
		t.Fatalf("packs left after every blob was deleted: %v", files)
	}
}

func errorsIsNotFound(err error) bool {
	return err != nil && strings.Contains(err.Error(), ErrNotFound.Error())
}

// Deleting some blobs of a Dir's pack writes a dead list, replaced by the
// next; past half its bytes, the pack is rewritten with the live ones;
// with none live it is removed (the conformance tests check what each
// step leaves visible).
func TestDeleteFromPacksLayout(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	var keys []string
	blobs := map[string][]byte{}
	for i := 0; i < 10; i++ {
		k, data := blobOf("blob"+strconv.Itoa(i), 1000)
		keys = append(keys, k)
		blobs[k] = data
	}
	stageAll(t, d, blobs)
	check := func(step string, files func([]string) bool) {
		t.Helper()
		if f := packFiles(t, d); !files(f) {
			t.Fatalf("%s: packs directory holds %v", step, f)
		}
	}
	if err := d.DeleteKeys(ctx, keys[:3]); err != nil {
		t.Fatal(err)
	}
	check("three deleted", func(f []string) bool {
		return len(f) == 3 && strings.HasSuffix(f[0], deadExt+"1")
	})
	if err := d.DeleteKeys(ctx, []string{keys[3], keys[4], keys[0]}); err != nil {
		t.Fatal(err)
	}
	check("five deleted", func(f []string) bool {
		return len(f) == 3 && strings.HasSuffix(f[0], deadExt+"2")
	})
	old := packFiles(t, d)
	if err := d.DeleteKeys(ctx, keys[5:6]); err != nil {
		t.Fatal(err)
	}
	check("six deleted", func(f []string) bool {
		return len(f) == 2 && f[0] != old[1] && strings.HasSuffix(f[0], idxExt)
	})
	if fi, err := os.Stat(filepath.Join(d.Path(), packsDir, strings.TrimSuffix(packFiles(t, d)[0], idxExt)+packExt)); err != nil || fi.Size() != 4000 {
		t.Fatalf("the rewritten pack: %v, %v; want 4000 bytes", fi, err)
	}
	if err := d.DeleteKeys(ctx, keys); err != nil {
		t.Fatal(err)
	}
	check("all deleted", func(f []string) bool { return len(f) == 0 })
}

// What a crash leaves in the packs directory: a pack without its index
// (invisible, removed by NewDir once old), a superseded dead list
// (removed), a damaged index (its blobs read as missing, nothing fails).
func TestPackLeftovers(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	k1, b1 := blobOf("one", 10)
	k2, b2 := blobOf("two", 10)
	stageAll(t, d, map[string][]byte{k1: b1})
	stageAll(t, d, map[string][]byte{k2: b2})
	dir := filepath.Join(d.Path(), packsDir)
	orphanOld := filepath.Join(dir, strings.Repeat("1", 32)+packExt)
	orphanNew := filepath.Join(dir, strings.Repeat("2", 32)+packExt)
	for _, p := range []string{orphanOld, orphanNew} {
		if err := os.WriteFile(p, []byte("half a commit"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	past := time.Now().Add(-2 * staleStaging)
	if err := os.Chtimes(orphanOld, past, past); err != nil {
		t.Fatal(err)
	}
	// The pack holding k1: a stale dead list beside the current one.
	idx := ""
	for _, f := range packFiles(t, d) {
		if strings.HasSuffix(f, idxExt) {
			if e, _ := readIndex(filepath.Join(dir, f)); len(e) == 1 && e[0].key.String() == k1 {
				idx = strings.TrimSuffix(f, idxExt)
			}
		}
	}
	var none []rawKey
	for _, g := range []string{"1", "2"} {
		if err := os.WriteFile(filepath.Join(dir, idx+deadExt+g), encodeDead(none), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// Temporary dead lists a crash left before their rename: the old one goes.
	tmpOld := filepath.Join(dir, "."+idx+deadExt+"3.tmp111")
	tmpNew := filepath.Join(dir, "."+idx+deadExt+"3.tmp222")
	for _, p := range []string{tmpOld, tmpNew} {
		if err := os.WriteFile(p, []byte("half a dead list"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chtimes(tmpOld, past, past); err != nil {
		t.Fatal(err)
	}
	fresh, err := NewDir(d.Path())
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]bool{orphanOld: false, orphanNew: true, filepath.Join(dir, idx+deadExt+"1"): false, filepath.Join(dir, idx+deadExt+"2"): true, tmpOld: false, tmpNew: true} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Fatalf("%s: there is %v, want %v", filepath.Base(p), err == nil, want)
		}
	}
	if got := walkStore(t, fresh); len(got) != 2 {
		t.Fatalf("Walk found %v", got)
	}
	// A damaged index: its blob reads as missing; the rest is served.
	p := filepath.Join(dir, idx+idxExt)
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	b[len(idxMagic)+3] ^= 1
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	again, err := NewDir(d.Path())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := again.Get(ctx, k1); !errorsIsNotFound(err) {
		t.Fatalf("Get from a pack with a damaged index: %v", err)
	}
	if got, err := again.Get(ctx, k2); err != nil || !bytes.Equal(got, b2) {
		t.Fatalf("Get from an intact pack: %v", err)
	}
}

// A batch whose write failed does not commit.
func TestBatchWriteFailureRefusesCommit(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	k1, b1 := blobOf("one", 10)
	k2, b2 := blobOf("two", 10)
	b := d.NewBatch().(*packBatch)
	if err := b.Stage(ctx, k1, b1); err != nil {
		t.Fatal(err)
	}
	b.f.Close() // the next write fails
	if err := b.Stage(ctx, k2, b2); err == nil {
		t.Fatal("a write to a closed pack succeeded")
	}
	if err := b.Commit(ctx); err == nil || !strings.Contains(err.Error(), "staged write failed") {
		t.Fatalf("Commit after a failed write: %v", err)
	}
	b.Abort()
	if has, _ := d.Has(ctx, k1); has {
		t.Fatal("a blob of a failed batch is visible")
	}
	if ents, _ := os.ReadDir(filepath.Join(d.Path(), stagingDir)); len(ents) != 0 {
		t.Fatalf("staging left behind: %v", ents)
	}
}

// The index and dead-list encodings round-trip, and the decoders refuse
// what a damaged or hostile file may hold.
func TestPackEncodings(t *testing.T) {
	var k1, k2 rawKey
	k1[0], k2[0] = 1, 2
	entries := []packEntry{{k1, 0, 10}, {k2, 10, 0}}
	got, err := decodeIndex(encodeIndex(entries))
	if err != nil || len(got) != 2 || got[1] != entries[1] {
		t.Fatalf("index round trip: %v %v", got, err)
	}
	dead, err := decodeDead(encodeDead([]rawKey{k2, k1}))
	if err != nil || len(dead) != 2 || dead[0] != k1 {
		t.Fatalf("dead list round trip: %v %v", dead, err)
	}
	bad := map[string][]byte{
		"empty":       nil,
		"cut short":   encodeIndex(entries)[:30],
		"overlapping": encodeIndex([]packEntry{{k1, 0, 10}, {k2, 5, 10}}),
		"repeated":    encodeIndex([]packEntry{{k1, 0, 10}, {k1, 10, 10}}),
		"dead list":   encodeDead([]rawKey{k1}),
	}
	for what, b := range bad {
		if _, err := decodeIndex(b); err == nil {
			t.Errorf("decodeIndex took %s", what)
		}
	}
	if _, err := decodeDead(encodeIndex(entries)); err == nil {
		t.Error("decodeDead took an index")
	}
}

// A pack that cannot be read whole when it is due for its rewrite keeps
// its place with a dead list: the delete succeeds, the blobs it can still
// serve are served.
func TestDamagedPackIsNotRewritten(t *testing.T) {
	ctx := context.Background()
	d := newDir(t)
	var keys []string
	blobs := map[string][]byte{}
	for i := 0; i < 4; i++ {
		k, data := blobOf("dmg"+strconv.Itoa(i), 1000)
		keys = append(keys, k)
		blobs[k] = data
	}
	stageAll(t, d, blobs)
	// Cut the pack short inside the blob that comes last in it.
	var last, file string
	var lastOff int64 = -1
	for _, k := range keys {
		f, off, _, err := d.Locate(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if off > lastOff {
			last, lastOff, file = k, off, f
		}
	}
	if err := os.Truncate(file, lastOff+500); err != nil {
		t.Fatal(err)
	}
	var doomed []string
	for _, k := range keys {
		if k != last && len(doomed) < 3 {
			doomed = append(doomed, k)
		}
	}
	if err := d.DeleteKeys(ctx, doomed); err != nil {
		t.Fatalf("delete from a damaged pack: %v", err)
	}
	if f := packFiles(t, d); len(f) != 3 || !strings.HasSuffix(f[0], deadExt+"1") {
		t.Fatalf("packs directory holds %v, want the damaged pack with a dead list", f)
	}
	if got, err := d.Get(ctx, last); err != nil || len(got) != 500 {
		t.Fatalf("the damaged blob reads %d bytes, %v; want the 500 there are", len(got), err)
	}
	if got := walkStore(t, d); len(got) != 1 {
		t.Fatalf("Walk found %d blobs, want 1", len(got))
	}
}
