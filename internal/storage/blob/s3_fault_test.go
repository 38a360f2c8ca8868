package blob

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"stasis/internal/s3test"
)

// openVia opens the store through a fault-injecting proxy, retrying
// failed requests twice at most.
func (e s3Env) openVia(t *testing.T, p *s3test.Proxy, opts S3Options) *S3 {
	t.Helper()
	opts.Endpoint = p.URL
	if opts.MaxRetries == 0 {
		opts.MaxRetries = 2
	}
	return e.open(t, opts)
}

// nothingLeft checks that the bucket holds no object and no incomplete
// upload, and that a node sees no blob.
func (e s3Env) nothingLeft(t *testing.T) {
	t.Helper()
	if names := e.objects(t); len(names) != 0 {
		t.Fatalf("the bucket holds %v", names)
	}
	for u := range e.srv.Client(t).ListIncompleteUploads(context.Background(), e.bucket, "", true) {
		if u.Err != nil {
			t.Fatal(u.Err)
		}
		t.Fatalf("an incomplete upload is left: %s", u.Key)
	}
	if got := walkStore(t, e.open(t, S3Options{})); len(got) != 0 {
		t.Fatalf("another node sees %d blobs", len(got))
	}
}

func someBlobs(prefix string, n, size int) map[string][]byte {
	blobs := map[string][]byte{}
	for i := 0; i < n; i++ {
		k, data := blobOf(prefix+strconv.Itoa(i), size)
		blobs[k] = data
	}
	return blobs
}

// A batch whose upload fails, at its index, in a part of its pack, or with
// the connection cut, fails its Commit with an error that says so, and
// leaves nothing: no blob visible, no object, no incomplete upload.
func TestS3FailedCommitLeavesNothing(t *testing.T) {
	for _, c := range []struct {
		name  string
		fault *s3test.Fault
		size  int // of each of the 3 blobs
		want  string
	}{
		{"index PUT fails", &s3test.Fault{Match: s3test.Matching("PUT", ".idx"), Status: http.StatusInternalServerError}, 1000, "upload pack index"},
		{"pack PUT fails", &s3test.Fault{Match: s3test.Matching("PUT", ".pack"), Status: http.StatusServiceUnavailable}, 1000, "upload pack"},
		{"a part fails", &s3test.Fault{Match: s3test.Matching("PUT", "partNumber=2"), Status: http.StatusInternalServerError}, 4 << 20, "upload pack"},
		{"connection cut at the index", &s3test.Fault{Match: s3test.Matching("PUT", ".idx"), Drop: true}, 1000, "upload pack index"},
	} {
		t.Run(c.name, func(t *testing.T) {
			env := newS3Env(t)
			ctx := context.Background()
			p := env.srv.Proxy(t)
			s := env.openVia(t, p, S3Options{PartSize: 5 << 20})
			f := p.Inject(c.fault)
			b := s.NewBatch()
			for k, data := range someBlobs("fail", 3, c.size) {
				if err := b.Stage(ctx, k, data); err != nil {
					t.Fatal(err)
				}
			}
			err := b.Commit(ctx)
			b.Abort()
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Commit: %v, want an error saying %q", err, c.want)
			}
			if f.Hits() == 0 {
				t.Fatal("the fault was never hit")
			}
			env.nothingLeft(t)
		})
	}
}

// A pack file's Commit that fails in its multipart upload leaves nothing
// either; Abort removes its temporary file.
func TestS3FailedPackFileCommitLeavesNothing(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	p := env.srv.Proxy(t)
	staging := t.TempDir()
	s := env.openVia(t, p, S3Options{PartSize: 5 << 20, CacheDir: staging})
	p.Inject(&s3test.Fault{Match: s3test.Matching("PUT", "partNumber=3"), Status: http.StatusInternalServerError})
	pf, err := s.NewPackFile()
	if err != nil {
		t.Fatal(err)
	}
	data := noise(12<<20, 1)
	if _, err := pf.File().Write(data); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		part := data[i<<22 : (i+1)<<22]
		if err := pf.Keep(hashOf(part), int64(i)<<22, 4<<20); err != nil {
			t.Fatal(err)
		}
	}
	if err := pf.Commit(ctx); err == nil {
		t.Fatal("a failing multipart upload committed")
	}
	pf.Abort()
	env.nothingLeft(t)
	if left := dirNames(t, staging+"/staging"); len(left) != 0 {
		t.Fatalf("temporary files left: %v", left)
	}
}

// A connection cut while a blob's bytes come is tried again; cut every
// time, it is an error that says so.
func TestS3CutReadIsRetried(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	k, data := blobOf("cut", 100_000)
	if err := env.open(t, S3Options{}).Put(ctx, k, data); err != nil {
		t.Fatal(err)
	}
	p := env.srv.Proxy(t)
	s := env.openVia(t, p, S3Options{})
	once := p.Inject(&s3test.Fault{Match: s3test.Matching("GET", ".pack"), Drop: true, DropAfter: 1000, Times: 1})
	if got, err := s.Get(ctx, k); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get after one cut read: %v", err)
	}
	if once.Hits() != 1 {
		t.Fatalf("the cut hit %d reads, want 1", once.Hits())
	}
	p.Clear()
	always := p.Inject(&s3test.Fault{Match: s3test.Matching("GET", ".pack"), Drop: true, DropAfter: 1000})
	_, err := s.Get(ctx, k)
	if err == nil || !strings.Contains(err.Error(), "the connection was cut after 1000 of 100000 bytes") || !strings.Contains(err.Error(), k) {
		t.Fatalf("Get with every read cut: %v", err)
	}
	if always.Hits() != s3ReadTries {
		t.Fatalf("%d reads tried, want %d", always.Hits(), s3ReadTries)
	}
	// A cut before any answer is the client library's to retry.
	p.Clear()
	p.Inject(&s3test.Fault{Match: s3test.Matching("GET", ".pack"), Drop: true, Times: 1})
	if got, err := s.Get(ctx, k); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get after a connection cut before the answer: %v", err)
	}
}

// A slow server does not hold a caller past its context: reads, commits,
// listings and deletes return when it ends.
func TestS3SlowHonoursContext(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	k, data := blobOf("slow", 1000)
	if err := env.open(t, S3Options{}).Put(ctx, k, data); err != nil {
		t.Fatal(err)
	}
	p := env.srv.Proxy(t)
	s := env.openVia(t, p, S3Options{HasMaxAge: -1})
	p.Inject(&s3test.Fault{Delay: time.Minute})
	k2, d2 := blobOf("slow2", 1000)
	for what, call := range map[string]func(context.Context) error{
		"Get":    func(ctx context.Context) error { _, err := s.Get(ctx, k); return err },
		"Put":    func(ctx context.Context) error { return s.Put(ctx, k2, d2) },
		"Walk":   func(ctx context.Context) error { return s.Walk(ctx, func(string, int64) error { return nil }) },
		"Delete": func(ctx context.Context) error { return s.Delete(ctx, k) },
		"Has":    func(ctx context.Context) error { _, err := s.Has(ctx, key('7')); return err },
	} {
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		start := time.Now()
		err := call(cctx)
		cancel()
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s on a slow server: %v, want the context's deadline", what, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s on a slow server returned after %s, its context ended after 200ms", what, d)
		}
	}
	// The requests still held end (the Put's cleanup among them).
	p.Close()
	// Nothing half done shows: the blob is whole, the Put absent.
	other := env.open(t, S3Options{})
	if got, err := other.Get(ctx, k); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("after the slow calls: %v", err)
	}
	if has, _ := other.Has(ctx, k2); has {
		t.Fatal("a Put cut short by its context is visible")
	}
}

// A pack over the part size goes up as a multipart upload, in parts of
// the part size.
func TestS3MultipartUpload(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	p := env.srv.Proxy(t)
	s := env.openVia(t, p, S3Options{PartSize: 5 << 20})
	pf, err := s.NewPackFile()
	if err != nil {
		t.Fatal(err)
	}
	data := noise(12<<20, 2)
	if _, err := pf.File().Write(data); err != nil {
		t.Fatal(err)
	}
	blobs := map[string][]byte{}
	for i := 0; i < 3; i++ {
		part := data[i<<22 : (i+1)<<22]
		blobs[hashOf(part)] = part
		if err := pf.Keep(hashOf(part), int64(i)<<22, 4<<20); err != nil {
			t.Fatal(err)
		}
	}
	if err := pf.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	parts := 0
	for _, r := range p.Requests() {
		if strings.HasPrefix(r, "PUT ") && strings.Contains(r, ".pack?") && strings.Contains(r, "partNumber=") {
			parts++
		}
	}
	if parts != 3 {
		t.Fatalf("%d part uploads, want 3 (12 MiB in 5 MiB parts): %v", parts, p.Requests())
	}
	var pack string
	for _, n := range env.objects(t) {
		if strings.HasSuffix(n, packExt) {
			pack = n
		}
	}
	info, err := env.srv.Client(t).StatObject(ctx, env.bucket, pack, minio.StatObjectOptions{})
	if err != nil || info.Size != 12<<20 || !strings.HasSuffix(info.ETag, "-3") {
		t.Fatalf("the pack object: %d bytes, ETag %q, %v; want a 3-part upload of 12 MiB", info.Size, info.ETag, err)
	}
	for k, want := range blobs {
		if got, err := env.open(t, S3Options{}).Get(ctx, k); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("Get %s: %v", k[:8], err)
		}
	}
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

// noise is n pseudo-random bytes, the same for the same seed.
func noise(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := 0; i+8 <= n; i += 8 {
		binary.LittleEndian.PutUint64(b[i:], r.Uint64())
	}
	return b
}
