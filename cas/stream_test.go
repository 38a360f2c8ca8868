package cas

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"
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

// A staged stream, committed, reads back byte for byte with CatFile and
// restores as a one-file tree; storing it again adds only a manifest.
func TestStageStream(t *testing.T) {
	s, _ := newDirStore(t)
	r := rand.New(rand.NewPCG(1, 2))
	data := append(randBytes(r, 3<<20), make([]byte, 1<<20)...) // random, then zeros
	st, err := s.StageStream(ctx, "vm.state", cutEvery(data, 100<<10))
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

	st2, err := s.StageStream(ctx, "vm.state", cutEvery(data, 100<<10))
	must(t, err)
	_, stats2, err := st2.Commit(ctx)
	must(t, err)
	if stats2.NewBlobs > 1 {
		t.Errorf("the same stream again added %d blobs (%d bytes), want at most the manifest", stats2.NewBlobs, stats2.NewBytes)
	}
}

// A chunker's error, an aborted staging and a bad name leave nothing in
// the store.
func TestStageStreamFailures(t *testing.T) {
	s, d := newDirStore(t)
	r := rand.New(rand.NewPCG(3, 4))
	data := randBytes(r, 1<<20)

	boom := errors.New("boom")
	c := cutEvery(data, 64<<10)
	c.err = boom
	c.chunks = c.chunks[:5]
	if _, err := s.StageStream(ctx, "vm.state", c); !errors.Is(err, boom) {
		t.Fatalf("StageStream with a failing chunker: %v, want boom", err)
	}
	st, err := s.StageStream(ctx, "vm.state", cutEvery(data, 64<<10))
	must(t, err)
	st.Abort()
	st.Abort() // idempotent
	if _, _, err := st.Commit(ctx); err == nil {
		t.Fatal("Commit after Abort succeeded")
	}
	for _, bad := range []string{"", "a/b", "..", "."} {
		if _, err := s.StageStream(ctx, bad, cutEvery(data, 64<<10)); err == nil {
			t.Errorf("StageStream named %q succeeded", bad)
		}
	}
	if n := blobCount(t, s); n != 0 {
		t.Fatalf("%d blobs left after failures", n)
	}
	noSiblings(t, filepath.Join(d.Path(), ".staging"))
}
