package blob

import (
	"bytes"
	"context"
	"errors"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/minio/minio-go/v7"

	"stasis/internal/s3test"
	"stasis/internal/testwait"
)

// s3Env is one test's server, bucket and store URL.
type s3Env struct {
	srv    *s3test.Server
	bucket string
	prefix string // the store's, "stasis/blobs/"
	url    string
}

func newS3Env(t *testing.T) s3Env {
	t.Helper()
	srv := s3test.Start(t)
	b := srv.Bucket(t)
	return s3Env{srv: srv, bucket: b, prefix: "stasis/blobs/", url: "s3://" + b + "/stasis/blobs"}
}

func (e s3Env) open(t *testing.T, opts S3Options) *S3 {
	t.Helper()
	return openS3(t, e.srv, e.url, opts)
}

// objects lists the whole bucket's object names, sorted.
func (e s3Env) objects(t *testing.T) []string {
	t.Helper()
	var names []string
	for o := range e.srv.Client(t).ListObjects(context.Background(), e.bucket, minio.ListObjectsOptions{Recursive: true}) {
		if o.Err != nil {
			t.Fatal(o.Err)
		}
		names = append(names, o.Key)
	}
	sort.Strings(names)
	return names
}

// packPath is the file in versitygw's directory that holds the pack
// key's blob is in, as s saw it last.
func (e s3Env) packPath(t *testing.T, s *S3, key string) (path string, off int64) {
	t.Helper()
	k, _ := parseKey(key)
	ls := s.locs(k)
	if len(ls) == 0 {
		t.Fatalf("blob %s is in no pack", key[:8])
	}
	return e.srv.ObjectPath(e.bucket, e.prefix+packObject(ls[0].p.id)), ls[0].off
}

func TestS3OpenErrors(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	creds := S3Options{Endpoint: env.srv.Endpoint, AccessKeyID: s3test.AccessKey, SecretAccessKey: s3test.SecretKey}
	for _, raw := range []string{"", "s3:/" + env.bucket, "http://" + env.bucket, "s3://UPPER", "s3://" + env.bucket + "/../x", "s3://" + env.bucket + "/a//b", "s3://" + env.bucket + "?versionId=1", "s3://ab", "s3://127.0.0.1/x"} {
		_, err := OpenS3(ctx, raw, creds)
		t.Logf("%q: %v", raw, err)
		if err == nil || !strings.Contains(err.Error(), "want s3://BUCKET") {
			t.Errorf("OpenS3(%q): %v, want a malformed URL error", raw, err)
		}
	}
	_, err := OpenS3(ctx, "s3://no-such-bucket-here/x", creds)
	t.Logf("missing bucket: %v", err)
	if err == nil || !strings.Contains(err.Error(), `bucket "no-such-bucket-here" does not exist`) || !strings.Contains(err.Error(), "create it first") {
		t.Errorf("missing bucket: %v", err)
	}
	wrong := creds
	wrong.SecretAccessKey = "not-the-secret"
	_, err = OpenS3(ctx, env.url, wrong)
	t.Logf("wrong secret: %v", err)
	if err == nil || !strings.Contains(err.Error(), "refused the credentials") || !strings.Contains(err.Error(), "SignatureDoesNotMatch") || !strings.Contains(err.Error(), "AWS_SECRET_ACCESS_KEY") {
		t.Errorf("wrong secret: %v", err)
	}
	wrong.AccessKeyID, wrong.SecretAccessKey = "nobody", "nothing"
	if _, err = OpenS3(ctx, env.url, wrong); err == nil || !strings.Contains(err.Error(), "refused the credentials") {
		t.Errorf("unknown key: %v", err)
	}
	bad := creds
	bad.Endpoint = "127.0.0.1:1234"
	if _, err = OpenS3(ctx, env.url, bad); err == nil || !strings.Contains(err.Error(), "http://HOST[:PORT]") {
		t.Errorf("endpoint without a scheme: %v", err)
	}
	half := creds
	half.SecretAccessKey = ""
	t.Setenv("AWS_SECRET_ACCESS_KEY", "")
	if _, err = OpenS3(ctx, env.url, half); err == nil || !strings.Contains(err.Error(), "without its secret") {
		t.Errorf("a key without its secret: %v", err)
	}

	// Unreachable: a port nobody listens on, and a server that never
	// answers. Both fail within the connect timeout, naming the endpoint.
	p := env.srv.Proxy(t)
	p.Inject(&s3test.Fault{Delay: time.Minute})
	closed := env.srv.Proxy(t)
	closed.Close()
	for what, ep := range map[string]string{"closed port": closed.URL, "silent server": p.URL} {
		o := creds
		o.Endpoint, o.ConnectTimeout = ep, time.Second
		start := time.Now()
		_, err := OpenS3(ctx, env.url, o)
		t.Logf("%s: %v", what, err)
		if err == nil || !strings.Contains(err.Error(), "cannot reach the S3 endpoint "+ep) || !strings.Contains(err.Error(), "AWS_ENDPOINT_URL") {
			t.Errorf("%s: %v", what, err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("%s: OpenS3 took %s with a 1s connect timeout", what, d)
		}
	}
}

// OpenS3 takes its endpoint, credentials and region from the usual AWS
// variables.
func TestS3OpenFromEnvironment(t *testing.T) {
	env := newS3Env(t)
	env.srv.Setenv(t)
	s, err := OpenS3(context.Background(), env.url, S3Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	k, data := blobOf("env", 10)
	if err := s.Put(context.Background(), k, data); err != nil {
		t.Fatal(err)
	}
	if s.URL() != env.url {
		t.Errorf("URL() = %q, want %q", s.URL(), env.url)
	}
}

func TestResolveS3(t *testing.T) {
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }
	const url = "s3://bucket/p"
	c, err := resolveS3(url, S3Options{}, getenv)
	if err != nil || c.endpoint != awsEndpoint || !c.secure || c.custom || c.region != "" || c.accessKey != "" {
		t.Fatalf("no environment: %+v %v", c, err)
	}
	if c.partSize != 16<<20 || c.concurrency != 4 || c.cacheBytes != 1<<30 || c.connectTimeout != 15*time.Second || c.hasMaxAge != 2*time.Second {
		t.Fatalf("defaults: %+v", c)
	}
	env["AWS_ENDPOINT_URL"] = "https://generic.example:9000"
	env["AWS_ENDPOINT_URL_S3"] = "http://s3only.example:9000"
	env["AWS_DEFAULT_REGION"] = "eu-west-3"
	env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env["AWS_SESSION_TOKEN"] = "id", "secret", "token"
	c, err = resolveS3(url, S3Options{}, getenv)
	if err != nil || c.endpoint != "s3only.example:9000" || c.secure || !c.custom || c.region != "eu-west-3" || c.accessKey != "id" || c.secretKey != "secret" || c.sessionToken != "token" {
		t.Fatalf("environment: %+v %v", c, err)
	}
	env["AWS_REGION"] = "ap-south-1"
	delete(env, "AWS_ENDPOINT_URL_S3")
	c, err = resolveS3(url, S3Options{}, getenv)
	if err != nil || c.endpoint != "generic.example:9000" || !c.secure || c.region != "ap-south-1" {
		t.Fatalf("AWS_ENDPOINT_URL and AWS_REGION: %+v %v", c, err)
	}
	c, err = resolveS3(url, S3Options{Endpoint: "http://opt:1", Region: "r", AccessKeyID: "k", SecretAccessKey: "s"}, getenv)
	if err != nil || c.endpoint != "opt:1" || c.region != "r" || c.accessKey != "k" || c.secretKey != "s" {
		t.Fatalf("options over the environment: %+v %v", c, err)
	}
	delete(env, "AWS_REGION")
	delete(env, "AWS_DEFAULT_REGION")
	if c, _ = resolveS3(url, S3Options{Endpoint: "http://h"}, getenv); c.region != "us-east-1" {
		t.Fatalf("an endpoint without a region: %q", c.region)
	}
	for _, o := range []S3Options{
		{Endpoint: "ftp://h"},
		{Endpoint: "h:9000"},
		{Endpoint: "http://h/path"},
		{Endpoint: "http://user@h"},
		{PartSize: 1 << 20},
		{CacheBytes: -1},
	} {
		if _, err := resolveS3(url, o, getenv); err == nil {
			t.Errorf("resolveS3 took %+v", o)
		}
	}
}

// A batch is one pack object and one index object under the prefix; a
// delete adds a dead list; nothing is written outside the prefix.
func TestS3Layout(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	s := env.open(t, S3Options{})
	blobs := map[string][]byte{}
	var ks []string
	for i := 0; i < 10; i++ {
		k, data := blobOf("layout"+strconv.Itoa(i), 100)
		blobs[k] = data
		ks = append(ks, k)
	}
	stageAll(t, s, blobs)
	names := env.objects(t)
	if len(names) != 2 || !strings.HasPrefix(names[0], env.prefix+"packs/") || !strings.HasSuffix(names[0], ".idx") || !strings.HasSuffix(names[1], ".pack") {
		t.Fatalf("after a batch the bucket holds %v, want one pack and its index", names)
	}
	if fi, err := os.Stat(env.srv.ObjectPath(env.bucket, names[1])); err != nil || fi.Size() != 1000 {
		t.Fatalf("the pack object: %v %v, want 1000 bytes", fi, err)
	}
	if err := s.DeleteKeys(ctx, ks[:2]); err != nil {
		t.Fatal(err)
	}
	names = env.objects(t)
	if len(names) != 3 || !strings.HasPrefix(names[0], env.prefix+"dead/") || !strings.HasSuffix(names[0], ".dead") {
		t.Fatalf("after a delete the bucket holds %v, want a dead list besides", names)
	}
	// Past half dead: rewritten, the old pack and its dead lists gone.
	if err := s.DeleteKeys(ctx, ks[2:6]); err != nil {
		t.Fatal(err)
	}
	names = env.objects(t)
	if len(names) != 2 || !strings.HasSuffix(names[1], ".pack") {
		t.Fatalf("after a rewrite the bucket holds %v, want one pack and its index", names)
	}
	if fi, err := os.Stat(env.srv.ObjectPath(env.bucket, names[1])); err != nil || fi.Size() != 400 {
		t.Fatalf("the rewritten pack: %v %v, want 400 bytes", fi, err)
	}
	if err := s.DeleteKeys(ctx, ks); err != nil {
		t.Fatal(err)
	}
	if names = env.objects(t); len(names) != 0 {
		t.Fatalf("after every blob was deleted the bucket holds %v", names)
	}
}

// Bad keys leave the bucket as it was, and objects that are not the
// store's (beside it, or under its prefix with names it does not make)
// are passed over.
func TestS3BadKeysAndForeignObjects(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	s := env.open(t, S3Options{})
	for _, k := range badKeys {
		_ = s.Put(ctx, k, []byte("x"))
		_, _ = s.Get(ctx, k)
		_, _ = s.Has(ctx, k)
		_ = s.Delete(ctx, k)
	}
	if names := env.objects(t); len(names) != 0 {
		t.Fatalf("bad keys wrote %v", names)
	}
	k, data := blobOf("mine", 10)
	if err := s.Put(ctx, k, data); err != nil {
		t.Fatal(err)
	}
	c := env.srv.Client(t)
	id := strings.Repeat("ab", 16)
	idx := encodeIndex([]packEntry{{key: rawKey{1}, off: 0, size: 3}})
	for _, name := range []string{
		"stasis/blobs2/packs/" + id + ".idx",      // another store beside it
		"stasis/packs/" + id + ".idx",             // above it
		env.prefix + "packs/" + id[:31] + ".idx",  // not a pack id
		env.prefix + "packs/" + id + ".idx.old",   // not an index's name
		env.prefix + "packs/sub/" + id + ".idx",   // deeper
		env.prefix + "dead/" + id + "/junk.dead",  // not a dead list's name
		env.prefix + "PACKS/" + id + ".idx",       // another case
		env.prefix + "packs/" + id + ".pack.part", // not a pack's name
	} {
		if _, err := c.PutObject(ctx, env.bucket, name, bytes.NewReader(idx), int64(len(idx)), minio.PutObjectOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	other := env.open(t, S3Options{})
	for _, st := range []*S3{s, other} {
		if err := st.Refresh(ctx); err != nil {
			t.Fatal(err)
		}
		if got := walkStore(t, st); len(got) != 1 || got[k] != 10 {
			t.Fatalf("Walk with foreign objects about: %v", got)
		}
	}
}

// Get refuses a blob whose bytes do not hash to its key, damaged in the
// server's files or overwritten through S3, naming the key and the pack
// object; a pack cut short is refused too.
func TestS3VerifyOnRead(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	s := env.open(t, S3Options{})
	blobs := map[string][]byte{}
	var ks []string
	for i := 0; i < 3; i++ {
		k, data := blobOf("verify"+strconv.Itoa(i), 5000)
		blobs[k] = data
		ks = append(ks, k)
	}
	sort.Strings(ks)
	stageAll(t, s, blobs)
	path, off := env.packPath(t, s, ks[0])
	pack, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	packName := strings.TrimPrefix(filepath.ToSlash(strings.TrimPrefix(path, env.srv.Root+"/"+env.bucket+"/")), "")
	check := func(what string, k string) {
		t.Helper()
		fresh := env.open(t, S3Options{}) // no cache, nothing read before
		got, err := fresh.Get(ctx, k)
		if !errors.Is(err, ErrCorrupt) || got != nil {
			t.Fatalf("%s: Get gave %d bytes, %v; want ErrCorrupt and no data", what, len(got), err)
		}
		if !strings.Contains(err.Error(), k) || !strings.Contains(err.Error(), packName) {
			t.Fatalf("%s: %v does not name the key and the pack object %s", what, err, packName)
		}
	}
	// A byte flipped in versitygw's file.
	damaged := bytes.Clone(pack)
	damaged[off+17] ^= 0x40
	if err := os.WriteFile(path, damaged, 0o644); err != nil {
		t.Fatal(err)
	}
	check("a flipped byte", ks[0])
	// The other blobs of the pack are intact and served.
	for _, k := range ks[1:] {
		if got, err := env.open(t, S3Options{}).Get(ctx, k); err != nil || !bytes.Equal(got, blobs[k]) {
			t.Fatalf("intact blob %s of a damaged pack: %v", k[:8], err)
		}
	}
	// The pack overwritten through S3 with other bytes of its length.
	other := bytes.Repeat([]byte{7}, len(pack))
	if _, err := env.srv.Client(t).PutObject(ctx, env.bucket, packName, bytes.NewReader(other), int64(len(other)), minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	check("an overwritten pack", ks[0])
	// Cut short.
	if _, err := env.srv.Client(t).PutObject(ctx, env.bucket, packName, bytes.NewReader(pack[:10]), 10, minio.PutObjectOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, k := range ks {
		check("a pack cut short", k)
	}
}

// The read cache keeps at most CacheBytes, least recently used out first;
// it serves a hit without S3, verifies it, and survives a reopening; one
// cache directory serves one store at a time.
func TestS3ReadCache(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	cacheDir := t.TempDir()
	const bound = 10_000
	s := env.open(t, S3Options{CacheDir: cacheDir, CacheBytes: bound})
	blobs := map[string][]byte{}
	var ks []string
	for i := 0; i < 30; i++ {
		k, data := blobOf("cache"+strconv.Itoa(i), 1000+i)
		blobs[k] = data
		ks = append(ks, k)
	}
	big, bigData := blobOf("too big to cache", bound+1)
	blobs[big] = bigData
	stageAll(t, s, blobs)
	cached := func() map[string]bool {
		m := map[string]bool{}
		ents, _ := os.ReadDir(filepath.Join(cacheDir, "blobs"))
		for _, e := range ents {
			m[e.Name()] = true
		}
		return m
	}
	checkBound := func(when string) {
		t.Helper()
		counted, onDisk := s.cache.usage()
		if counted > bound || onDisk > bound || counted != onDisk {
			t.Fatalf("%s: the cache counts %d bytes, holds %d, bound %d", when, counted, onDisk, bound)
		}
	}
	for _, k := range append(ks, big) {
		if got, err := s.Get(ctx, k); err != nil || !bytes.Equal(got, blobs[k]) {
			t.Fatalf("Get %s: %v", k[:8], err)
		}
		checkBound("while reading")
	}
	c := cached()
	if c[big] {
		t.Fatal("a blob larger than the cache was cached")
	}
	// 1021 to 1029 bytes each: the last nine read.
	if len(c) != 9 || !c[ks[29]] || !c[ks[21]] || c[ks[20]] {
		t.Fatalf("the cache holds %d blobs, want the last nine read", len(c))
	}
	// Used again, ks[21] is kept over ks[22] when room is made.
	if _, err := s.Get(ctx, ks[21]); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, ks[0]); err != nil {
		t.Fatal(err)
	}
	if c = cached(); !c[ks[21]] || c[ks[22]] || !c[ks[0]] {
		t.Fatal("the least recently used blob was not the one evicted")
	}
	checkBound("after eviction")

	// A hit is served from the cache: the packs in S3 damaged, it still
	// reads right; a blob not cached is refused.
	for _, k := range []string{ks[29], ks[1]} {
		path, _ := env.packPath(t, s, k)
		if err := os.WriteFile(path, bytes.Repeat([]byte{0}, 32000), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := s.Get(ctx, ks[29]); err != nil || !bytes.Equal(got, blobs[ks[29]]) {
		t.Fatalf("a cache hit with S3 damaged: %v", err)
	}
	if _, err := s.Get(ctx, ks[1]); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("a miss with S3 damaged: %v, want ErrCorrupt", err)
	}
	// A damaged cache file is not served: it goes, and S3 is asked.
	p := filepath.Join(cacheDir, "blobs", ks[28])
	if err := os.WriteFile(p, []byte("damaged"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(ctx, ks[28]); !errors.Is(err, ErrCorrupt) { // S3's copy is damaged too
		t.Fatalf("a damaged cache file: %v, want S3's answer", err)
	}
	if _, err := os.Stat(p); !os.IsNotExist(err) {
		t.Fatal("a damaged cache file was kept")
	}
	checkBound("after a damaged file")

	// One store at a time.
	o := S3Options{Endpoint: env.srv.Endpoint, AccessKeyID: s3test.AccessKey, SecretAccessKey: s3test.SecretKey, CacheDir: cacheDir}
	if _, err := OpenS3(ctx, env.url, o); err == nil || !strings.Contains(err.Error(), "another S3 store uses it") {
		t.Fatalf("a second store on one cache directory: %v", err)
	}
	// Reopened smaller, it keeps the most recently used that fit.
	s.Close()
	o.CacheBytes = 2100
	s2, err := OpenS3(ctx, env.url, o)
	if err != nil {
		t.Fatal(err)
	}
	defer s2.Close()
	if counted, onDisk := s2.cache.usage(); counted > 2100 || onDisk != counted {
		t.Fatalf("reopened with a smaller bound: %d counted, %d held", counted, onDisk)
	}
	if got, err := s2.Get(ctx, ks[29]); err != nil || !bytes.Equal(got, blobs[ks[29]]) {
		t.Fatalf("a blob cached before the reopening: %v", err)
	}
}

// Two nodes on one bucket see each other's writes: Get at once, Has once
// its view is HasMaxAge old (at once with a negative HasMaxAge), Walk at
// once.
func TestS3TwoNodes(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	a := env.open(t, S3Options{})
	b := env.open(t, S3Options{HasMaxAge: time.Hour})
	eager := env.open(t, S3Options{HasMaxAge: -1})
	lazy := env.open(t, S3Options{HasMaxAge: 100 * time.Millisecond})
	for _, n := range []*S3{b, eager, lazy} {
		if _, err := n.Has(ctx, key('0')); err != nil { // a listing now
			t.Fatal(err)
		}
	}
	k, data := blobOf("from a", 100)
	if err := a.Put(ctx, k, data); err != nil {
		t.Fatal(err)
	}
	if has, _ := b.Has(ctx, k); has {
		t.Fatal("Has listed again although its view is younger than HasMaxAge")
	}
	if has, err := eager.Has(ctx, k); !has || err != nil {
		t.Fatalf("Has with a negative HasMaxAge: %v %v", has, err)
	}
	testwait.Until(t, "a node with a HasMaxAge of 100ms sees another's Put", 10*time.Second, func() bool {
		has, err := lazy.Has(ctx, k)
		return has && err == nil
	})
	if got, err := b.Get(ctx, k); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get of another node's blob: %v", err)
	}
	if got := walkStore(t, b); len(got) != 1 {
		t.Fatalf("Walk on another node: %v", got)
	}
}

// With ReuseWithin, Has does not report a blob stored longer ago; Put
// stores it again, and Get serves it either way.
func TestS3ReuseWithin(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	s := env.open(t, S3Options{ReuseWithin: time.Hour})
	k, data := blobOf("reused", 100)
	if err := s.Put(ctx, k, data); err != nil {
		t.Fatal(err)
	}
	if has, _ := s.Has(ctx, k); !has {
		t.Fatal("a blob just stored is not reported")
	}
	ageIndexes(t, env.srv.ObjectPath(env.bucket, env.prefix+"packs"), 2*time.Hour)
	if err := s.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	if has, _ := s.Has(ctx, k); has {
		t.Fatal("a blob stored two hours ago is reported within an hour's reuse")
	}
	if has, err := s.HasAny(ctx, k); err != nil || !has {
		t.Fatalf("HasAny of a blob stored two hours ago: %v %v", has, err)
	}
	if has, err := s.HasAny(ctx, strings.Repeat("0", KeyLen)); err != nil || has {
		t.Fatalf("HasAny of a blob never stored: %v %v", has, err)
	}
	if got, err := s.Get(ctx, k); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("Get of an old blob: %v", err)
	}
	if err := s.Put(ctx, k, data); err != nil {
		t.Fatal(err)
	}
	if has, _ := s.Has(ctx, k); !has {
		t.Fatal("a blob stored again is not reported")
	}
	if names := env.objects(t); len(names) != 4 {
		t.Fatalf("the bucket holds %v, want two packs of one blob", names)
	}
	stored := map[string]time.Time{}
	if _, err := s.WalkStored(ctx, func(k string, _ int64, at time.Time) error { stored[k] = at; return nil }); err != nil {
		t.Fatal(err)
	}
	if len(stored) != 1 || time.Since(stored[k]) > time.Minute {
		t.Fatalf("WalkStored: %v, want the newer copy's time", stored)
	}
}

// ageIndexes sets the mtime, which versitygw gives as Last-Modified, of
// every index object in dir to age ago.
func ageIndexes(t *testing.T, dir string, age time.Duration) {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	then := time.Now().Add(-age)
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), idxExt) {
			if err := os.Chtimes(filepath.Join(dir, e.Name()), then, then); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// What a crash or a removal leaves: a pack without its index (invisible,
// removed by a delete once an hour old), a dead list of a pack without an
// index (likewise), a damaged index (its blobs read as missing, the rest
// is served).
func TestS3Leftovers(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	s := env.open(t, S3Options{})
	c := env.srv.Client(t)
	k1, d1 := blobOf("one", 10)
	k2, d2 := blobOf("two", 10)
	for k, d := range map[string][]byte{k1: d1, k2: d2} {
		if err := s.Put(ctx, k, d); err != nil {
			t.Fatal(err)
		}
	}
	put := func(name string, data []byte) string {
		t.Helper()
		if _, err := c.PutObject(ctx, env.bucket, env.prefix+name, bytes.NewReader(data), int64(len(data)), minio.PutObjectOptions{}); err != nil {
			t.Fatal(err)
		}
		return env.srv.ObjectPath(env.bucket, env.prefix+name)
	}
	k3, d3 := blobOf("three", 10)
	oldPack := put(packObject(strings.Repeat("1", 32)), d3)
	newPack := put(packObject(strings.Repeat("2", 32)), d3)
	oldDead := put(s3DeadDir+strings.Repeat("3", 32)+"/"+strings.Repeat("4", 32)+s3DeadExt, encodeDead(nil))
	newDead := put(s3DeadDir+strings.Repeat("3", 32)+"/"+strings.Repeat("5", 32)+s3DeadExt, encodeDead(nil))
	past := time.Now().Add(-2 * staleStaging)
	for _, p := range []string{oldPack, oldDead} {
		if err := os.Chtimes(p, past, past); err != nil {
			t.Fatal(err)
		}
	}
	if has, _ := s.Has(ctx, k3); has {
		t.Fatal("a pack without its index is visible")
	}
	if err := s.Delete(ctx, key('9')); err != nil { // any delete clears leftovers
		t.Fatal(err)
	}
	for p, want := range map[string]bool{oldPack: false, newPack: true, oldDead: false, newDead: true} {
		if _, err := os.Stat(p); (err == nil) != want {
			t.Errorf("%s: there is %v, want %v", filepath.Base(p), err == nil, want)
		}
	}
	// A damaged index: its blob reads as missing; the rest is served.
	path, _ := env.packPath(t, s, k1)
	idx := strings.TrimSuffix(path, packExt) + idxExt
	b, err := os.ReadFile(idx)
	if err != nil {
		t.Fatal(err)
	}
	b[len(idxMagic)+3] ^= 1
	if err := os.WriteFile(idx, b, 0o644); err != nil {
		t.Fatal(err)
	}
	again := env.open(t, S3Options{})
	if _, err := again.Get(ctx, k1); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get from a pack with a damaged index: %v", err)
	}
	if got, err := again.Get(ctx, k2); err != nil || !bytes.Equal(got, d2) {
		t.Fatalf("Get from an intact pack: %v", err)
	}
}

// Records are put, replaced, read back by another handle, listed and
// deleted; bad names are refused.
func TestS3Records(t *testing.T) {
	ctx := context.Background()
	a := newS3Env(t).open(t, S3Options{})
	if _, err := a.GetRecord(ctx, "snapshots/local/snap-1.json"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a record never put: %v", err)
	}
	for _, doc := range []string{`{"v":1}`, `{"v":2}`} {
		if err := a.PutRecord(ctx, "snapshots/local/snap-1.json", []byte(doc)); err != nil {
			t.Fatal(err)
		}
	}
	if err := a.PutRecord(ctx, "snapshots/local/snap-2.json", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	b, err := a.GetRecord(ctx, "snapshots/local/snap-1.json")
	if err != nil || string(b) != `{"v":2}` {
		t.Fatalf("record: %s %v", b, err)
	}
	names, err := a.ListRecords(ctx, "snapshots/local/")
	if err != nil || strings.Join(names, " ") != "snapshots/local/snap-1.json snapshots/local/snap-2.json" {
		t.Fatalf("list: %v %v", names, err)
	}
	for _, name := range []string{"snapshots/local/snap-1.json", "snapshots/local/never.json"} {
		if err := a.DeleteRecord(ctx, name); err != nil {
			t.Fatalf("delete %s: %v", name, err)
		}
	}
	if _, err := a.GetRecord(ctx, "snapshots/local/snap-1.json"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a deleted record: %v", err)
	}
	if names, err := a.ListRecords(ctx, "snapshots/local/"); err != nil || strings.Join(names, " ") != "snapshots/local/snap-2.json" {
		t.Fatalf("list after a delete: %v %v", names, err)
	}
	for _, bad := range []string{"", "../x", "a/../b", "/abs", "a//b", strings.Repeat("x", 200)} {
		if err := a.PutRecord(ctx, bad, nil); err == nil {
			t.Errorf("PutRecord(%q) was accepted", bad)
		}
		if err := a.DeleteRecord(ctx, bad); err == nil {
			t.Errorf("DeleteRecord(%q) was accepted", bad)
		}
	}
}

// listings returns the listings p has seen since the first from: each
// one's prefix and start-after, under the store's prefix.
func (e s3Env) listings(t *testing.T, p *s3test.Proxy, from int) (got [][2]string) {
	t.Helper()
	for _, r := range p.Requests()[from:] {
		_, query, _ := strings.Cut(r, "?")
		q, err := url.ParseQuery(query)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(r, "GET ") || q.Get("list-type") != "2" {
			continue
		}
		got = append(got, [2]string{strings.TrimPrefix(q.Get("prefix"), e.prefix), strings.TrimPrefix(q.Get("start-after"), e.prefix)})
	}
	return got
}

// With a ReuseWithin, Has lists again only the packs begun since its last
// listing (less recentMargin): the listing a snapshot's misses make no
// longer grows with every pack the store keeps. No listing takes in the
// snapshots' records. A pack begun before that (a long upload) is missed
// by Has, which then reports its blobs missing (they are stored again),
// and found by Get, which lists the whole store.
func TestS3HasListsRecentPacksOnly(t *testing.T) {
	env := newS3Env(t)
	ctx := context.Background()
	a := env.open(t, S3Options{ReuseWithin: time.Hour})
	p := env.srv.Proxy(t)
	b := env.openVia(t, p, S3Options{ReuseWithin: time.Hour, HasMaxAge: -1})
	if err := a.PutRecord(ctx, "snapshots/local/s-1.json", []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	full := [][2]string{{"packs/", ""}, {"dead/", ""}}
	if got := env.listings(t, p, 0); !reflect.DeepEqual(got, full) {
		t.Fatalf("the listing when the store opens: %q, want %q", got, full)
	}

	k1, d1 := blobOf("recent", 100)
	if err := a.Put(ctx, k1, d1); err != nil {
		t.Fatal(err)
	}
	seen := len(p.Requests())
	lo, hi := packIDTime(time.Now().Add(-recentMargin-time.Minute)), packIDTime(time.Now())
	if has, err := b.Has(ctx, k1); !has || err != nil {
		t.Fatalf("Has of a blob another node just stored: %v %v", has, err)
	}
	got := env.listings(t, p, seen)
	if len(got) != 2 || got[0][0] != "packs/" || got[1][0] != "dead/" {
		t.Fatalf("Has listed %q, want packs/ and dead/ after a recent id", got)
	}
	for _, l := range got {
		if after := strings.TrimPrefix(l[1], l[0]); after < lo || after > hi {
			t.Fatalf("Has listed %s after %q, want after an id of between %s and %s", l[0], after, lo, hi)
		}
	}

	// A pack whose id is older than the margin, committed since: missed
	// by Has, found by Get.
	packClock = func() time.Time { return time.Now().Add(-2 * recentMargin) }
	k2, d2 := blobOf("a long upload", 100)
	err := a.Put(ctx, k2, d2)
	packClock = time.Now
	if err != nil {
		t.Fatal(err)
	}
	if has, err := b.Has(ctx, k2); has || err != nil {
		t.Fatalf("Has of a blob in a pack begun before the margin: %v %v, want false (the listing of recent packs does not see it)", has, err)
	}
	seen = len(p.Requests())
	if got, err := b.Get(ctx, k2); err != nil || !bytes.Equal(got, d2) {
		t.Fatalf("Get of it: %v", err)
	}
	if got := env.listings(t, p, seen); !reflect.DeepEqual(got, full) {
		t.Fatalf("Get listed %q, want the whole store %q", got, full)
	}
	if has, err := b.Has(ctx, k2); !has || err != nil {
		t.Fatalf("Has of it after Get's listing: %v %v", has, err)
	}
	for _, o := range env.objects(t) {
		if strings.HasPrefix(o, env.prefix+s3PacksDir) && !strings.HasSuffix(o, idxExt) {
			if n := parseS3Name(strings.TrimPrefix(o, env.prefix)); n.kind != 'p' || n.id[:8] > hi || n.id[:8] < packIDTime(time.Now().Add(-10*time.Minute)) {
				t.Fatalf("pack %s: its id does not begin with the time it was begun", o)
			}
		}
	}
}
