package cas

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/restic/chunker"
	"github.com/zeebo/blake3"

	"stasis/internal/storage/blob"
)

var ctx = context.Background()

// The store's addresses are BLAKE3-256 digests: they must not change with
// the library that computes them (the values were computed with another
// BLAKE3 implementation than the one the store uses).
func TestHashKeyIsBLAKE3(t *testing.T) {
	big := make([]byte, 1<<20+13) // many BLAKE3 chunks, the SIMD paths, a partial last chunk
	for i := range big {
		big[i] = byte(i % 251)
	}
	for _, c := range []struct {
		in   []byte
		want string
	}{
		{nil, "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"},
		{[]byte("abc"), "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"},
		{big, "47fc4d04065930f061234d4fdcffd297a9f720fb222a190b6dd1275339d0f3b2"},
	} {
		if got := hashKey(c.in); got != c.want {
			t.Errorf("hashKey of %d bytes = %s, want %s", len(c.in), got, c.want)
		}
	}
}

func TestPolynomial(t *testing.T) {
	h := blake3.New()
	h.Write([]byte("stasis cas chunker polynomial v1"))
	p, err := chunker.DerivePolynomial(h.Digest())
	if err != nil {
		t.Fatal(err)
	}
	if p != polynomial || !polynomial.Irreducible() || polynomial.Deg() != 53 {
		t.Fatalf("derived %#x (irreducible %v, degree %d), constant %#x", uint64(p), polynomial.Irreducible(), polynomial.Deg(), uint64(polynomial))
	}
}

func TestRoundTripEveryKind(t *testing.T) {
	s, _ := newDirStore(t)
	s.racy = 0
	base := t.TempDir()
	orig := filepath.Join(base, "tree")
	must(t, os.Mkdir(orig, 0o750))
	skipped := makeRichTree(t, orig)

	id, st, err := s.Snapshot(ctx, orig, "")
	if err != nil {
		t.Fatal(err)
	}
	want := Stats{Files: 18, Dirs: 11, Symlinks: 6, Hardlinks: 4}
	if st.Files != want.Files || st.Dirs != want.Dirs || st.Symlinks != want.Symlinks || st.Hardlinks != want.Hardlinks {
		t.Errorf("snapshot counts %d files, %d dirs, %d symlinks, %d hardlinks; want %d, %d, %d, %d",
			st.Files, st.Dirs, st.Symlinks, st.Hardlinks, want.Files, want.Dirs, want.Symlinks, want.Hardlinks)
	}
	if strings.Join(st.Skipped, "|") != strings.Join(skipped, "|") {
		t.Errorf("skipped %q, want %q", st.Skipped, skipped)
	}
	if st.ReadBytes != st.Bytes || st.ReusedFiles != 0 {
		t.Errorf("first snapshot read %d of %d bytes, reused %d files", st.ReadBytes, st.Bytes, st.ReusedFiles)
	}
	// 20 MiB of zeros is at most three distinct chunks, dup1 and a/dup2
	// share theirs: the store holds well under the tree's size.
	if st.NewBytes >= st.Bytes-15<<20 {
		t.Errorf("wrote %d bytes for a %d-byte tree with 20 MiB of zeros", st.NewBytes, st.Bytes)
	}

	dst := filepath.Join(base, "restored")
	rst, err := s.Restore(ctx, id, dst)
	if err != nil {
		t.Fatal(err)
	}
	compareTrees(t, orig, dst, skipped)
	if rst.Files != st.Files || rst.Dirs != st.Dirs || rst.Symlinks != st.Symlinks || rst.Hardlinks != st.Hardlinks ||
		rst.Bytes != st.Bytes || rst.ReadBytes != st.Bytes {
		t.Errorf("restore stats %+v do not match snapshot stats %+v", rst, st)
	}
	// A second fork of the same snapshot, and a snapshot of the restored
	// tree holds the same content (only its manifest is new: inodes differ).
	dst2 := filepath.Join(base, "restored2")
	if _, err := s.Restore(ctx, id, dst2); err != nil {
		t.Fatal(err)
	}
	compareTrees(t, orig, dst2, skipped)
	if _, st2, err := s.Snapshot(ctx, dst, ""); err != nil || st2.NewBlobs != 1 {
		t.Fatalf("snapshot of the restored tree: %d new blobs (want the manifest only), %v", st2.NewBlobs, err)
	}
	// The unchanged tree snapshots to the same id, reading nothing.
	id3, st3, err := s.Snapshot(ctx, orig, id)
	if err != nil || id3 != id || st3.ReadBytes != 0 || st3.NewBlobs != 0 || st3.ReusedFiles != st.Files {
		t.Fatalf("unchanged tree: id %s (first %s), read %d, new blobs %d, reused %d of %d: %v", id3, id, st3.ReadBytes, st3.NewBlobs, st3.ReusedFiles, st.Files, err)
	}
	noSiblings(t, base, "tree", "restored", "restored2")
}

func TestEmptyTree(t *testing.T) {
	s, _ := newDirStore(t)
	base := t.TempDir()
	orig := filepath.Join(base, "empty")
	must(t, os.Mkdir(orig, 0o711))
	setTime(t, orig, 1_234_567_890, 5)
	id, st, err := s.Snapshot(ctx, orig, "")
	if err != nil || st.Files+st.Dirs != 0 || st.NewBlobs != 1 {
		t.Fatalf("snapshot of an empty tree: %+v %v", st, err)
	}
	if _, err := s.Restore(ctx, id, filepath.Join(base, "out")); err != nil {
		t.Fatal(err)
	}
	compareTrees(t, orig, filepath.Join(base, "out"), nil)
}

// manyFiles writes n files of pseudo-random sizes and content under root,
// and a 5 MiB file big.bin, and returns the paths of the small ones.
func manyFiles(t *testing.T, root string, n int, seed uint64) []string {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 7))
	var paths []string
	for i := 0; i < n; i++ {
		p := filepath.Join(root, fmt.Sprintf("d%02d/sub%d/f%04d", i%10, i%3, i))
		writeFile(t, p, randBytes(r, 1+r.IntN(40<<10)))
		paths = append(paths, p)
	}
	writeFile(t, filepath.Join(root, "big.bin"), randBytes(r, 5<<20))
	return paths
}

func blobLen(t *testing.T, d *blob.Dir, key string) int64 {
	t.Helper()
	b, err := d.Get(ctx, key)
	must(t, err)
	return int64(len(b))
}

func TestIncrementalReadsOnlyTheChangedFile(t *testing.T) {
	s, d := newDirStore(t)
	s.racy = 0 // every change below also changes the size, so stat tells it
	base := t.TempDir()
	tree := filepath.Join(base, "tree")
	paths := manyFiles(t, tree, 300, 1)
	id1, st1, err := s.Snapshot(ctx, tree, "")
	if err != nil {
		t.Fatal(err)
	}
	if st1.Files != 301 || st1.ReadBytes != st1.Bytes {
		t.Fatalf("first snapshot: %+v", st1)
	}

	// Rewrite one small file with new content of a new size.
	changed := paths[123]
	newData := bytes.Repeat([]byte("changed "), 2000)
	writeFile(t, changed, newData)
	id2, st2, err := s.Snapshot(ctx, tree, id1)
	if err != nil {
		t.Fatal(err)
	}
	if st2.ReadBytes != int64(len(newData)) || st2.ReusedFiles != 300 {
		t.Fatalf("after changing one file: read %d bytes (want %d), reused %d files (want 300)", st2.ReadBytes, len(newData), st2.ReusedFiles)
	}
	if m2 := blobLen(t, d, id2); st2.NewBlobs != 2 || st2.NewBytes != int64(len(newData))+m2 {
		t.Fatalf("after changing one file: %d new blobs, %d new bytes; want 2 (its chunk and the manifest), %d", st2.NewBlobs, st2.NewBytes, int64(len(newData))+m2)
	}

	// Append to the big file: it is read whole, but content-defined
	// chunking stores only the chunks at its end again.
	big := filepath.Join(tree, "big.bin")
	f, err := os.OpenFile(big, os.O_APPEND|os.O_WRONLY, 0)
	must(t, err)
	_, err = f.Write(randBytes(rand.New(rand.NewPCG(9, 9)), 100<<10))
	must(t, err)
	must(t, f.Close())
	id3, st3, err := s.Snapshot(ctx, tree, id2)
	if err != nil {
		t.Fatal(err)
	}
	fi, _ := os.Stat(big)
	if st3.ReadBytes != fi.Size() || st3.ReusedFiles != 300 {
		t.Fatalf("after appending to big.bin: read %d bytes (want %d), reused %d", st3.ReadBytes, fi.Size(), st3.ReusedFiles)
	}
	old, err := s.Chunks(ctx, id2)
	must(t, err)
	now, err := s.Chunks(ctx, id3)
	must(t, err)
	oldSet := map[string]bool{}
	for _, k := range old {
		oldSet[k] = true
	}
	var fresh int64
	for _, k := range now[1:] {
		if !oldSet[k] {
			fresh += blobLen(t, d, k)
		}
	}
	if st3.NewBytes != fresh+blobLen(t, d, id3) {
		t.Fatalf("after appending: %d new bytes, want %d (new chunks) + manifest", st3.NewBytes, fresh)
	}
	if fresh > fi.Size()/2 {
		t.Fatalf("appending 100 KiB to a 5 MiB file stored %d new chunk bytes", fresh)
	}

	// Each snapshot restores the tree as it was then.
	out3 := filepath.Join(base, "out3")
	if _, err := s.Restore(ctx, id3, out3); err != nil {
		t.Fatal(err)
	}
	compareTrees(t, tree, out3, nil)
	out1 := filepath.Join(base, "out1")
	if _, err := s.Restore(ctx, id1, out1); err != nil {
		t.Fatal(err)
	}
	rel, _ := filepath.Rel(tree, changed)
	if b, _ := os.ReadFile(filepath.Join(out1, rel)); bytes.Equal(b, newData) {
		t.Fatal("the first snapshot restored the changed file's new content")
	}
	if fi1, _ := os.Stat(filepath.Join(out1, "big.bin")); fi1.Size() != 5<<20 {
		t.Fatalf("the first snapshot restored big.bin at %d bytes", fi1.Size())
	}
}

func TestRecentlyChangedFilesAreReadAgain(t *testing.T) {
	s, _ := newDirStore(t)
	tree := t.TempDir()
	manyFiles(t, tree, 20, 2)
	s.racy = time.Hour // every file was changed "just now"
	id1, st1, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	id2, st2, err := s.Snapshot(ctx, tree, id1)
	must(t, err)
	if st2.ReadBytes != st1.Bytes || st2.ReusedFiles != 0 || st2.NewBlobs != 0 || id2 != id1 {
		t.Fatalf("racy files: second snapshot read %d of %d bytes, reused %d, new blobs %d", st2.ReadBytes, st1.Bytes, st2.ReusedFiles, st2.NewBlobs)
	}
	s.racy = 0
	id3, st3, err := s.Snapshot(ctx, tree, id2)
	must(t, err)
	if st3.ReadBytes != st1.Bytes {
		t.Fatalf("the snapshot after racy ones read %d of %d bytes", st3.ReadBytes, st1.Bytes)
	}
	_, st4, err := s.Snapshot(ctx, tree, id3)
	must(t, err)
	if st4.ReadBytes != 0 || st4.ReusedFiles != st1.Files {
		t.Fatalf("settled tree: read %d bytes, reused %d of %d files", st4.ReadBytes, st4.ReusedFiles, st1.Files)
	}
}

func TestPrevChunkGoneIsReadAgainByAnotherStore(t *testing.T) {
	s, d := newDirStore(t)
	s.racy = 0
	tree := t.TempDir()
	writeFile(t, filepath.Join(tree, "keep"), []byte("kept"))
	writeFile(t, filepath.Join(tree, "lost"), []byte("its chunk is deleted"))
	id1, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	// Deleted behind the Store's back (by another process, or damage): a
	// Store that did not write the previous snapshot checks its chunks.
	must(t, d.Delete(ctx, hashKey([]byte("its chunk is deleted"))))
	s = New(d)
	s.racy = 0
	id2, st2, err := s.Snapshot(ctx, tree, id1)
	must(t, err)
	if st2.ReadBytes != int64(len("its chunk is deleted")) || st2.ReusedFiles != 1 || st2.NewBlobs != 1 {
		t.Fatalf("read %d bytes, reused %d, new blobs %d", st2.ReadBytes, st2.ReusedFiles, st2.NewBlobs)
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := s.Restore(ctx, id2, out); err != nil {
		t.Fatal(err)
	}
	compareTrees(t, tree, out, nil)
}

func TestDedupAcrossTrees(t *testing.T) {
	s, d := newDirStore(t)
	base := t.TempDir()
	shared := randBytes(rand.New(rand.NewPCG(3, 3)), 2<<20+777)
	a, b := filepath.Join(base, "a"), filepath.Join(base, "b")
	writeFile(t, filepath.Join(a, "lib/model.bin"), shared)
	writeFile(t, filepath.Join(a, "a.txt"), []byte("only in a"))
	writeFile(t, filepath.Join(b, "other/place/copy.bin"), shared)
	writeFile(t, filepath.Join(b, "b.txt"), []byte("only in b"))
	idA, stA, err := s.Snapshot(ctx, a, "")
	must(t, err)
	idB, stB, err := s.Snapshot(ctx, b, "")
	must(t, err)
	if stA.NewBytes < int64(len(shared)) {
		t.Fatalf("tree a wrote %d bytes, less than its file", stA.NewBytes)
	}
	if stB.ReadBytes != stB.Bytes {
		t.Fatalf("tree b read %d of %d bytes", stB.ReadBytes, stB.Bytes)
	}
	if want := int64(len("only in b")) + blobLen(t, d, idB); stB.NewBlobs != 2 || stB.NewBytes != want {
		t.Fatalf("tree b: %d new blobs, %d new bytes; want 2 (b.txt, manifest), %d", stB.NewBlobs, stB.NewBytes, want)
	}
	union := map[string]bool{}
	for _, id := range []string{idA, idB} {
		ks, err := s.Chunks(ctx, id)
		must(t, err)
		for _, k := range ks {
			union[k] = true
		}
	}
	n := 0
	must(t, d.Walk(ctx, func(string, int64) error { n++; return nil }))
	if n != len(union) {
		t.Fatalf("store holds %d blobs, the two snapshots reference %d", n, len(union))
	}
	out := filepath.Join(base, "outb")
	if _, err := s.Restore(ctx, idB, out); err != nil {
		t.Fatal(err)
	}
	compareTrees(t, b, out, nil)
}

// A damaged chunk fails the restore with ErrCorrupt naming the file and
// the chunk, whether the blob is a loose file or in a pack, and leaves
// nothing behind.
func TestCorruptChunkFailsRestore(t *testing.T) {
	type damage struct {
		do func(t *testing.T, file string, off, size int64)
		// exact: only the victim is damaged, so the error names it;
		// otherwise other blobs in the same file fail too (in a pack,
		// the manifest may be one of them).
		exact, loose, packed bool
	}
	damages := map[string]damage{
		"truncated": {do: func(t *testing.T, file string, off, size int64) {
			must(t, os.Truncate(file, off+size/2))
		}, exact: false, loose: true, packed: true},
		"one byte flipped": {do: func(t *testing.T, file string, off, size int64) {
			f, err := os.OpenFile(file, os.O_RDWR, 0)
			must(t, err)
			b := []byte{0}
			_, err = f.ReadAt(b, off+size/2)
			must(t, err)
			b[0] ^= 0x01
			_, err = f.WriteAt(b, off+size/2)
			must(t, err)
			must(t, f.Close())
		}, exact: true, loose: true, packed: true},
		"one byte longer": {do: func(t *testing.T, file string, off, size int64) {
			f, err := os.OpenFile(file, os.O_APPEND|os.O_WRONLY, 0)
			must(t, err)
			_, err = f.Write([]byte{0})
			must(t, err)
			must(t, f.Close())
		}, exact: true, loose: true},
		"missing": {do: func(t *testing.T, file string, off, size int64) {
			must(t, os.Remove(file))
		}, exact: false, loose: true, packed: true},
	}
	for what, dmg := range damages {
		for _, packed := range []bool{false, true} {
			if packed && !dmg.packed || !packed && !dmg.loose {
				continue
			}
			where := "loose"
			if packed {
				where = "packed"
			}
			t.Run(where+" "+what, func(t *testing.T) {
				s, d := newLooseStore(t)
				if packed {
					s, d = newDirStore(t)
				}
				tree := t.TempDir()
				manyFiles(t, tree, 30, 4)
				id, _, err := s.Snapshot(ctx, tree, "")
				must(t, err)
				m, err := s.loadManifest(ctx, id)
				must(t, err)
				var victim *entry
				for i := range m.Entries {
					if m.Entries[i].Path == "big.bin" {
						victim = &m.Entries[i]
					}
				}
				if victim == nil || len(victim.Chunks) < 3 {
					t.Fatalf("big.bin has no three chunks: %+v", victim)
				}
				key := victim.Chunks[1].Key
				file, off, size := locate(t, d, key)
				if inPack := off != 0 || size != victim.Chunks[1].Size || filepath.Base(file) != key; inPack != packed {
					t.Fatalf("the chunk is at %s+%d (%d bytes): packed is %v, want %v", file, off, size, inPack, packed)
				}
				dmg.do(t, file, off, size)
				base := t.TempDir()
				dst := filepath.Join(base, "out")
				_, err = s.Restore(ctx, id, dst)
				switch msg := fmt.Sprint(err); {
				case dmg.exact && !errors.Is(err, ErrCorrupt):
					t.Fatalf("restore with a %s chunk: %v, want ErrCorrupt", what, err)
				case dmg.exact && !(strings.Contains(msg, `"big.bin"`) && strings.Contains(msg, key) && strings.Contains(msg, "chunk 2 of")):
					t.Fatalf("error does not name the file and the damaged chunk: %v", err)
				case !errors.Is(err, ErrCorrupt) && !errors.Is(err, blob.ErrNotFound):
					t.Fatalf("restore with a %s chunk: %v, want ErrCorrupt or ErrNotFound", what, err)
				}
				noSiblings(t, base) // dst does not exist, no temporary left
			})
		}
	}
}

func TestTamperedManifest(t *testing.T) {
	s, d := newDirStore(t)
	tree := t.TempDir()
	manyFiles(t, tree, 5, 5)
	id, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	p, off, size := locate(t, d, id)
	b, err := os.ReadFile(p)
	must(t, err)
	b[off+size/3] ^= 0x20
	must(t, os.WriteFile(p, b, 0o600))
	base := t.TempDir()
	if _, err := s.Restore(ctx, id, filepath.Join(base, "out")); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), id) {
		t.Fatalf("restore of a tampered manifest: %v, want ErrCorrupt naming it", err)
	}
	noSiblings(t, base)
	if _, err := s.Chunks(ctx, id); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Chunks of a tampered manifest: %v", err)
	}
	if _, _, err := s.Snapshot(ctx, tree, id); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("Snapshot with a tampered prev: %v", err)
	}
	n := 0
	must(t, d.Walk(ctx, func(string, int64) error { n++; return nil }))
	if _, _, err := s.GC(ctx, []string{id}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("GC with a tampered live manifest: %v", err)
	}
	n2 := 0
	must(t, d.Walk(ctx, func(string, int64) error { n2++; return nil }))
	if n2 != n {
		t.Fatalf("a failed GC deleted %d blobs", n-n2)
	}
}

// template is a valid manifest with one chunk (content "hi"), with extra
// entries placed after its first.
func template(extra ...entry) *manifest {
	m := &manifest{Root: meta{Mode: 0o755, Mtime: 3}, Entries: []entry{{Path: "d", Type: typeDir, meta: meta{Mode: 0o755, Mtime: 1}}}}
	m.Entries = append(m.Entries, extra...)
	m.Entries = append(m.Entries, entry{Path: "d/f", Type: typeFile, meta: meta{Mode: 0o644, Mtime: 2}, Size: 2,
		Chunks: []chunkRef{{Key: hashKey([]byte("hi")), Size: 2}}})
	return m
}

func fileAt(p string) entry { return entry{Path: name(p), Type: typeFile, meta: meta{Mode: 0o644}} }

// header is a manifest's bytes up to and including its entry count.
func header(count uint64) []byte {
	b := append([]byte(manifestMagic), 1) // version
	b = appendMeta(b, meta{Mode: 0o755})  // root
	return binary.AppendUvarint(b, count)
}

// unknownFlag sets flag 2 on the template's file entry.
func unknownFlag(good []byte) []byte {
	racy := template()
	racy.Entries[len(racy.Entries)-1].Racy = true
	r := racy.encode()
	for i := range r {
		if r[i] != good[i] {
			r[i] = 2
			return r
		}
	}
	panic("racy flag not found")
}

func badManifests() map[string][]byte {
	hi := []chunkRef{{Key: hashKey([]byte("hi")), Size: 2}}
	enc := func(m *manifest) []byte { return m.encode() }
	good := enc(template())
	// The root's mode, 0755, in three bytes where two do.
	at := len(manifestMagic) + 1
	if good[at] != 0xed || good[at+1] != 0x03 {
		panic("root mode not where expected")
	}
	overlong := append(append(bytes.Clone(good[:at]), 0xed, 0x83, 0x00), good[at+2:]...)
	return map[string][]byte{
		"parent escape":       enc(template(fileAt("../x"))),
		"absolute path":       enc(template(fileAt("/etc/x"))),
		"dotdot inside":       enc(template(fileAt("d/../../x"))),
		"dotdot component":    enc(template(fileAt("d/.."))),
		"dot":                 enc(template(fileAt("."))),
		"empty path":          enc(template(fileAt(""))),
		"double slash":        enc(template(fileAt("d//x"))),
		"trailing slash":      enc(template(fileAt("d/x/"))),
		"leading dot slash":   enc(template(fileAt("./x"))),
		"NUL in path":         enc(template(fileAt("x\x00y"))),
		"long component":      enc(template(fileAt(strings.Repeat("n", 256)))),
		"duplicate":           enc(template(fileAt("d/f"))),
		"child before parent": enc(template(fileAt("e/x"), entry{Path: "e", Type: typeDir})),
		"through a symlink":   enc(template(entry{Path: "l", Type: typeSymlink, Target: "/etc"}, fileAt("l/passwd"))),
		"inside a file":       enc(template(fileAt("x"), fileAt("x/y"))),
		"hardlink to a dir":   enc(template(entry{Path: "h", Type: typeHardlink, Target: "d"})),
		"hardlink to itself":  append(header(1), 3, 0, 1, 'h', 0),
		"hardlink forward":    append(header(2), 3, 0, 1, 'h', 1, 1, 0, 1, 'f', 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
		"empty symlink":       enc(template(entry{Path: "l", Type: typeSymlink})),
		"chunks short":        enc(template(entry{Path: "g", Type: typeFile, Size: 3, Chunks: hi})),
		"chunks long":         enc(template(entry{Path: "g", Type: typeFile, Size: 1, Chunks: hi})),
		"zero-size chunk":     enc(template(entry{Path: "g", Type: typeFile, Chunks: []chunkRef{{Key: hashKey(nil), Size: 0}}})),
		"huge chunk":          enc(template(entry{Path: "g", Type: typeFile, Size: maxChunk + 1, Chunks: []chunkRef{{Key: hashKey(nil), Size: maxChunk + 1}}})),
		"mode bits":           enc(template(entry{Path: "g", Type: typeDir, meta: meta{Mode: 0o17777}})),
		"uid -1":              enc(template(entry{Path: "g", Type: typeDir, meta: meta{UID: math.MaxUint32}})),
		"unknown type":        append(header(1), 4, 0, 1, 'p', 0, 0, 0, 0),
		"unknown flag":        unknownFlag(good),
		"version 2":           append(append([]byte(manifestMagic), 2), good[len(manifestMagic)+1:]...),
		"no header":           good[1:],
		"trailing data":       append(bytes.Clone(good), 0),
		"truncated":           good[:len(good)-1],
		"count too high":      append(header(9), good[len(header(2)):]...),
		"overlong number":     overlong,
		"not a manifest":      []byte("PK\x03\x04"),
		"empty":               nil,
	}
}

func TestRestoreRejectsBadManifests(t *testing.T) {
	mem := newMemStore()
	s := New(mem)
	must(t, mem.Put(ctx, hashKey([]byte("hi")), []byte("hi")))
	good := template().encode()
	must(t, mem.Put(ctx, hashKey(good), good))
	base := t.TempDir()
	if _, err := s.Restore(ctx, hashKey(good), filepath.Join(base, "good")); err != nil {
		t.Fatalf("the valid template does not restore: %v", err)
	}
	must(t, os.RemoveAll(filepath.Join(base, "good")))
	for what, doc := range badManifests() {
		t.Run(what, func(t *testing.T) {
			id := hashKey(doc)
			must(t, mem.Put(ctx, id, doc))
			_, err := s.Restore(ctx, id, filepath.Join(base, "out"))
			if err == nil || !strings.Contains(err.Error(), "manifest") {
				t.Fatalf("restore of a manifest with %s: %v", what, err)
			}
			t.Log(err)
			noSiblings(t, base)
		})
	}
	// The two the brief names, with the path in the message.
	for _, p := range []string{"../x", "/etc/x"} {
		_, err := decodeManifest(template(fileAt(p)).encode())
		if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("%q", p)) {
			t.Fatalf("decode of %q: %v", p, err)
		}
	}
}

func TestRestoreIntoExistingIsRefused(t *testing.T) {
	s, _ := newDirStore(t)
	tree := t.TempDir()
	writeFile(t, filepath.Join(tree, "f"), []byte("x"))
	id, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	base := t.TempDir()
	dir := filepath.Join(base, "dir")
	must(t, os.Mkdir(dir, 0o755))
	file := filepath.Join(base, "file")
	writeFile(t, file, []byte("keep me"))
	link := filepath.Join(base, "link")
	must(t, os.Symlink("nowhere", link))
	for _, dst := range []string{dir, file, link} {
		if _, err := s.Restore(ctx, id, dst); !errors.Is(err, fs.ErrExist) {
			t.Fatalf("restore into existing %s: %v, want fs.ErrExist", dst, err)
		}
	}
	noSiblings(t, base, "dir", "file", "link")
	noSiblings(t, dir)
	if b, _ := os.ReadFile(file); string(b) != "keep me" {
		t.Fatal("refused restore changed the file")
	}
	if _, err := s.Restore(ctx, id, filepath.Join(base, "no/parent")); err == nil {
		t.Fatal("restore below a missing directory succeeded")
	}
}

func TestSnapshotErrors(t *testing.T) {
	s, _ := newDirStore(t)
	tree := t.TempDir()
	writeFile(t, filepath.Join(tree, "f"), []byte("x"))
	if _, _, err := s.Snapshot(ctx, filepath.Join(tree, "missing"), ""); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("snapshot of a missing directory: %v", err)
	}
	if _, _, err := s.Snapshot(ctx, filepath.Join(tree, "f"), ""); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("snapshot of a file: %v", err)
	}
	if _, _, err := s.Snapshot(ctx, tree, "../../etc"); !errors.Is(err, blob.ErrInvalidKey) {
		t.Fatalf("snapshot with a malformed prev: %v", err)
	}
	if _, _, err := s.Snapshot(ctx, tree, strings.Repeat("0", 64)); !errors.Is(err, blob.ErrNotFound) {
		t.Fatalf("snapshot with an unknown prev: %v", err)
	}
	if _, err := s.Restore(ctx, strings.Repeat("0", 64), filepath.Join(t.TempDir(), "x")); !errors.Is(err, blob.ErrNotFound) {
		t.Fatalf("restore of an unknown id: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, _, err := s.Snapshot(cctx, tree, ""); !errors.Is(err, context.Canceled) {
		t.Fatalf("snapshot with a cancelled context: %v", err)
	}
	id, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	base := t.TempDir()
	if _, err := s.Restore(cctx, id, filepath.Join(base, "out")); !errors.Is(err, context.Canceled) {
		t.Fatalf("restore with a cancelled context: %v", err)
	}
	noSiblings(t, base)
}

func TestGC(t *testing.T) {
	s, d := newDirStore(t)
	s.racy = 0
	base := t.TempDir()
	tree, other := filepath.Join(base, "tree"), filepath.Join(base, "other")
	paths := manyFiles(t, tree, 40, 6)
	id1, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	writeFile(t, paths[0], []byte("new content, new size"))
	id2, _, err := s.Snapshot(ctx, tree, id1)
	must(t, err)
	manyFiles(t, other, 10, 7)
	id3, _, err := s.Snapshot(ctx, other, "")
	must(t, err)

	sizes := map[string]int64{}
	must(t, d.Walk(ctx, func(k string, n int64) error { sizes[k] = n; return nil }))
	keep, err := s.Chunks(ctx, id2)
	must(t, err)
	keepSet := map[string]bool{}
	for _, k := range keep {
		keepSet[k] = true
	}
	var wantBlobs int
	var wantBytes int64
	for k, n := range sizes {
		if !keepSet[k] {
			wantBlobs++
			wantBytes += n
		}
	}
	if wantBlobs < 3 { // id1's manifest, paths[0]'s old chunk, all of id3
		t.Fatalf("test setup: only %d blobs to free", wantBlobs)
	}

	// A live id that cannot be read stops GC before it deletes anything.
	if _, _, err := s.GC(ctx, []string{id2, strings.Repeat("a", 64)}); !errors.Is(err, blob.ErrNotFound) || !strings.Contains(err.Error(), "nothing was deleted") {
		t.Fatalf("GC with a missing live id: %v", err)
	}
	n, nb, err := s.GC(ctx, []string{id2})
	must(t, err)
	if n != wantBlobs || nb != wantBytes {
		t.Fatalf("GC freed %d blobs, %d bytes; want %d, %d", n, nb, wantBlobs, wantBytes)
	}
	var left []string
	must(t, d.Walk(ctx, func(k string, _ int64) error { left = append(left, k); return nil }))
	sort.Strings(left)
	sort.Strings(keep)
	if strings.Join(left, ",") != strings.Join(keep, ",") {
		t.Fatalf("after GC the store holds %d blobs, want the %d of the live snapshot", len(left), len(keep))
	}
	out := filepath.Join(base, "out")
	if _, err := s.Restore(ctx, id2, out); err != nil {
		t.Fatalf("restore of the live snapshot after GC: %v", err)
	}
	compareTrees(t, tree, out, nil)
	for _, gone := range []string{id1, id3} {
		if _, err := s.Restore(ctx, gone, filepath.Join(base, "gone")); !errors.Is(err, blob.ErrNotFound) {
			t.Fatalf("restore of a collected snapshot: %v", err)
		}
	}
	if n, _, err := s.GC(ctx, []string{id2}); err != nil || n != 0 {
		t.Fatalf("second GC freed %d: %v", n, err)
	}
	if n, _, err := s.GC(ctx, nil); err != nil || n != len(keep) {
		t.Fatalf("GC with nothing live freed %d of %d: %v", n, len(keep), err)
	}
}

func TestChunksListsManifestAndChunksOnce(t *testing.T) {
	s, _ := newDirStore(t)
	tree := t.TempDir()
	writeFile(t, filepath.Join(tree, "a"), []byte("same"))
	writeFile(t, filepath.Join(tree, "b"), []byte("same"))
	writeFile(t, filepath.Join(tree, "c"), []byte("other"))
	writeFile(t, filepath.Join(tree, "e"), nil)
	id, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	ks, err := s.Chunks(ctx, id)
	must(t, err)
	want := []string{id, hashKey([]byte("same")), hashKey([]byte("other"))}
	if strings.Join(ks, ",") != strings.Join(want, ",") {
		t.Fatalf("Chunks = %v, want %v", ks, want)
	}
}

// BenchmarkHashKey hashes one 256 KiB chunk (the size of a microVM state
// chunk); BenchmarkHashKeyBaseline copies it, the least any store does
// with a chunk's bytes. Compare their MB/s within one run.
func BenchmarkHashKey(b *testing.B) {
	data := make([]byte, 256<<10)
	for i := range data {
		data[i] = byte(i * 31)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		hashKey(data)
	}
}

func BenchmarkHashKeyBaseline(b *testing.B) {
	data, dst := make([]byte, 256<<10), make([]byte, 256<<10)
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		copy(dst, data)
	}
}
