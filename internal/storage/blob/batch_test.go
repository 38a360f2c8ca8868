package blob

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestBatchVisibleOnlyAfterCommit(t *testing.T) {
	ctx := context.Background()
	d, err := NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	k1, k2 := strings.Repeat("a", KeyLen), strings.Repeat("b", KeyLen)
	b := d.NewBatch()
	for _, k := range []string{k1, k2, k1} {
		if err := b.Stage(ctx, k, []byte("data-"+k[:1])); err != nil {
			t.Fatal(err)
		}
	}
	if has, _ := d.Has(ctx, k1); has {
		t.Fatal("a staged blob is visible before Commit")
	}
	n := 0
	_ = d.Walk(ctx, func(string, int64) error { n++; return nil })
	if n != 0 {
		t.Fatalf("Walk saw %d staged blobs", n)
	}
	if err := b.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{k1, k2} {
		got, err := d.Get(ctx, k)
		if err != nil || string(got) != "data-"+k[:1] {
			t.Fatalf("after commit %s: %q %v", k[:4], got, err)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(d.Path(), stagingDir)); len(ents) != 0 {
		t.Fatalf("staging left behind: %v", ents)
	}
	// Abort drops everything staged.
	k3 := strings.Repeat("c", KeyLen)
	b2 := d.NewBatch()
	if err := b2.Stage(ctx, k3, []byte("x")); err != nil {
		t.Fatal(err)
	}
	b2.Abort()
	if err := b2.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if has, _ := d.Has(ctx, k3); has {
		t.Fatal("an aborted blob became visible")
	}
	if err := b2.Stage(ctx, "../../etc/x", nil); err == nil {
		t.Fatal("a bad key was staged")
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
