package blob

import (
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/zeebo/blake3"

	"stasis/internal/s3test"
)

func TestMain(m *testing.M) { s3test.Main(m) }

// fullStore is what every store of this package is.
type fullStore interface {
	Store
	Batcher
	PackFiler
	BulkDeleter
}

// storeKind is one implementation under the conformance tests.
type storeKind struct {
	name string
	// open returns a new empty store, and a function that opens another
	// handle on the same store (another process, or another node).
	open func(t *testing.T) (fullStore, func(t *testing.T) fullStore)
	// sync makes a handle see what the others did: Dir sees it at once,
	// an S3 node at its next listing.
	sync func(t *testing.T, s fullStore)
}

var storeKinds = []storeKind{
	{
		name: "Dir",
		open: func(t *testing.T) (fullStore, func(*testing.T) fullStore) {
			d := newDir(t)
			return d, func(t *testing.T) fullStore {
				o, err := NewDir(d.Path())
				if err != nil {
					t.Fatal(err)
				}
				return o
			}
		},
		sync: func(*testing.T, fullStore) {},
	},
	{
		name: "S3",
		open: func(t *testing.T) (fullStore, func(*testing.T) fullStore) {
			srv := s3test.Start(t)
			url := "s3://" + srv.Bucket(t) + "/stasis/blobs"
			open := func(t *testing.T) fullStore { return openS3(t, srv, url, S3Options{}) }
			return open(t), open
		},
		sync: func(t *testing.T, s fullStore) {
			if err := s.(*S3).Refresh(context.Background()); err != nil {
				t.Fatal(err)
			}
		},
	},
}

// openS3 opens an S3 store on srv, closed when t ends; opts' endpoint and
// credentials are srv's unless given.
func openS3(t testing.TB, srv *s3test.Server, url string, opts S3Options) *S3 {
	t.Helper()
	if opts.Endpoint == "" {
		opts.Endpoint = srv.Endpoint
	}
	if opts.AccessKeyID == "" {
		opts.AccessKeyID, opts.SecretAccessKey = s3test.AccessKey, s3test.SecretKey
	}
	s, err := OpenS3(context.Background(), url, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// forEachStore runs test on every kind of store.
func forEachStore(t *testing.T, test func(t *testing.T, k storeKind)) {
	for _, k := range storeKinds {
		t.Run(k.name, func(t *testing.T) { test(t, k) })
	}
}

func walkStore(t *testing.T, s Store) map[string]int64 {
	t.Helper()
	got := map[string]int64{}
	if err := s.Walk(context.Background(), func(k string, size int64) error {
		if _, ok := got[k]; ok {
			t.Fatalf("Walk gave %s twice", k[:8])
		}
		got[k] = size
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return got
}

// stageAll commits blobs in one batch, staged from many goroutines.
func stageAll(t *testing.T, s Batcher, blobs map[string][]byte) {
	t.Helper()
	ctx := context.Background()
	b := s.NewBatch()
	var wg sync.WaitGroup
	errs := make(chan error, len(blobs))
	for k, data := range blobs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- b.Stage(ctx, k, data)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// badKeys are keys every store refuses: wrong lengths, cases and
// alphabets, and path traversals.
var badKeys = []string{
	"",
	"ab",
	key('a')[:KeyLen-1],
	key('a') + "0",
	strings.ToUpper(key('a')),
	"../secret",
	"../../../../../../../../../../../../../../../../../../../etc/passwd",
	"aa/" + key('a')[:KeyLen-3],
	"aa/../../" + key('b')[:KeyLen-9],
	"packs/../../" + key('b')[:KeyLen-12],
	strings.Repeat(".", KeyLen),
	"/" + key('a')[1:],
	key('a')[:KeyLen-1] + "/",
	key('a')[:KeyLen-1] + "g",
	key('a')[:KeyLen-1] + "\x00",
	strings.Repeat("é", KeyLen/2),
}

// Every entry point refuses a bad key with ErrInvalidKey, and stores
// nothing.
func TestConformanceKeyValidation(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, _ := kind.open(t)
		b := s.NewBatch()
		pf, err := s.NewPackFile()
		if err != nil {
			t.Fatal(err)
		}
		defer pf.Abort()
		for _, k := range badKeys {
			if ValidKey(k) {
				t.Errorf("ValidKey(%q) = true", k)
			}
			for what, err := range map[string]error{
				"Put":        s.Put(ctx, k, []byte("x")),
				"Delete":     s.Delete(ctx, k),
				"DeleteKeys": s.DeleteKeys(ctx, []string{key('a'), k}),
				"Stage":      b.Stage(ctx, k, []byte("x")),
				"Keep":       pf.Keep(k, 0, 1),
				"Append":     pf.Append(k, []byte("x")),
			} {
				if !errors.Is(err, ErrInvalidKey) {
					t.Errorf("%s(%q): %v, want ErrInvalidKey", what, k, err)
				}
			}
			if _, err := s.Get(ctx, k); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Get(%q): %v, want ErrInvalidKey", k, err)
			}
			if _, err := s.Has(ctx, k); !errors.Is(err, ErrInvalidKey) {
				t.Errorf("Has(%q): %v, want ErrInvalidKey", k, err)
			}
		}
		if err := b.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got := walkStore(t, s); len(got) != 0 {
			t.Fatalf("bad keys stored %v", got)
		}
		for _, k := range []string{key('0'), key('f'), "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"} {
			if !ValidKey(k) {
				t.Errorf("ValidKey(%q) = false", k)
			}
		}
	})
}

func TestConformancePutGetHasIdempotent(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, _ := kind.open(t)
		k, data := blobOf("hello", 5)
		if ok, err := s.Has(ctx, k); err != nil || ok {
			t.Fatalf("Has before Put: %v %v", ok, err)
		}
		if _, err := s.Get(ctx, k); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Get before Put: %v, want ErrNotFound", err)
		}
		for i := 0; i < 3; i++ {
			if err := s.Put(ctx, k, data); err != nil {
				t.Fatalf("Put #%d: %v", i, err)
			}
		}
		if b, err := s.Get(ctx, k); err != nil || !bytes.Equal(b, data) {
			t.Fatalf("Get: %q %v", b, err)
		}
		if ok, err := s.Has(ctx, k); err != nil || !ok {
			t.Fatalf("Has after Put: %v %v", ok, err)
		}
		if got := walkStore(t, s); len(got) != 1 || got[k] != 5 {
			t.Fatalf("Walk after three Puts of one blob: %v", got)
		}
		// Empty blobs are blobs.
		ke, _ := blobOf("", 0)
		if err := s.Put(ctx, ke, nil); err != nil {
			t.Fatal(err)
		}
		if b, err := s.Get(ctx, ke); err != nil || len(b) != 0 {
			t.Fatalf("empty blob: %q %v", b, err)
		}
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if err := s.Put(cctx, key('c'), []byte("x")); !errors.Is(err, context.Canceled) {
			t.Fatalf("Put with a cancelled context: %v", err)
		}
		if _, err := s.Get(cctx, k); !errors.Is(err, context.Canceled) {
			t.Fatalf("Get with a cancelled context: %v", err)
		}
	})
}

func TestConformanceDeleteIdempotent(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, _ := kind.open(t)
		k, data := blobOf("d", 1)
		if err := s.Delete(ctx, k); err != nil {
			t.Fatalf("Delete of a missing key: %v", err)
		}
		if err := s.Put(ctx, k, data); err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 2; i++ {
			if err := s.Delete(ctx, k); err != nil {
				t.Fatalf("Delete #%d: %v", i, err)
			}
		}
		if ok, _ := s.Has(ctx, k); ok {
			t.Fatal("blob still there after Delete")
		}
		if _, err := s.Get(ctx, k); !errors.Is(err, ErrNotFound) {
			t.Fatalf("Get after Delete: %v", err)
		}
		// Stored again after its delete, it is there again.
		if err := s.Put(ctx, k, data); err != nil {
			t.Fatal(err)
		}
		if b, err := s.Get(ctx, k); err != nil || !bytes.Equal(b, data) {
			t.Fatalf("Get after a new Put: %q %v", b, err)
		}
	})
}

func TestConformanceWalk(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, _ := kind.open(t)
		want := map[string]int64{}
		for i, c := range "0123456789abcdef" {
			k, data := blobOf(string(c), i*10)
			if err := s.Put(ctx, k, data); err != nil {
				t.Fatal(err)
			}
			want[k] = int64(len(data))
		}
		batch := map[string][]byte{}
		for i := 0; i < 5; i++ {
			k, data := blobOf("batch"+strconv.Itoa(i), 100+i)
			batch[k] = data
			want[k] = int64(len(data))
		}
		stageAll(t, s, batch)
		got := walkStore(t, s)
		if len(got) != len(want) {
			t.Fatalf("Walk gave %d blobs, want %d: %v", len(got), len(want), keys(got))
		}
		for k, n := range want {
			if got[k] != n {
				t.Errorf("Walk: %s size %d, want %d", k, got[k], n)
			}
		}
		// An error from fn stops the walk and comes back.
		stop := errors.New("stop")
		calls := 0
		if err := s.Walk(ctx, func(string, int64) error { calls++; return stop }); !errors.Is(err, stop) || calls != 1 {
			t.Fatalf("Walk with failing fn: %v after %d calls", err, calls)
		}
		// A cancelled context stops it too.
		cctx, cancel := context.WithCancel(ctx)
		cancel()
		if err := s.Walk(cctx, func(string, int64) error { return nil }); !errors.Is(err, context.Canceled) {
			t.Fatalf("Walk with cancelled context: %v", err)
		}
	})
}

// A batch's blobs are invisible before Commit, visible after it, and
// gone with Abort.
func TestConformanceBatchVisibleOnlyAfterCommit(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, _ := kind.open(t)
		k1, d1 := blobOf("one", 100)
		k2, d2 := blobOf("two", 200)
		b := s.NewBatch()
		for _, e := range []struct {
			k string
			d []byte
		}{{k1, d1}, {k2, d2}, {k1, d1}} {
			if err := b.Stage(ctx, e.k, e.d); err != nil {
				t.Fatal(err)
			}
		}
		if has, _ := s.Has(ctx, k1); has {
			t.Fatal("a staged blob is visible before Commit")
		}
		if got := walkStore(t, s); len(got) != 0 {
			t.Fatalf("Walk saw %d staged blobs", len(got))
		}
		if err := b.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		for k, want := range map[string][]byte{k1: d1, k2: d2} {
			got, err := s.Get(ctx, k)
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("after commit %s: %d bytes, %v", k[:8], len(got), err)
			}
		}
		// Abort drops everything staged; the batch can be used again.
		k3, d3 := blobOf("three", 10)
		if err := b.Stage(ctx, k3, d3); err != nil {
			t.Fatal(err)
		}
		b.Abort()
		if err := b.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if has, _ := s.Has(ctx, k3); has {
			t.Fatal("an aborted blob became visible")
		}
	})
}

// A batch of many blobs staged from many goroutines (some large enough
// to go past an S3 batch's memory) is found whole by another handle.
func TestConformanceBigBatchSeenByAnother(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, reopen := kind.open(t)
		blobs := map[string][]byte{}
		for i := 0; i < 200; i++ {
			k, data := blobOf(strconv.Itoa(i), 1+i*37)
			blobs[k] = data
		}
		for i := 0; i < 3; i++ {
			k, data := blobOf("big"+strconv.Itoa(i), 4<<20+i)
			blobs[k] = data
		}
		stageAll(t, s, blobs)
		other := reopen(t)
		for _, st := range []fullStore{s, other} {
			for k, want := range blobs {
				got, err := st.Get(ctx, k)
				if err != nil || !bytes.Equal(got, want) {
					t.Fatalf("Get %s: %d bytes, %v", k[:8], len(got), err)
				}
				if has, err := st.Has(ctx, k); !has || err != nil {
					t.Fatalf("Has %s: %v %v", k[:8], has, err)
				}
			}
			if got := walkStore(t, st); len(got) != len(blobs) {
				t.Fatalf("Walk found %d blobs, want %d", len(got), len(blobs))
			}
		}
	})
}

// What one handle commits or deletes, another sees (after its sync).
func TestConformanceSeenAcrossHandles(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		a, reopen := kind.open(t)
		b := reopen(t)
		for i := 0; i < 10; i++ {
			k, data := blobOf("round"+strconv.Itoa(i), 100)
			if has, _ := a.Has(ctx, k); has {
				t.Fatalf("round %d: %s is there before it was stored", i, k[:8])
			}
			stageAll(t, b, map[string][]byte{k: data})
			// Get looks again for what it does not know.
			if got, err := a.Get(ctx, k); err != nil || !bytes.Equal(got, data) {
				t.Fatalf("round %d: another handle's commit is not read: %v", i, err)
			}
			kind.sync(t, a)
			if has, err := a.Has(ctx, k); !has || err != nil {
				t.Fatalf("round %d: another handle's commit is not seen: %v %v", i, has, err)
			}
			if err := b.Delete(ctx, k); err != nil {
				t.Fatal(err)
			}
			kind.sync(t, a)
			if has, err := a.Has(ctx, k); has || err != nil {
				t.Fatalf("round %d: another handle's delete is not seen: %v %v", i, has, err)
			}
			if _, err := a.Get(ctx, k); !errors.Is(err, ErrNotFound) {
				t.Fatalf("round %d: Get of a deleted blob: %v", i, err)
			}
		}
		if got := walkStore(t, a); len(got) != 0 {
			t.Fatalf("blobs left after every blob was deleted: %v", got)
		}
	})
}

// Deleting some blobs of a batch, then more, past half of it, then all:
// each step is what another handle sees.
func TestConformanceDeleteFromPacks(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, reopen := kind.open(t)
		var ks []string
		blobs := map[string][]byte{}
		for i := 0; i < 10; i++ {
			k, data := blobOf("blob"+strconv.Itoa(i), 1000)
			ks = append(ks, k)
			blobs[k] = data
		}
		stageAll(t, s, blobs)
		check := func(step string, live []string) {
			t.Helper()
			for _, st := range []fullStore{s, reopen(t)} {
				got := walkStore(t, st)
				if len(got) != len(live) {
					t.Fatalf("%s: Walk found %d blobs, want %d", step, len(got), len(live))
				}
				for _, k := range live {
					b, err := st.Get(ctx, k)
					if err != nil || !bytes.Equal(b, blobs[k]) || got[k] != 1000 {
						t.Fatalf("%s: live blob %s: %d bytes, %v", step, k[:8], len(b), err)
					}
				}
			}
		}
		steps := []struct {
			name string
			del  []string
			live []string
		}{
			{"three deleted", ks[:3], ks[3:]},
			{"five deleted, one again", []string{ks[3], ks[4], ks[0]}, ks[5:]},
			{"six deleted", ks[5:6], ks[6:]},
			{"all deleted", ks, nil},
		}
		for _, st := range steps {
			if err := s.DeleteKeys(ctx, st.del); err != nil {
				t.Fatalf("%s: %v", st.name, err)
			}
			for _, k := range st.del {
				if has, _ := s.Has(ctx, k); has {
					t.Fatalf("%s: deleted blob %s still there", st.name, k[:8])
				}
			}
			check(st.name, st.live)
		}
		if err := s.DeleteKeys(ctx, []string{ks[0], "not-a-key"}); err == nil {
			t.Fatal("DeleteKeys took a bad key")
		}
	})
}

// Two handles deleting from the same pack at once lose neither's
// deletes, and a third reading the blobs that stay live meanwhile never
// misses one, though the pack it read them from is rewritten and removed
// under it.
func TestConformanceConcurrentDeletesAndReads(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		a, reopen := kind.open(t)
		blobs := map[string][]byte{}
		var ks []string
		for i := 0; i < 40; i++ {
			k, data := blobOf("c"+strconv.Itoa(i), 3000+i)
			blobs[k] = data
			ks = append(ks, k)
		}
		sort.Strings(ks)
		stageAll(t, a, blobs)
		b, r := reopen(t), reopen(t)
		live := ks[:8]
		stop := make(chan struct{})
		readErr := make(chan error, 1)
		go func() {
			defer close(readErr)
			for n := 0; ; n++ {
				select {
				case <-stop:
					return
				default:
				}
				k := live[n%len(live)]
				got, err := r.Get(ctx, k)
				if err != nil || !bytes.Equal(got, blobs[k]) {
					readErr <- fmt.Errorf("read %d of live blob %s: %d bytes, %v", n, k[:8], len(got), err)
					return
				}
			}
		}()
		var wg sync.WaitGroup
		errs := make(chan error, len(ks))
		for i := len(live); i < len(ks); i++ { // one key per call, alternating between the handles
			d := a
			if i%2 == 1 {
				d = b
			}
			wg.Add(1)
			go func(d fullStore, k string) {
				defer wg.Done()
				errs <- d.DeleteKeys(ctx, []string{k})
			}(d, ks[i])
		}
		wg.Wait()
		close(stop)
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		if err := <-readErr; err != nil {
			t.Fatal(err)
		}
		for _, d := range []fullStore{a, b, r} {
			got := walkStore(t, d)
			if len(got) != len(live) {
				t.Fatalf("%d blobs live after the deletes, want %d", len(got), len(live))
			}
			for _, k := range live {
				if _, ok := got[k]; !ok {
					t.Fatalf("live blob %s is gone", k[:8])
				}
			}
		}
	})
}

// A pack file: the producer writes a stream, the caller keeps some
// stretches as blobs (one twice), drops others, appends one; after Commit
// the kept and appended blobs are stored, from another handle too; an
// aborted pack file stores nothing.
func TestConformancePackFile(t *testing.T) {
	forEachStore(t, func(t *testing.T, kind storeKind) {
		ctx := context.Background()
		s, reopen := kind.open(t)
		stream := make([]byte, 3<<20)
		for i := range stream {
			stream[i] = byte(i*7 + i>>10)
		}
		pf, err := s.NewPackFile()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(pf.File(), bytes.NewReader(stream)); err != nil {
			t.Fatal(err)
		}
		type stretch struct{ off, size int64 }
		kept := map[string]stretch{}
		for _, st := range []stretch{{0, 5000}, {5000, 1 << 20}, {2 << 20, 100}, {(2 << 20) + 4096, 1 << 19}} {
			k := hashOf(stream[st.off : st.off+st.size])
			kept[k] = st
			if err := pf.Keep(k, st.off, st.size); err != nil {
				t.Fatal(err)
			}
		}
		// Kept twice: the first stretch stays.
		first := hashOf(stream[0:5000])
		if err := pf.Keep(first, 3<<19, 5000); err != nil {
			t.Fatal(err)
		}
		if err := pf.Drop((1<<20)+5000, (1<<20)-5000); err != nil {
			t.Fatal(err)
		}
		tail := []byte("appended after the stream")
		ka := hashOf(tail)
		if err := pf.Append(ka, tail); err != nil {
			t.Fatal(err)
		}
		if has, _ := s.Has(ctx, ka); has {
			t.Fatal("an appended blob is visible before Commit")
		}
		if err := pf.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		pf.Abort() // a no-op after Commit
		want := map[string][]byte{ka: tail}
		for k, st := range kept {
			want[k] = stream[st.off : st.off+st.size]
		}
		for _, st := range []fullStore{s, reopen(t)} {
			if got := walkStore(t, st); len(got) != len(want) {
				t.Fatalf("Walk found %d blobs, want %d", len(got), len(want))
			}
			for k, data := range want {
				got, err := st.Get(ctx, k)
				if err != nil || !bytes.Equal(got, data) {
					t.Fatalf("Get %s: %d bytes, %v", k[:8], len(got), err)
				}
			}
		}
		// Aborted: nothing.
		pf2, err := s.NewPackFile()
		if err != nil {
			t.Fatal(err)
		}
		k2, d2 := blobOf("aborted", 1000)
		if err := pf2.Append(k2, d2); err != nil {
			t.Fatal(err)
		}
		pf2.Abort()
		if err := pf2.Commit(ctx); err == nil {
			t.Fatal("Commit after Abort succeeded")
		}
		if has, _ := s.Has(ctx, k2); has {
			t.Fatal("an aborted pack file's blob is visible")
		}
		// Overlapping stretches are the caller's mistake, refused.
		pf3, err := s.NewPackFile()
		if err != nil {
			t.Fatal(err)
		}
		defer pf3.Abort()
		if _, err := pf3.File().Write(stream[:100]); err != nil {
			t.Fatal(err)
		}
		ko1, ko2 := hashOf(stream[:60]), hashOf(stream[50:100])
		if err := pf3.Keep(ko1, 0, 60); err != nil {
			t.Fatal(err)
		}
		if err := pf3.Keep(ko2, 50, 50); err != nil {
			t.Fatal(err)
		}
		if err := pf3.Commit(ctx); err == nil || !strings.Contains(err.Error(), "overlap") {
			t.Fatalf("Commit of overlapping blobs: %v", err)
		}
	})
}

func hashOf(data []byte) string {
	sum := blake3.Sum256(data)
	return hex.EncodeToString(sum[:])
}
