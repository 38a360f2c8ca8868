package blob

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"
	"github.com/minio/minio-go/v7/pkg/credentials"
	"github.com/zeebo/blake3"
)

// S3 is a Store in an S3 bucket, under a prefix, that any number of
// nodes use at once. The layout under the prefix is Dir's packs, as
// objects:
//   - packs/ID.pack: a pack, the bytes of a batch's blobs back to back
//     (uploaded in parts when larger than S3Options.PartSize);
//   - packs/ID.idx: its index (encodeIndex), uploaded after the pack, so
//     that a pack without its index, a commit cut short, is invisible;
//   - dead/ID/RAND.dead: a dead list (encodeDead) of blobs deleted from
//     pack ID. Dead lists are only ever added, each under a new random
//     name, so that nodes deleting from one pack at once lose neither's
//     deletes; a pack's dead blobs are the union of its lists.
//
// A pack whose every blob is dead is removed, its index first; one more
// than half dead is rewritten with its live blobs (a new pack) and then
// removed. Put stores one blob as a pack of one.
//
// Each node keeps a view of the indexes in memory, listed and read when
// it opens the store and again when a key is not found (other nodes write
// to the bucket: Get lists again before it reports a key missing; Has
// when its view is older than S3Options.HasMaxAge; Walk and deletes always
// list first). Get reads a blob with one ranged GET of its pack, and
// verifies it: bytes that do not hash to the key are an error wrapping
// ErrCorrupt, never data. With a CacheDir, blobs read are kept in a local
// read cache, bounded, least recently used out first.
//
// S3 implements Batcher, PackFiler, BulkDeleter and Ager. Its store times
// are the index objects' Last-Modified times, by the server's clock,
// rounded up to the second (S3 lists them to the second).
type S3 struct {
	cfg     s3Config
	loc     s3Location
	client  *minio.Client // retries what fails, itself
	core    minio.Core
	up      minio.Core // for uploads: tries once (see upload)
	clock   *serverClock
	tr      *http.Transport
	cache   *s3Cache // nil: no read cache
	staging string   // where batches and pack files are written

	view   *packSet // packs and keys; its dir and mtime are unused
	listMu sync.Mutex
	listed time.Time // when the last full listing began (local clock)
	// listedRecent is when the last listing, full or of the recent packs
	// only, began.
	listedRecent time.Time
	orphans      []s3Orphan     // leftovers the last listing saw
	delMu        sync.Mutex     // serialises this node's deletes
	bg           sync.WaitGroup // cleanups of failed commits under way
}

var (
	_ Store       = (*S3)(nil)
	_ Batcher     = (*S3)(nil)
	_ PackFiler   = (*S3)(nil)
	_ BulkDeleter = (*S3)(nil)
	_ Ager        = (*S3)(nil)
	_ AnyHaver    = (*S3)(nil)
)

// OpenS3 opens the store at rawURL, s3://BUCKET[/PREFIX], with opts and
// the AWS environment variables (see S3Options). It checks that the
// bucket exists and that the credentials are accepted, within
// opts.ConnectTimeout, and lists the store's indexes.
func OpenS3(ctx context.Context, rawURL string, opts S3Options) (*S3, error) {
	cfg, err := resolveS3(rawURL, opts, os.Getenv)
	if err != nil {
		return nil, err
	}
	s := &S3{cfg: cfg, loc: cfg.loc, clock: &serverClock{}, view: newPackSet("")}
	s.tr = &http.Transport{
		Proxy:                 http.ProxyFromEnvironment,
		DialContext:           (&net.Dialer{Timeout: cfg.connectTimeout, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   64,
		ResponseHeaderTimeout: 2 * time.Minute,
		IdleConnTimeout:       time.Minute,
		TLSHandshakeTimeout:   cfg.connectTimeout,
		ExpectContinueTimeout: time.Second,
		DisableCompression:    true,
	}
	if cfg.secure {
		s.tr.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	creds := credentials.NewStaticV4(cfg.accessKey, cfg.secretKey, cfg.sessionToken)
	if cfg.accessKey == "" {
		creds = credentials.NewStatic("", "", "", credentials.SignatureAnonymous)
	}
	lookup := minio.BucketLookupAuto
	if cfg.custom {
		lookup = minio.BucketLookupPath
	}
	mopts := &minio.Options{
		Creds:        creds,
		Secure:       cfg.secure,
		Transport:    &clockTransport{base: s.tr, clock: s.clock},
		Region:       cfg.region,
		BucketLookup: lookup,
		MaxRetries:   cfg.maxRetries,
	}
	if s.client, err = minio.New(cfg.endpoint, mopts); err != nil {
		return nil, fmt.Errorf("s3 store %s: %w", s.loc, err)
	}
	mopts.MaxRetries = 1
	up, err := minio.New(cfg.endpoint, mopts)
	if err != nil {
		return nil, fmt.Errorf("s3 store %s: %w", s.loc, err)
	}
	s.up = minio.Core{Client: up}
	s.core = minio.Core{Client: s.client}

	if err := s.checkBucket(ctx); err != nil {
		s.tr.CloseIdleConnections()
		return nil, err
	}
	s.staging = os.TempDir()
	if cfg.cacheDir != "" {
		s.staging = filepath.Join(cfg.cacheDir, "staging")
		if err := os.MkdirAll(s.staging, 0o700); err != nil {
			return nil, fmt.Errorf("s3 store %s: cache directory: %w", s.loc, err)
		}
		if s.cache, err = openS3Cache(cfg.cacheDir, cfg.cacheBytes); err != nil {
			return nil, fmt.Errorf("s3 store %s: %w", s.loc, err)
		}
		clearStaging(s.staging)
	}
	if err := s.refresh(ctx, time.Now()); err != nil {
		s.Close()
		return nil, fmt.Errorf("s3 store %s: %w", s.loc, err)
	}
	return s, nil
}

// Close waits for the cleanups of failed commits still under way (30s at
// most), and releases the read cache and idle connections. The S3 value
// must not be used after.
func (s *S3) Close() error {
	s.bg.Wait()
	if s.cache != nil {
		s.cache.close()
	}
	s.tr.CloseIdleConnections()
	return nil
}

// URL is the store's canonical URL, s3://BUCKET/PREFIX.
func (s *S3) URL() string { return s.loc.String() }

// Now is the time by the S3 server's clock, as this node estimates it
// from the Date of the server's responses (never later than it is).
func (s *S3) Now() time.Time { return s.clock.at(time.Now()) }

// checkBucket checks that the bucket exists and takes the credentials,
// within the connect timeout, and explains what it finds wrong.
func (s *S3) checkBucket(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.connectTimeout)
	defer cancel()
	ok, err := s.client.BucketExists(ctx, s.loc.bucket)
	code := minio.ToErrorResponse(err).Code
	if (err == nil && !ok) || code == "AccessDenied" {
		// A HEAD answer has no body to say why: a listing's has. (Some
		// servers answer a HEAD with an unknown key as if the bucket
		// were missing.)
		err = nil
		lctx, lcancel := context.WithCancel(ctx)
		for o := range s.client.ListObjects(lctx, s.loc.bucket, minio.ListObjectsOptions{Prefix: s.loc.prefix, MaxKeys: 1}) {
			err = o.Err
			break
		}
		lcancel()
		code = minio.ToErrorResponse(err).Code
		if err == nil {
			return nil // it can be listed: it is there
		}
		if code == "NoSuchBucket" {
			return fmt.Errorf("s3 store %s: bucket %q does not exist at %s: create it first (for instance: aws s3 mb s3://%s, with the same endpoint and credentials); stasis does not create buckets", s.loc, s.loc.bucket, s.endpointURL(), s.loc.bucket)
		}
	}
	if err == nil {
		return nil
	}
	if credentialsRefused(err) {
		return fmt.Errorf("s3 store %s: %s refused the credentials for bucket %q (%s): %w; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary credentials), or the S3Options fields, to a key allowed to read, write and delete in the bucket", s.loc, s.endpointURL(), s.loc.bucket, code, err)
	}
	if ctx.Err() != nil || minio.ToErrorResponse(err).StatusCode == 0 {
		return fmt.Errorf("s3 store %s: cannot reach the S3 endpoint %s within %s: %w; check the endpoint (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL or S3Options.Endpoint; http:// for a server without TLS) and the network", s.loc, s.endpointURL(), s.cfg.connectTimeout, err)
	}
	return fmt.Errorf("s3 store %s: checking bucket %q at %s: %w", s.loc, s.loc.bucket, s.endpointURL(), err)
}

// credentialsRefused reports whether err is the server's refusal of the
// credentials: a 403, or an error code about the key, its signature or
// its token (servers differ: versitygw says XAdminUserNotFound, with a
// 404, for a key it does not know).
func credentialsRefused(err error) bool {
	r := minio.ToErrorResponse(err)
	switch r.Code {
	case "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidClientTokenId":
		return true
	}
	return r.StatusCode == 403 || strings.Contains(r.Code, "UserNotFound") || strings.Contains(r.Code, "AccessKey")
}

func (s *S3) endpointURL() string {
	if s.cfg.secure {
		return "https://" + s.cfg.endpoint
	}
	return "http://" + s.cfg.endpoint
}

// locs returns where key's live copies are, newest first as added.
func (s *S3) locs(k rawKey) []loc {
	s.view.mu.RLock()
	defer s.view.mu.RUnlock()
	var ls []loc
	for l := s.view.keys[k]; l != nil; l = l.next {
		ls = append(ls, *l)
	}
	return ls
}

// usable reports whether key has a live copy Has may report: one stored
// within ReuseWithin, when that is set.
func (s *S3) usable(k rawKey) bool {
	now := s.Now()
	s.view.mu.RLock()
	defer s.view.mu.RUnlock()
	for l := s.view.keys[k]; l != nil; l = l.next {
		if s.cfg.reuseWithin <= 0 || now.Sub(l.p.stored) < s.cfg.reuseWithin {
			return true
		}
	}
	return false
}

// Put stores data under key as a pack of one blob, unless key is stored
// already (as Has says).
func (s *S3) Put(ctx context.Context, key string, data []byte) error {
	k, err := parseKey(key)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if s.usable(k) {
		return nil
	}
	b := s.NewBatch()
	defer b.Abort()
	if err := b.Stage(ctx, key, data); err != nil {
		return fmt.Errorf("put blob %s: %w", key, err)
	}
	if err := b.Commit(ctx); err != nil {
		return fmt.Errorf("put blob %s: %w", key, err)
	}
	return nil
}

// Get returns key's blob, verified: from the read cache if it is there,
// else with a ranged GET of a pack that holds it.
func (s *S3) Get(ctx context.Context, key string) ([]byte, error) {
	k, err := parseKey(key)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if s.cache != nil {
		if b, ok := s.cache.get(k); ok {
			return b, nil
		}
	}
	asked := time.Now()
	listed := false
	for {
		ls := s.locs(k)
		var first error
		for _, l := range ls {
			b, err := s.readBlob(ctx, k, l)
			if err == nil {
				if s.cache != nil {
					s.cache.put(k, b)
				}
				return b, nil
			}
			if ctx.Err() != nil {
				return nil, fmt.Errorf("get blob %s: %w", key, ctx.Err())
			}
			if errors.Is(err, errNoObject) {
				continue // removed or rewritten since this node listed
			}
			if first == nil {
				first = err
			}
		}
		if first != nil {
			return nil, first
		}
		if listed {
			// Not found, or gone, in a listing begun since the call
			// began: it is not stored.
			return nil, fmt.Errorf("blob %s in %s: %w", key, s.loc, ErrNotFound)
		}
		if err := s.refresh(ctx, asked); err != nil {
			return nil, fmt.Errorf("get blob %s: %w", key, err)
		}
		listed = true
	}
}

// s3ReadTries is how many times a blob's ranged GET is tried when the
// connection is cut while the bytes come (the client library retries
// what fails before they do).
const s3ReadTries = 3

// readBlob reads one copy of k and verifies it.
func (s *S3) readBlob(ctx context.Context, k rawKey, l loc) ([]byte, error) {
	name := packObject(l.p.id)
	var data []byte
	for try := 1; l.size > 0; try++ {
		b, err := s.getRange(ctx, name, l.off, l.size)
		if err == nil {
			data = b
			break
		}
		var cut *cutError
		if !errors.As(err, &cut) || try == s3ReadTries || ctx.Err() != nil {
			return nil, fmt.Errorf("get blob %s from %s (offset %d, %d bytes): %w", k, s.loc.object(name), l.off, l.size, err)
		}
		slog.Debug("an S3 read was cut short; trying again", "object", s.loc.object(name), "err", err)
	}
	if sum := blake3.Sum256(data); !bytes.Equal(sum[:], k[:]) {
		return nil, fmt.Errorf("blob %s in pack object %s (offset %d, %d bytes): %w: its content hashes to %x; the pack is damaged", k, s.loc.object(name), l.off, l.size, ErrCorrupt, sum)
	}
	return data, nil
}

// cutError is a read whose connection ended before the bytes did.
type cutError struct {
	got, want int64
	err       error
}

func (e *cutError) Error() string {
	return fmt.Sprintf("the connection was cut after %d of %d bytes: %v", e.got, e.want, e.err)
}
func (e *cutError) Unwrap() error { return e.err }

// getRange reads [off, off+size) of an object.
func (s *S3) getRange(ctx context.Context, name string, off, size int64) ([]byte, error) {
	var opts minio.GetObjectOptions
	if err := opts.SetRange(off, off+size-1); err != nil {
		return nil, err
	}
	rc, info, _, err := s.core.GetObject(ctx, s.loc.bucket, s.loc.prefix+name, opts)
	if isNoObject(err) {
		return nil, errNoObject
	}
	if minio.ToErrorResponse(err).Code == "InvalidRange" {
		return nil, fmt.Errorf("%w: the pack ends before the blob begins", ErrCorrupt)
	}
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	if info.Size >= 0 && info.Size < size {
		return nil, fmt.Errorf("%w: the pack holds %d of the blob's %d bytes", ErrCorrupt, info.Size, size)
	}
	b := make([]byte, size)
	n, err := io.ReadFull(rc, b)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &cutError{int64(n), size, err}
	}
	return b, nil
}

// Has reports whether key is stored, as this node's view says; a key
// missing from a view older than S3Options.HasMaxAge is looked for again
// after a new listing.
func (s *S3) Has(ctx context.Context, key string) (bool, error) {
	return s.has(ctx, key, s.usable)
}

// HasAny reports whether any copy of key is stored, however long ago:
// Has without S3Options.ReuseWithin. A caller relies on such a copy only
// when something every collector marks keeps it (a sandbox's published
// incremental base), not merely because it is there.
func (s *S3) HasAny(ctx context.Context, key string) (bool, error) {
	return s.has(ctx, key, func(k rawKey) bool { return len(s.locs(k)) > 0 })
}

// has reports whether found says key is stored, looking again after a
// new listing when this node's view does not.
func (s *S3) has(ctx context.Context, key string, found func(rawKey) bool) (bool, error) {
	k, err := parseKey(key)
	if err != nil {
		return false, err
	}
	if err := ctx.Err(); err != nil {
		return false, err
	}
	if found(k) {
		return true, nil
	}
	notBefore := time.Now()
	if s.cfg.hasMaxAge > 0 {
		notBefore = notBefore.Add(-s.cfg.hasMaxAge)
	}
	if err := s.refreshWith(ctx, notBefore, true); err != nil {
		return false, fmt.Errorf("blob %s: %w", key, err)
	}
	return found(k), nil
}

// Refresh lists the store again, so that this node sees what others
// committed and deleted up to now.
func (s *S3) Refresh(ctx context.Context) error {
	return s.refresh(ctx, time.Now())
}

// Walk calls fn for every stored blob once, after listing the store.
func (s *S3) Walk(ctx context.Context, fn func(key string, size int64) error) error {
	_, err := s.walk(ctx, func(k string, size int64, _ time.Time) error { return fn(k, size) })
	return err
}

// WalkStored is Walk with each blob's store time (see Ager).
func (s *S3) WalkStored(ctx context.Context, fn func(key string, size int64, stored time.Time) error) (time.Time, error) {
	return s.walk(ctx, fn)
}

func (s *S3) walk(ctx context.Context, fn func(key string, size int64, stored time.Time) error) (time.Time, error) {
	asked := time.Now()
	asOf := s.clock.at(asked)
	if err := s.refresh(ctx, asked); err != nil {
		return time.Time{}, fmt.Errorf("walk %s: %w", s.loc, err)
	}
	type kv struct {
		key    rawKey
		size   int64
		stored time.Time
	}
	s.view.mu.RLock()
	all := make([]kv, 0, len(s.view.keys))
	for k, l := range s.view.keys {
		b := kv{k, l.size, l.p.stored}
		for o := l.next; o != nil; o = o.next {
			if o.p.stored.After(b.stored) {
				b.stored = o.p.stored
			}
		}
		all = append(all, b)
	}
	s.view.mu.RUnlock()
	for _, b := range all {
		if err := ctx.Err(); err != nil {
			return time.Time{}, err
		}
		if err := fn(b.key.String(), b.size, b.stored); err != nil {
			return time.Time{}, err
		}
	}
	return asOf, nil
}
