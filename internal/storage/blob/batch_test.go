package blob

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// A Dir's batch leaves nothing in its staging directory once committed
// or aborted (the conformance tests check what it makes visible).
func TestDirBatchClearsStaging(t *testing.T) {
	ctx := context.Background()
	d, err := NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	staged := func() []os.DirEntry {
		ents, _ := os.ReadDir(filepath.Join(d.Path(), stagingDir))
		return ents
	}
	b := d.NewBatch()
	if err := b.Stage(ctx, strings.Repeat("a", KeyLen), []byte("data-a")); err != nil {
		t.Fatal(err)
	}
	if len(staged()) != 1 {
		t.Fatalf("staging holds %v, want the batch", staged())
	}
	if err := b.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if ents := staged(); len(ents) != 0 {
		t.Fatalf("staging left behind after Commit: %v", ents)
	}
	if err := b.Stage(ctx, strings.Repeat("c", KeyLen), []byte("x")); err != nil {
		t.Fatal(err)
	}
	b.Abort()
	if ents := staged(); len(ents) != 0 {
		t.Fatalf("staging left behind after Abort: %v", ents)
	}
}

func TestStaleStagingIsCleared(t *testing.T) {
	dir := t.TempDir()
	old := filepath.Join(dir, stagingDir, "deadbeef")
	fresh := filepath.Join(dir, stagingDir, "cafe")
	for _, p := range []string{old, fresh} {
		if err := os.MkdirAll(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	past := time.Now().Add(-2 * staleStaging)
	if err := os.Chtimes(old, past, past); err != nil {
		t.Fatal(err)
	}
	if _, err := NewDir(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(old); !os.IsNotExist(err) {
		t.Fatal("a crash's stale staging batch was kept")
	}
	if _, err := os.Stat(fresh); err != nil {
		t.Fatal("a batch that may be in progress was removed")
	}
}
