package cas

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"stasis/internal/s3test"
	"stasis/internal/storage/blob"
)

func TestMain(m *testing.M) { s3test.Main(m) }

// openNode opens the S3 store at url on srv as one node, closed when t
// ends.
func openNode(t *testing.T, srv *s3test.Server, url string, opts blob.S3Options) *blob.S3 {
	t.Helper()
	opts.Endpoint = srv.Endpoint
	opts.AccessKeyID, opts.SecretAccessKey = s3test.AccessKey, s3test.SecretKey
	s, err := blob.OpenS3(context.Background(), url, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// ageIndexes sets the mtime, which versitygw's posix backend gives as an
// object's Last-Modified, of the store's index objects (those newer than
// newerThan ago) to age ago: their packs' blobs then count as stored
// then.
func ageIndexes(t *testing.T, root string, age, newerThan time.Duration) {
	t.Helper()
	ents, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	then := time.Now().Add(-age)
	n := 0
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil || !strings.HasSuffix(e.Name(), ".idx") || time.Since(fi.ModTime()) > newerThan {
			continue
		}
		if err := os.Chtimes(filepath.Join(root, e.Name()), then, then); err != nil {
			t.Fatal(err)
		}
		n++
	}
	if n == 0 {
		t.Fatalf("no index objects to age in %s", root)
	}
}

// walkHook is an S3 store whose WalkStored runs during, once it has
// listed the store, as another node would write meanwhile.
type walkHook struct {
	*blob.S3
	once   sync.Once
	during func()
}

func (w *walkHook) WalkStored(ctx context.Context, fn func(string, int64, time.Time) error) (time.Time, error) {
	return w.S3.WalkStored(ctx, func(k string, size int64, stored time.Time) error {
		w.once.Do(w.during)
		return fn(k, size, stored)
	})
}

// GC on an S3 bucket that other nodes write to spares what they stored
// after its walk began or within the grace period, referenced or not,
// and a new copy of an old unreferenced blob among them; it deletes the
// old unreferenced rest.
func TestGCGraceOnS3(t *testing.T) {
	srv := s3test.Start(t)
	bucket := srv.Bucket(t)
	url := "s3://" + bucket + "/stasis"
	packs := srv.ObjectPath(bucket, "stasis/packs")
	a := openNode(t, srv, url, blob.S3Options{})
	// B does not reuse blobs stored over ten minutes ago: it stores them
	// anew (see S3Options.ReuseWithin).
	b := openNode(t, srv, url, blob.S3Options{ReuseWithin: 10 * time.Minute})

	tree := t.TempDir()
	writeFile(t, filepath.Join(tree, "kept"), []byte("a file of the live snapshot"))
	writeFile(t, filepath.Join(tree, "sub", "also"), bytes.Repeat([]byte("live "), 1000))
	s := New(&walkHook{S3: a})
	live, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	oldGarbage := []byte("old and referenced by nothing")
	reStored := []byte("old, referenced by nothing, and stored again by another node during the walk")
	for _, data := range [][]byte{oldGarbage, reStored} {
		must(t, a.Put(ctx, hashKey(data), data))
	}
	ageIndexes(t, packs, time.Hour, time.Minute)
	recentGarbage := []byte("referenced by nothing, stored a minute ago")
	must(t, a.Put(ctx, hashKey(recentGarbage), recentGarbage))
	ageIndexes(t, packs, time.Minute, 10*time.Second)

	// B stores as a snapshot does: what Has does not report.
	must(t, b.Refresh(ctx))
	store := func(data []byte) {
		if has, err := b.Has(ctx, hashKey(data)); err != nil || has {
			return
		}
		if err := b.Put(ctx, hashKey(data), data); err != nil {
			t.Errorf("another node's Put during the walk: %v", err)
		}
	}
	newDuring := []byte("stored by another node during the walk")
	s.blobs.(*walkHook).during = func() {
		store(reStored)
		store(newDuring)
	}
	freed, _, err := s.GCWith(ctx, []string{live}, GCOptions{Grace: 10 * time.Minute})
	must(t, err)
	if freed != 2 { // oldGarbage, and the old copy of reStored
		t.Errorf("GC freed %d blobs, want 2", freed)
	}

	c := openNode(t, srv, url, blob.S3Options{}) // a third node, after it all
	if _, err := c.Get(ctx, hashKey(oldGarbage)); !errors.Is(err, blob.ErrNotFound) {
		t.Errorf("old unreferenced blob: %v, want it collected", err)
	}
	for what, data := range map[string][]byte{"stored again during the walk": reStored, "new during the walk": newDuring, "within the grace period": recentGarbage} {
		if got, err := c.Get(ctx, hashKey(data)); err != nil || !bytes.Equal(got, data) {
			t.Errorf("blob %s: %v, want it kept", what, err)
		}
	}
	out := filepath.Join(t.TempDir(), "out")
	if _, err := New(c).Restore(ctx, live, out); err != nil {
		t.Fatalf("restore of the live snapshot after GC: %v", err)
	}
	compareTrees(t, tree, out, nil)

	// Without a grace period, the blob a minute old goes; blobs stored
	// after the walk began still stay.
	s.blobs.(*walkHook).once = sync.Once{}
	newDuring2 := []byte("stored by another node during the second walk")
	s.blobs.(*walkHook).during = func() { store(newDuring2) }
	_, _, err = s.GCWith(ctx, []string{live}, GCOptions{})
	must(t, err)
	must(t, c.Refresh(ctx))
	if _, err := c.Get(ctx, hashKey(recentGarbage)); !errors.Is(err, blob.ErrNotFound) {
		t.Errorf("unreferenced blob a minute old, no grace: %v, want it collected", err)
	}
	if got, err := c.Get(ctx, hashKey(newDuring2)); err != nil || !bytes.Equal(got, newDuring2) {
		t.Errorf("blob stored during the second walk: %v, want it kept", err)
	}
	if _, err := New(c).Restore(ctx, live, filepath.Join(t.TempDir(), "out2")); err != nil {
		t.Fatalf("restore of the live snapshot after the second GC: %v", err)
	}
}

// A grace period needs a store that knows when it stored each blob: on a
// Dir it is refused before anything is deleted.
func TestGCGraceNeedsAger(t *testing.T) {
	s, d := newDirStore(t)
	data := []byte("garbage")
	must(t, d.Put(ctx, hashKey(data), data))
	if _, _, err := s.GCWith(ctx, nil, GCOptions{Grace: time.Hour}); err == nil || !strings.Contains(err.Error(), "blob.Ager") || !strings.Contains(err.Error(), "nothing was deleted") {
		t.Fatalf("GC with a grace period on a Dir: %v", err)
	}
	if has, _ := d.Has(ctx, hashKey(data)); !has {
		t.Fatal("a refused GC deleted a blob")
	}
	if _, _, err := s.GCWith(ctx, nil, GCOptions{Grace: -time.Second}); err == nil {
		t.Fatal("GC took a negative grace period")
	}
}

// An optional snapshot is kept when it is there and passed over when its
// manifest is not; a missing live one still stops the collection.
func TestGCOptional(t *testing.T) {
	s, d := newDirStore(t)
	tree := t.TempDir()
	writeFile(t, filepath.Join(tree, "f"), []byte("kept by an optional root"))
	kept, _, err := s.Snapshot(ctx, tree, "")
	must(t, err)
	garbage := []byte("referenced by nothing")
	must(t, d.Put(ctx, hashKey(garbage), garbage))
	missing := hashKey([]byte("a manifest never stored"))
	if _, _, err := s.GCWith(ctx, []string{missing}, GCOptions{Optional: []string{kept}}); err == nil || !strings.Contains(err.Error(), "nothing was deleted") {
		t.Fatalf("GC with a missing live snapshot: %v", err)
	}
	freed, _, err := s.GCWith(ctx, nil, GCOptions{Optional: []string{missing, kept}})
	must(t, err)
	if freed != 1 {
		t.Fatalf("freed %d blobs, want the one garbage blob", freed)
	}
	if _, err := s.Restore(ctx, kept, filepath.Join(t.TempDir(), "out")); err != nil {
		t.Fatalf("the optional snapshot after GC: %v", err)
	}
}
