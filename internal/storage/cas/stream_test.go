package cas

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"stasis/internal/storage/blob"
)

// sliceChunker hands out fixed chunks, then err (io.EOF by default).
type sliceChunker struct {
	chunks [][]byte
	err    error
}

func (c *sliceChunker) Next() ([]byte, error) {
	if len(c.chunks) == 0 {
		if c.err != nil {
			return nil, c.err
		}
		return nil, io.EOF
	}
	b := c.chunks[0]
	c.chunks = c.chunks[1:]
	return b, nil
}

func cutEvery(data []byte, n int) *sliceChunker {
	c := &sliceChunker{}
	for len(data) > 0 {
		k := min(n, len(data))
		c.chunks = append(c.chunks, bytes.Clone(data[:k]))
		data = data[k:]
	}
	return c
}

// blobCount counts the committed blobs of a directory store.
func blobCount(t *testing.T, s *Store) int {
	n := 0
	must(t, s.blobs.Walk(ctx, func(string, int64) error { n++; return nil }))
	return n
}

// stageFile writes data into a new pack file of d, as QEMU does, and
// stages it cut by c.
func stageFile(t *testing.T, s *Store, d *blob.Dir, name string, data []byte, c Chunker) (*Staged, error) {
	t.Helper()
	pf, err := d.NewPackFile()
	must(t, err)
	_, err = pf.File().Write(data)
	must(t, err)
	return s.StageFile(ctx, name, pf, c, "")
}

// allocated is how many bytes of disk the file holding key's blob takes.
func allocated(t *testing.T, d *blob.Dir, key string) int64 {
	t.Helper()
	file, _, _ := locate(t, d, key)
	var st unix.Stat_t
	must(t, unix.Stat(file, &st))
	return st.Blocks * 512
}

// A stream written in place into a pack file, staged and committed, reads
// back byte for byte with CatFile and restores as a one-file tree; the
// bytes of repeated chunks take no disk space; staging it again adds only
// a manifest, and next to nothing on disk.
func TestStageFile(t *testing.T) {
	s, d := newDirStore(t)
	r := rand.New(rand.NewPCG(1, 2))
	data := append(randBytes(r, 3<<20), make([]byte, 1<<20)...) // random, then zeros
	st, err := stageFile(t, s, d, "vm.state", data, cutEvery(data, 100<<10))
	must(t, err)
	if n := blobCount(t, s); n != 0 {
		t.Fatalf("%d blobs visible before the commit", n)
	}
	id, stats, err := st.Commit(ctx)
	must(t, err)
	if stats.Bytes != int64(len(data)) || stats.Files != 1 {
		t.Errorf("stats %+v: want one file of %d bytes", stats, len(data))
	}
	// 100 KiB chunks: 31 holding random bytes (the last with the first
	// zeros), nine all-zero ones (one blob), a shorter all-zero last one,
	// and the manifest.
	if stats.NewBlobs != 34 {
		t.Errorf("%d new blobs, want 34", stats.NewBlobs)
	}
	// The eight repeated all-zero chunks were released: at least 7 x 96
	// KiB of whole blocks.
	if a := allocated(t, d, id); a > int64(len(data))-7*96<<10 {
		t.Errorf("the pack takes %d bytes of disk for a %d-byte stream with 800 KiB repeated", a, len(data))
	}
	var got bytes.Buffer
	must(t, s.CatFile(ctx, id, "vm.state", &got))
	if !bytes.Equal(got.Bytes(), data) {
		t.Fatal("CatFile does not give the stream back")
	}
	dst := filepath.Join(t.TempDir(), "out")
	_, err = s.Restore(ctx, id, dst)
	must(t, err)
	b, err := os.ReadFile(filepath.Join(dst, "vm.state"))
	must(t, err)
	if !bytes.Equal(b, data) {
		t.Fatal("the restored file is not the stream")
	}
	if _, _, err := st.Commit(ctx); err == nil {
		t.Fatal("a second Commit of one staging succeeded")
	}

	st2, err := stageFile(t, s, d, "vm.state", data, cutEvery(data, 100<<10))
	must(t, err)
	id2, stats2, err := st2.Commit(ctx)
	must(t, err)
	if stats2.NewBlobs > 1 {
		t.Errorf("the same stream again added %d blobs (%d bytes), want at most the manifest", stats2.NewBlobs, stats2.NewBytes)
	}
	if id2 != id {
		if a := allocated(t, d, id2); a > 256<<10 {
			t.Errorf("the second pack takes %d bytes of disk, want little more than its manifest", a)
		}
	}
	got.Reset()
	must(t, s.CatFile(ctx, id2, "vm.state", &got))
	if !bytes.Equal(got.Bytes(), data) {
		t.Fatal("CatFile of the second staging does not give the stream back")
	}
}

// A chunker's error, an aborted staging and a bad name leave nothing in
// the store.
func TestStageFileFailures(t *testing.T) {
	s, d := newDirStore(t)
	r := rand.New(rand.NewPCG(3, 4))
	data := randBytes(r, 1<<20)

	boom := errors.New("boom")
	c := cutEvery(data, 64<<10)
	c.err = boom
	c.chunks = c.chunks[:5]
	if _, err := stageFile(t, s, d, "vm.state", data, c); !errors.Is(err, boom) {
		t.Fatalf("StageFile with a failing chunker: %v, want boom", err)
	}
	st, err := stageFile(t, s, d, "vm.state", data, cutEvery(data, 64<<10))
	must(t, err)
	st.Abort()
	st.Abort() // idempotent
	if _, _, err := st.Commit(ctx); err == nil {
		t.Fatal("Commit after Abort succeeded")
	}
	for _, bad := range []string{"", "a/b", "..", "."} {
		if _, err := stageFile(t, s, d, bad, data, cutEvery(data, 64<<10)); err == nil {
			t.Errorf("StageFile named %q succeeded", bad)
		}
	}
	if n := blobCount(t, s); n != 0 {
		t.Fatalf("%d blobs left after failures", n)
	}
	noSiblings(t, filepath.Join(d.Path(), ".staging"))
}
