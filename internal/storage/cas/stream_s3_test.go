package cas

import (
	"bytes"
	"math/rand/v2"
	"testing"
	"time"

	"stasis/internal/s3test"
	"stasis/internal/storage/blob"
)

// stageS3 writes data into a new pack file of s's S3 store, as QEMU does,
// stages it cut into 64 KiB chunks on base, and commits it.
func stageS3(t *testing.T, s *Store, data []byte, base string) (string, Stats) {
	t.Helper()
	pf, err := s.blobs.(blob.PackFiler).NewPackFile()
	must(t, err)
	_, err = pf.File().Write(data)
	must(t, err)
	st, err := s.StageFile(ctx, "vm.state", pf, cutEvery(data, 64<<10), base)
	must(t, err)
	id, stats, err := st.Commit(ctx)
	must(t, err)
	return id, stats
}

// On a store that reports only recent copies (S3Options.ReuseWithin), a
// stream staged on a base relies on the base's old chunks and stores
// only what changed; staged without one, its old chunks are stored
// again. A base not in the store is staged without.
func TestStageFileOnABase(t *testing.T) {
	srv := s3test.Start(t)
	bucket := srv.Bucket(t)
	url := "s3://" + bucket + "/stasis"
	s := New(openNode(t, srv, url, blob.S3Options{ReuseWithin: 10 * time.Minute, CacheDir: t.TempDir()}))
	r := rand.New(rand.NewPCG(3, 4))
	data := randBytes(r, 1<<20) // 16 chunks
	base, first := stageS3(t, s, data, "")
	if first.NewBlobs != 17 {
		t.Fatalf("the first staging stored %d blobs, want 16 chunks and the manifest", first.NewBlobs)
	}
	ageIndexes(t, srv.ObjectPath(bucket, "stasis/packs"), time.Hour, time.Minute)
	must(t, s.blobs.(*blob.S3).Refresh(ctx))

	changed := bytes.Clone(data)
	copy(changed[5<<16:], randBytes(r, 1<<16)) // the sixth chunk
	next, stats := stageS3(t, s, changed, base)
	if stats.NewBlobs != 2 {
		t.Errorf("staged on its base, the stream stored %d blobs, want the changed chunk and the manifest", stats.NewBlobs)
	}
	var got bytes.Buffer
	must(t, s.CatFile(ctx, next, "vm.state", &got))
	if !bytes.Equal(got.Bytes(), changed) {
		t.Fatal("the stream staged on a base reads back otherwise")
	}

	// Without the base the old chunks count as absent: stored anew.
	ageIndexes(t, srv.ObjectPath(bucket, "stasis/packs"), time.Hour, time.Minute)
	must(t, s.blobs.(*blob.S3).Refresh(ctx))
	if _, stats := stageS3(t, s, data, ""); stats.NewBlobs != 17 {
		t.Errorf("staged without a base after an hour, the stream stored %d blobs, want all 17", stats.NewBlobs)
	}
	// A base that is not there (collected) is no error.
	missing := hashKey([]byte("no such manifest"))
	if _, stats := stageS3(t, s, randBytes(r, 1<<16), missing); stats.NewBlobs != 2 {
		t.Errorf("staged on a missing base: %d new blobs, want 2", stats.NewBlobs)
	}
}
