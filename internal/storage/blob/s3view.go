package blob

// An S3 node's view of the store: what a listing of the bucket under the
// prefix finds, and the indexes and dead lists it reads, kept in a
// packSet (the same pack and loc records as a Dir's).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/minio/minio-go/v7"
)

// Object names, under the prefix.
const (
	s3PacksDir = "packs/"
	s3DeadDir  = "dead/"
	s3DeadExt  = ".dead"
)

func packObject(id string) string  { return s3PacksDir + id + packExt }
func indexObject(id string) string { return s3PacksDir + id + idxExt }

// s3Name is what one object name under the prefix is to the store.
type s3Name struct {
	kind byte // 'p' pack, 'i' index, 'd' dead list; 0: not the store's
	id   string
}

// parseS3Name parses an object name (without the prefix) strictly.
func parseS3Name(name string) s3Name {
	if rest, ok := strings.CutPrefix(name, s3PacksDir); ok {
		if id, ok := strings.CutSuffix(rest, packExt); ok && validPackID(id) {
			return s3Name{'p', id}
		}
		if id, ok := strings.CutSuffix(rest, idxExt); ok && validPackID(id) {
			return s3Name{'i', id}
		}
		return s3Name{}
	}
	if rest, ok := strings.CutPrefix(name, s3DeadDir); ok {
		id, r, ok := strings.Cut(rest, "/")
		if r, ok2 := strings.CutSuffix(r, s3DeadExt); ok && ok2 && validPackID(id) && validPackID(r) {
			return s3Name{'d', id}
		}
	}
	return s3Name{}
}

// s3Orphan is an object a listing found of a pack without an index: the
// pack of a commit in progress or cut short, or a dead list of a removal
// in progress or finished. Deletes clear them once an hour old.
type s3Orphan struct {
	name string    // under the prefix
	at   time.Time // its Last-Modified
}

// s3Listing is one listing of the store's objects.
type s3Listing struct {
	idx     map[string]time.Time // pack id: its index's store time
	idxSize map[string]int64
	packs   map[string]time.Time // pack id: its pack's Last-Modified
	dead    map[string][]string  // pack id: its dead lists' names
	deadAt  map[string]time.Time // dead list: its Last-Modified
}

// list lists the store's packs, indexes and dead lists: all of them, or
// with since, only those of packs whose ids say they were begun at since
// or after (newPackID). Nothing else under the prefix is listed (the
// records, which grow with every snapshot ever taken, are not the blob
// store's).
func (s *S3) list(ctx context.Context, since time.Time) (*s3Listing, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	l := &s3Listing{idx: map[string]time.Time{}, idxSize: map[string]int64{}, packs: map[string]time.Time{}, dead: map[string][]string{}, deadAt: map[string]time.Time{}}
	for _, dir := range []string{s3PacksDir, s3DeadDir} {
		opts := minio.ListObjectsOptions{Prefix: s.loc.prefix + dir, Recursive: true}
		if !since.IsZero() {
			opts.StartAfter = opts.Prefix + packIDTime(since)
		}
		for o := range s.client.ListObjects(ctx, s.loc.bucket, opts) {
			if o.Err != nil {
				return nil, fmt.Errorf("list %s: %w", s.loc, o.Err)
			}
			name := strings.TrimPrefix(o.Key, s.loc.prefix)
			switch n := parseS3Name(name); n.kind {
			case 'i':
				l.idx[n.id], l.idxSize[n.id] = roundUpSecond(o.LastModified), o.Size
			case 'p':
				l.packs[n.id] = o.LastModified
			case 'd':
				l.dead[n.id] = append(l.dead[n.id], name)
				l.deadAt[name] = o.LastModified
			}
		}
	}
	return l, nil
}

// A refresh for Has (recent) lists only the packs begun since the last
// listing began, less recentMargin, once this node has listed the whole
// store within fullListingEvery (and the store has a ReuseWithin: Has
// then reports only copies stored within it, and a collection never
// deletes one of those). A pack begun longer before its commit than the
// margin (a long upload, or a writer's clock behind) can be missed until
// the next full listing; Has then reports its blobs missing, and the
// writer stores them again: a copy too many, never one too few. A full
// listing also forgets the packs deleted since the last; Get, Walk and
// deletes always list in full.
const (
	recentMargin     = 2 * time.Minute
	fullListingEvery = 10 * time.Minute
)

// roundUpSecond rounds a time S3 gives to the second up to the next one:
// the object may have been stored up to a second after it says.
func roundUpSecond(t time.Time) time.Time {
	if t.Nanosecond() == 0 {
		return t.Add(time.Second - time.Nanosecond)
	}
	return t
}

// refresh brings the view up to date with a listing begun at or after
// notBefore (by the local clock): it lists unless such a listing has
// already been made, reads the new indexes and dead lists, and forgets
// the packs whose indexes are gone.
func (s *S3) refresh(ctx context.Context, notBefore time.Time) error {
	return s.refreshWith(ctx, notBefore, false)
}

// refreshWith is refresh; with recent, the listing may be of the recent
// packs only (see recentMargin).
func (s *S3) refreshWith(ctx context.Context, notBefore time.Time, recent bool) error {
	s.listMu.Lock()
	defer s.listMu.Unlock()
	last := s.listed
	partial := recent && s.cfg.reuseWithin > 0 && !s.listed.IsZero() && time.Since(s.listed) < fullListingEvery
	if partial {
		last = s.listedRecent
	}
	if !last.IsZero() && !last.Before(notBefore) {
		return nil // a listing begun since the caller asked: coalesced
	}
	start := time.Now()
	var since time.Time
	if partial {
		since = s.listedRecent.Add(-recentMargin)
	}
	l, err := s.list(ctx, since)
	if err != nil {
		return err
	}
	var newIdx, newDead []string
	s.view.mu.RLock()
	for id := range l.idx {
		p := s.view.packs[id]
		if p == nil {
			if !s.view.bad[id] {
				newIdx = append(newIdx, id)
				newDead = append(newDead, l.dead[id]...)
			}
			continue
		}
		for _, d := range l.dead[id] {
			if !p.deadObjs[d] {
				newDead = append(newDead, d)
			}
		}
	}
	s.view.mu.RUnlock()

	var fmu sync.Mutex
	idxs := map[string][]packEntry{}
	bad := map[string]error{}
	deads := map[string][]rawKey{}
	badDead := map[string]error{}
	err = forEach(ctx, len(newIdx)+len(newDead), 8, func(i int) error {
		if i < len(newIdx) {
			id := newIdx[i]
			if l.idxSize[id] > maxIndex {
				fmu.Lock()
				bad[id] = fmt.Errorf("%d bytes, over %d", l.idxSize[id], maxIndex)
				fmu.Unlock()
				return nil
			}
			b, err := s.fetchSmall(ctx, indexObject(id))
			if errors.Is(err, errNoObject) {
				return nil // removed since the listing
			}
			if err != nil {
				return err
			}
			entries, err := decodeIndex(b)
			fmu.Lock()
			defer fmu.Unlock()
			if err != nil {
				bad[id] = err
			} else {
				idxs[id] = entries
			}
			return nil
		}
		name := newDead[i-len(newIdx)]
		b, err := s.fetchSmall(ctx, name)
		if errors.Is(err, errNoObject) {
			return nil
		}
		if err != nil {
			return err
		}
		keys, err := decodeDead(b)
		fmu.Lock()
		defer fmu.Unlock()
		if err != nil {
			badDead[name] = err
		} else {
			deads[name] = keys
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("read the indexes of %s: %w", s.loc, err)
	}

	v := s.view
	v.mu.Lock()
	defer v.mu.Unlock()
	for id, err := range bad {
		// Its blobs read as absent; readers report the chunks they miss.
		slog.Warn("an S3 pack index cannot be read; its blobs are treated as missing", "index", s.loc.object(indexObject(id)), "err", err)
		v.bad[id] = true
	}
	for id, p := range v.packs {
		if _, ok := l.idx[id]; !ok && !partial {
			v.drop(p)
			delete(v.packs, id)
		}
	}
	for id, stored := range l.idx {
		p := v.packs[id]
		fresh := p == nil
		if fresh {
			entries, ok := idxs[id]
			if !ok {
				continue // bad, or removed since the listing
			}
			p = &pack{id: id, entries: entries, dead: map[rawKey]bool{}, deadObjs: map[string]bool{}}
			for _, e := range entries {
				p.bytes += e.size
			}
			v.packs[id] = p
		}
		p.stored = stored
		var added []rawKey
		for _, name := range l.dead[id] {
			if p.deadObjs[name] {
				continue
			}
			if err, ok := badDead[name]; ok {
				slog.Warn("an S3 pack's dead list cannot be read; the blobs it deletes are treated as live", "dead list", s.loc.object(name), "err", err)
				p.deadObjs[name] = true
				continue
			}
			if keys, ok := deads[name]; ok {
				p.deadObjs[name] = true
				added = append(added, keys...)
			}
		}
		if len(added) == 0 && !fresh {
			continue
		}
		if !fresh {
			v.drop(p)
		}
		for _, k := range added {
			p.dead[k] = true
		}
		p.deadB = 0
		for _, e := range p.entries {
			if p.dead[e.key] {
				p.deadB += e.size
			}
		}
		v.add(p)
	}
	s.listedRecent = start
	if partial {
		return nil // the leftovers are what the last full listing saw
	}
	s.orphans = s.orphans[:0]
	for id, at := range l.packs {
		if _, ok := l.idx[id]; !ok {
			s.orphans = append(s.orphans, s3Orphan{packObject(id), at})
		}
	}
	for id, names := range l.dead {
		if _, ok := l.idx[id]; !ok {
			for _, name := range names {
				s.orphans = append(s.orphans, s3Orphan{name, l.deadAt[name]})
			}
		}
	}
	s.listed = start
	return nil
}

// forEach calls fn(0) to fn(n-1), width at once, and returns the first
// error (the others are not started once one failed).
func forEach(ctx context.Context, n, width int, fn func(int) error) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	sem := make(chan struct{}, width)
	for i := 0; i < n; i++ {
		mu.Lock()
		failed := first != nil
		mu.Unlock()
		if failed {
			break
		}
		if err := ctx.Err(); err != nil {
			mu.Lock()
			first = err
			mu.Unlock()
			break
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			if err := fn(i); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return first
}

// errNoObject: the object is not there.
var errNoObject = errors.New("no such object")

func isNoObject(err error) bool {
	code := minio.ToErrorResponse(err).Code
	return code == "NoSuchKey" || code == "NoSuchObject"
}

// fetchSmall reads a whole index or dead list, at most maxIndex bytes.
func (s *S3) fetchSmall(ctx context.Context, name string) ([]byte, error) {
	rc, _, _, err := s.core.GetObject(ctx, s.loc.bucket, s.loc.prefix+name, minio.GetObjectOptions{})
	if isNoObject(err) {
		return nil, fmt.Errorf("%s: %w", s.loc.object(name), errNoObject)
	}
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", s.loc.object(name), err)
	}
	defer rc.Close()
	b, err := io.ReadAll(io.LimitReader(rc, maxIndex+1))
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", s.loc.object(name), err)
	}
	if len(b) > maxIndex {
		return nil, fmt.Errorf("get %s: over %d bytes", s.loc.object(name), maxIndex)
	}
	return b, nil
}
