package cas

import (
	"context"
	"math/rand/v2"
	"path/filepath"
	"testing"
)

// TestRestoreIndexedMakesTheNextSnapshotIncremental: after a restore, the
// first snapshot of the restored tree reads only the file changed since.
func TestRestoreIndexedMakesTheNextSnapshotIncremental(t *testing.T) {
	ctx := context.Background()
	s, _ := newDirStore(t)
	s.racy = 0 // the test writes right after restoring
	src := filepath.Join(t.TempDir(), "src")
	r := rand.New(rand.NewPCG(7, 7))
	for _, n := range []string{"a", "b", "d/c", "d/e"} {
		writeFile(t, filepath.Join(src, n), randBytes(r, 40000))
	}
	id, _, err := s.Snapshot(ctx, src, "")
	must(t, err)
	dst := filepath.Join(t.TempDir(), "fork")
	index, st, err := s.RestoreIndexed(ctx, id, dst)
	must(t, err)
	if index == "" || index == id || st.ReadBytes != 160000 {
		t.Fatalf("index %q (source %q), restore read %d", index, id, st.ReadBytes)
	}
	writeFile(t, filepath.Join(dst, "d/c"), randBytes(r, 40000))
	_, st2, err := s.Snapshot(ctx, dst, index)
	must(t, err)
	if st2.ReadBytes != 40000 || st2.ReusedFiles != 3 {
		t.Fatalf("first snapshot after the restore read %d bytes and reused %d files; want only the changed file read", st2.ReadBytes, st2.ReusedFiles)
	}
	// Without the index every file is read again.
	_, st3, err := s.Snapshot(ctx, dst, id)
	must(t, err)
	if st3.ReadBytes != 160000 {
		t.Fatalf("with the source manifest as prev, read %d; the test no longer tells the two apart", st3.ReadBytes)
	}
	// An index of a tree that does not match is refused.
	writeFile(t, filepath.Join(dst, "a"), []byte("short"))
	if _, err := s.Index(ctx, id, dst); err == nil {
		t.Fatal("an index of a changed tree was made")
	}
}
