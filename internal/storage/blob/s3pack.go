package blob

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"
)

// Writing packs to S3. A batch or a pack file is written to a local file
// (a batch's first few MiB in memory), and Commit uploads it as one pack
// object, in parts when it is larger than the part size, then its index.

// s3MemStage is how much of a batch stays in memory before it goes to a
// temporary file.
const s3MemStage = 8 << 20

// s3TempPrefix begins the names of the temporary files of batches and
// pack files.
const s3TempPrefix = "stasis-s3-pack-"

// publish uploads a pack, its bytes r[0:size) and then its index, and adds
// it to the view. On failure it removes what it may have left (the index
// first, then the pack, then an incomplete upload), with a context of its
// own, so that each blob of the pack is absent.
func (s *S3) publish(ctx context.Context, r io.ReaderAt, size int64, entries []packEntry) (*pack, error) {
	id := newPackID()
	idx := encodeIndex(entries)
	err := s.upload(ctx, packObject(id), r, size)
	if err != nil {
		err = fmt.Errorf("upload pack %s (%d bytes): %w", s.loc.object(packObject(id)), size, err)
	} else if err = s.upload(ctx, indexObject(id), bytes.NewReader(idx), int64(len(idx))); err != nil {
		err = fmt.Errorf("upload pack index %s: %w", s.loc.object(indexObject(id)), err)
	}
	if err != nil {
		s.unpublish(ctx, id)
		return nil, err
	}
	p := &pack{id: id, entries: entries, dead: map[rawKey]bool{}, deadObjs: map[string]bool{}, stored: roundUpSecond(s.Now().Truncate(time.Second))}
	for _, e := range entries {
		p.bytes += e.size
	}
	s.view.mu.Lock()
	if old := s.view.packs[id]; old == nil {
		s.view.packs[id] = p
		s.view.add(p)
	}
	s.view.mu.Unlock()
	return p, nil
}

// upload puts object name (under the prefix), size bytes read from r: in
// one PUT when they are no more than the part size, else as a multipart
// upload of part-size parts, Concurrency at once. Each request is tried
// up to MaxRetries times, each time with a reader of its own: the client
// library's own retries rewind the one reader they were given, which the
// transport of a request the server answered early (with an error) may
// still be reading.
func (s *S3) upload(ctx context.Context, name string, r io.ReaderAt, size int64) error {
	obj := s.loc.prefix + name
	opts := minio.PutObjectOptions{ContentType: "application/octet-stream"}
	if size <= s.cfg.partSize {
		return s.retry(ctx, func() error {
			_, err := s.up.PutObject(ctx, s.loc.bucket, obj, io.NewSectionReader(r, 0, size), size, "", "", opts)
			return err
		})
	}
	var uploadID string
	err := s.retry(ctx, func() (err error) {
		uploadID, err = s.up.NewMultipartUpload(ctx, s.loc.bucket, obj, opts)
		return err
	})
	if err != nil {
		return err
	}
	n := int((size + s.cfg.partSize - 1) / s.cfg.partSize)
	parts := make([]minio.CompletePart, n)
	err = forEach(ctx, n, s.cfg.concurrency, func(i int) error {
		off := int64(i) * s.cfg.partSize
		length := min(s.cfg.partSize, size-off)
		return s.retry(ctx, func() error {
			p, err := s.up.PutObjectPart(ctx, s.loc.bucket, obj, uploadID, i+1, io.NewSectionReader(r, off, length), length, minio.PutObjectPartOptions{})
			if err != nil {
				return fmt.Errorf("part %d of %d: %w", i+1, n, err)
			}
			parts[i] = minio.CompletePart{PartNumber: i + 1, ETag: p.ETag}
			return nil
		})
	})
	if err == nil {
		err = s.retry(ctx, func() error {
			_, err := s.up.CompleteMultipartUpload(ctx, s.loc.bucket, obj, uploadID, parts, opts)
			return err
		})
	}
	return err // on failure, the caller's unpublish aborts the upload
}

// retry calls op until it succeeds, fails for good, or has been tried
// MaxRetries times, waiting a little longer each time (100ms, doubled, 2s
// at most).
func (s *S3) retry(ctx context.Context, op func() error) error {
	wait := 100 * time.Millisecond
	for try := 1; ; try++ {
		err := op()
		if err == nil || try >= s.cfg.maxRetries || !retryable(ctx, err) {
			return err
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// retryable reports whether a request that failed with err may succeed
// if tried again: the connection failed, or the server failed or asked
// to slow down.
func retryable(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	r := minio.ToErrorResponse(err)
	switch r.Code {
	case "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "RequestTimeTooSkewed":
		return true
	}
	return r.StatusCode == 0 || r.StatusCode >= 500 || r.StatusCode == http.StatusTooManyRequests || r.StatusCode == http.StatusRequestTimeout
}

// unpublish removes what a failed publish may have left of pack id, within
// s3CleanupTimeout. When the caller's context has ended (the usual reason
// for the failure), it does so in the background, so that the caller
// returns at once; Close waits for it.
func (s *S3) unpublish(ctx context.Context, id string) {
	clean := func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s3CleanupTimeout)
		defer cancel()
		for _, name := range []string{indexObject(id), packObject(id)} {
			_ = s.client.RemoveObject(ctx, s.loc.bucket, s.loc.prefix+name, minio.RemoveObjectOptions{})
		}
		_ = s.client.RemoveIncompleteUpload(ctx, s.loc.bucket, s.loc.prefix+packObject(id))
	}
	if ctx.Err() == nil {
		clean()
		return
	}
	s.bg.Add(1)
	go func() {
		defer s.bg.Done()
		clean()
	}()
}

// s3CleanupTimeout bounds the removal of what a failed commit left.
const s3CleanupTimeout = 30 * time.Second

// sortedEntries returns the entries in offset order, refusing overlaps.
func sortedEntries(m map[rawKey]packEntry) ([]packEntry, error) {
	entries := make([]packEntry, 0, len(m))
	for _, e := range m {
		entries = append(entries, e)
	}
	slices.SortFunc(entries, func(x, y packEntry) int { return cmp.Compare(x.off, y.off) })
	for i := 1; i < len(entries); i++ {
		if entries[i].off < entries[i-1].off+entries[i-1].size {
			return nil, fmt.Errorf("blobs %s and %s overlap", entries[i-1].key, entries[i].key)
		}
	}
	return entries, nil
}

func (s *S3) tempFile() (*os.File, error) {
	return os.CreateTemp(s.staging, s3TempPrefix+"*")
}

// clearStaging removes the temporary files a crash left in a cache
// directory's staging directory (the cache's lock says nobody else uses
// it).
func clearStaging(dir string) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), s3TempPrefix) {
			_ = os.Remove(filepath.Join(dir, e.Name()))
		}
	}
}

// s3Batch is a batch on its way to S3.
type s3Batch struct {
	s       *S3
	mu      sync.Mutex
	buf     []byte   // the staged bytes while they are few
	f       *os.File // the staged bytes once they are not
	size    int64
	entries map[rawKey]packEntry
	err     error // the first failed write: Commit refuses
}

// NewBatch starts a batch, which Commit uploads as one pack object and
// its index. Staged blobs are kept in memory up to 8 MiB, then in a
// temporary file (in CacheDir/staging, or os.TempDir()).
func (s *S3) NewBatch() Batch {
	return &s3Batch{s: s, entries: map[rawKey]packEntry{}}
}

func (b *s3Batch) Stage(ctx context.Context, key string, data []byte) error {
	k, err := parseKey(key)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	if _, ok := b.entries[k]; ok {
		b.mu.Unlock()
		return nil
	}
	e := packEntry{key: k, off: b.size, size: int64(len(data))}
	if b.f == nil && e.off+e.size <= s3MemStage {
		b.buf = append(b.buf, data...)
		b.entries[k] = e
		b.size += e.size
		b.mu.Unlock()
		return nil
	}
	if b.f == nil {
		f, err := b.s.tempFile()
		if err == nil {
			if _, err = f.Write(b.buf); err != nil {
				f.Close()
				os.Remove(f.Name())
			}
		}
		if err != nil {
			b.mu.Unlock()
			return fmt.Errorf("stage blob %s: %w", key, err)
		}
		b.f, b.buf = f, nil
	}
	b.entries[k] = e
	b.size += e.size
	f := b.f
	b.mu.Unlock()
	if _, err := f.WriteAt(data, e.off); err != nil {
		b.mu.Lock()
		if b.err == nil {
			b.err = err
		}
		b.mu.Unlock()
		return fmt.Errorf("stage blob %s: %w", key, err)
	}
	return nil
}

// Commit uploads the pack and then its index. Call it once every Stage
// has returned.
func (b *s3Batch) Commit(ctx context.Context) error {
	_, err := b.commit(ctx)
	return err
}

// commit is Commit, returning the pack it made (nil for an empty batch).
func (b *s3Batch) commit(ctx context.Context) (*pack, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.err != nil {
		return nil, fmt.Errorf("commit blobs: a staged write failed: %w", b.err)
	}
	if len(b.entries) == 0 {
		return nil, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	entries, err := sortedEntries(b.entries)
	if err != nil {
		return nil, fmt.Errorf("commit blobs: %w", err)
	}
	var r io.ReaderAt = bytes.NewReader(b.buf)
	if b.f != nil {
		r = b.f
	}
	p, err := b.s.publish(ctx, r, b.size, entries)
	if err != nil {
		return nil, fmt.Errorf("commit blobs: %w", err)
	}
	b.reset()
	return p, nil
}

func (b *s3Batch) Abort() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.reset()
}

// reset forgets what was staged; b.mu is held.
func (b *s3Batch) reset() {
	if b.f != nil {
		b.f.Close()
		os.Remove(b.f.Name())
		b.f = nil
	}
	b.buf, b.size, b.err = nil, 0, nil
	b.entries = map[rawKey]packEntry{}
}

// s3PackFile is a pack file on its way to S3: a local temporary file its
// producer writes, of which Commit uploads the kept stretches only.
type s3PackFile struct {
	s       *S3
	f       *os.File
	mu      sync.Mutex
	entries map[rawKey]packEntry
	end     int64 // past the last byte Append wrote; 0 before the first
	done    bool
}

// NewPackFile creates an empty temporary file (in CacheDir/staging, or
// os.TempDir()) for a producer to write a pack into.
func (s *S3) NewPackFile() (PackFile, error) {
	f, err := s.tempFile()
	if err != nil {
		return nil, fmt.Errorf("new pack file: %w", err)
	}
	return &s3PackFile{s: s, f: f, entries: map[rawKey]packEntry{}}, nil
}

func (p *s3PackFile) File() *os.File { return p.f }

// Keep names [off, off+size) as the blob key; a key kept twice is kept
// where it was first kept.
func (p *s3PackFile) Keep(key string, off, size int64) error {
	k, err := parseKey(key)
	if err != nil {
		return err
	}
	if off < 0 || size < 0 {
		return fmt.Errorf("keep blob %s: bad stretch at %d, %d bytes", key, off, size)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.entries[k]; !ok {
		p.entries[k] = packEntry{key: k, off: off, size: size}
	}
	return nil
}

// Drop does nothing but check: Commit uploads the kept stretches only,
// and the temporary file goes whole.
func (p *s3PackFile) Drop(off, size int64) error {
	if off < 0 || size < 0 {
		return fmt.Errorf("drop: bad stretch at %d, %d bytes", off, size)
	}
	return nil
}

func (p *s3PackFile) Append(key string, data []byte) error {
	k, err := parseKey(key)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.entries[k]; ok {
		return nil
	}
	if p.end == 0 {
		fi, err := p.f.Stat()
		if err != nil {
			return fmt.Errorf("append blob %s: %w", key, err)
		}
		p.end = fi.Size()
	}
	if _, err := p.f.WriteAt(data, p.end); err != nil {
		return fmt.Errorf("append blob %s: %w", key, err)
	}
	p.entries[k] = packEntry{key: k, off: p.end, size: int64(len(data))}
	p.end += int64(len(data))
	return nil
}

// Commit uploads the kept stretches, back to back, as one pack object (in
// parts, Concurrency at once, when larger than the part size), then its
// index, and removes the temporary file.
func (p *s3PackFile) Commit(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return errors.New("commit pack file: already committed or aborted")
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	entries, err := sortedEntries(p.entries)
	if err != nil {
		return fmt.Errorf("commit pack file: %w", err)
	}
	if len(entries) > 0 {
		r := newStretches(p.f, entries)
		if _, err := p.s.publish(ctx, r, r.size, r.packed); err != nil {
			return fmt.Errorf("commit pack file: %w", err)
		}
	}
	p.done = true
	p.f.Close()
	os.Remove(p.f.Name())
	return nil
}

// Abort removes the temporary file; it is a no-op after Commit. (A
// failed Commit has already removed what it uploaded.)
func (p *s3PackFile) Abort() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	p.done = true
	p.f.Close()
	os.Remove(p.f.Name())
}

// stretches reads the kept stretches of a file as one: the pack's bytes.
type stretches struct {
	f      io.ReaderAt
	runs   []stretch
	size   int64
	packed []packEntry // the entries at their offsets in the pack
}

// stretch is a run of adjacent kept bytes: n bytes at src in the file, at
// dst in the pack.
type stretch struct{ src, dst, n int64 }

// newStretches lays entries (in offset order, without overlaps) out back
// to back.
func newStretches(f io.ReaderAt, entries []packEntry) *stretches {
	s := &stretches{f: f}
	for _, e := range entries {
		s.packed = append(s.packed, packEntry{key: e.key, off: s.size, size: e.size})
		if n := len(s.runs); n > 0 && s.runs[n-1].src+s.runs[n-1].n == e.off {
			s.runs[n-1].n += e.size
		} else if e.size > 0 {
			s.runs = append(s.runs, stretch{src: e.off, dst: s.size, n: e.size})
		}
		s.size += e.size
	}
	return s
}

func (s *stretches) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, errors.New("stretches: negative offset")
	}
	i := sort.Search(len(s.runs), func(i int) bool { return s.runs[i].dst+s.runs[i].n > off })
	n := 0
	for n < len(p) && i < len(s.runs) {
		r := s.runs[i]
		in := off - r.dst
		want := min(int64(len(p)-n), r.n-in)
		m, err := s.f.ReadAt(p[n:n+int(want)], r.src+in)
		n += m
		off += int64(m)
		if int64(m) < want {
			if err == nil || errors.Is(err, io.EOF) {
				err = fmt.Errorf("the pack file ends inside a kept blob, at %d: %w", r.src+in+int64(m), io.ErrUnexpectedEOF)
			}
			return n, err
		}
		i++
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}
