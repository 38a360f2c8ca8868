package cas

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"testing"
)

// CatFile streams one file of a snapshot, byte for byte, in small chunks
// so that many are in flight; a damaged chunk ends it with ErrCorrupt; a
// path that is not a regular file of the snapshot is ErrNotExist.
func TestCatFile(t *testing.T) {
	s, d := newDirStore(t)
	s.minChunk, s.avgBits = 16<<10, 14 // many small chunks
	tree := t.TempDir()
	manyFiles(t, tree, 30, 4)
	want, err := os.ReadFile(filepath.Join(tree, "big.bin"))
	must(t, err)
	id, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	var got bytes.Buffer
	must(t, s.CatFile(ctx, id, "big.bin", &got))
	if !bytes.Equal(got.Bytes(), want) {
		t.Fatalf("CatFile gave %d bytes, the file has %d (or they differ)", got.Len(), len(want))
	}
	for _, p := range []string{"no-such", "d00"} {
		if err := s.CatFile(ctx, id, p, &got); !errors.Is(err, fs.ErrNotExist) {
			t.Fatalf("CatFile %q: %v, want ErrNotExist", p, err)
		}
	}
	m, err := s.loadManifest(ctx, id)
	must(t, err)
	for _, e := range m.Entries {
		if e.Path == "big.bin" {
			if len(e.Chunks) < 3*catAhead {
				t.Fatalf("big.bin has %d chunks: too few to have many in flight", len(e.Chunks))
			}
			// A pack cut short at the middle chunk.
			file, off, _ := locate(t, d, e.Chunks[len(e.Chunks)/2].Key)
			must(t, os.Truncate(file, off))
		}
	}
	got.Reset()
	if err := s.CatFile(ctx, id, "big.bin", &got); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("CatFile with a chunk gone: %v, want ErrCorrupt", err)
	}
	if got.Len() >= len(want) {
		t.Fatalf("CatFile wrote %d bytes past a missing chunk", got.Len())
	}
}
