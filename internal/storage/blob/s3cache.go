package blob

import (
	"bytes"
	"container/list"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/zeebo/blake3"

	"stasis/internal/flock"
)

// s3Cache is a node's read cache of S3 blobs: one file per blob in
// DIR/blobs, named by its key, at most max bytes of them in all. Blobs are
// put in it after Get verified them, and verified again when read from it
// (a disk may damage what it holds): a file that fails is removed and the
// blob read from S3 again. The least recently used blob goes first when
// there is no room; the order survives a restart through the files'
// mtimes, touched at each hit. Files are written whole (a temporary file
// renamed) but not fsynced: a blob lost in a crash is read again.
type s3Cache struct {
	dir    string // DIR/blobs
	max    int64
	unlock func()

	mu    sync.Mutex
	lru   *list.List // of *cacheItem, most recently used first
	items map[rawKey]*list.Element
	used  int64
}

type cacheItem struct {
	key  rawKey
	size int64
}

const cacheTempPrefix = ".tmp-"

// openS3Cache opens (creating it) the read cache in dir, locked against
// other users, and evicts what is over max.
func openS3Cache(dir string, max int64) (*s3Cache, error) {
	blobs := filepath.Join(dir, "blobs")
	if err := os.MkdirAll(blobs, 0o700); err != nil {
		return nil, fmt.Errorf("read cache %s: %w", dir, err)
	}
	unlock, err := flock.TryLock(filepath.Join(dir, "lock"))
	if errors.Is(err, flock.ErrHeld) {
		return nil, fmt.Errorf("read cache %s: another S3 store uses it (it is locked): give each open store a CacheDir of its own", dir)
	}
	if err != nil {
		return nil, fmt.Errorf("read cache %s: %w", dir, err)
	}
	c := &s3Cache{dir: blobs, max: max, unlock: unlock, lru: list.New(), items: map[rawKey]*list.Element{}}
	ents, err := os.ReadDir(blobs)
	if err != nil {
		unlock()
		return nil, fmt.Errorf("read cache %s: %w", dir, err)
	}
	type found struct {
		key   rawKey
		size  int64
		mtime time.Time
	}
	var all []found
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, cacheTempPrefix) {
			_ = os.Remove(filepath.Join(blobs, name)) // a crash's leftover
			continue
		}
		k, err := parseKey(name)
		if err != nil || !e.Type().IsRegular() {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue
		}
		all = append(all, found{k, fi.Size(), fi.ModTime()})
	}
	// Oldest first, each pushed to the front: the newest ends up first.
	slices.SortFunc(all, func(a, b found) int { return a.mtime.Compare(b.mtime) })
	for _, f := range all {
		c.items[f.key] = c.lru.PushFront(&cacheItem{f.key, f.size})
		c.used += f.size
	}
	c.mu.Lock()
	c.evict(0)
	c.mu.Unlock()
	return c, nil
}

func (c *s3Cache) close() { c.unlock() }

func (c *s3Cache) path(k rawKey) string { return filepath.Join(c.dir, k.String()) }

// get returns k's blob if the cache holds it intact.
func (c *s3Cache) get(k rawKey) ([]byte, bool) {
	c.mu.Lock()
	el, ok := c.items[k]
	if ok {
		c.lru.MoveToFront(el)
	}
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	p := c.path(k)
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false // being written, or evicted meanwhile
	}
	if sum := blake3.Sum256(b); err != nil || !bytes.Equal(sum[:], k[:]) {
		c.mu.Lock()
		if el, ok := c.items[k]; ok {
			c.remove(el)
		}
		c.mu.Unlock()
		return nil, false
	}
	now := time.Now()
	_ = os.Chtimes(p, now, now)
	return b, true
}

// put keeps k's blob, verified by the caller, making room first. A blob
// larger than the whole cache is not kept.
func (c *s3Cache) put(k rawKey, data []byte) {
	size := int64(len(data))
	if size > c.max {
		return
	}
	c.mu.Lock()
	if _, ok := c.items[k]; ok {
		c.mu.Unlock()
		return
	}
	c.evict(size)
	el := c.lru.PushFront(&cacheItem{k, size})
	c.items[k] = el
	c.used += size
	c.mu.Unlock()
	err := c.write(k, data)
	c.mu.Lock()
	defer c.mu.Unlock()
	cur, ok := c.items[k]
	switch {
	case err != nil && ok && cur == el:
		c.remove(el)
	case err == nil && !ok:
		// Evicted while it was written: its file came after its removal.
		_ = os.Remove(c.path(k))
	}
}

func (c *s3Cache) write(k rawKey, data []byte) error {
	f, err := os.CreateTemp(c.dir, cacheTempPrefix+"*")
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), c.path(k))
	}
	if err != nil {
		os.Remove(f.Name())
	}
	return err
}

// evict removes least recently used blobs until room more bytes fit;
// c.mu is held.
func (c *s3Cache) evict(room int64) {
	for c.used+room > c.max {
		el := c.lru.Back()
		if el == nil {
			return
		}
		c.remove(el)
	}
}

// remove forgets one blob and removes its file; c.mu is held.
func (c *s3Cache) remove(el *list.Element) {
	it := el.Value.(*cacheItem)
	c.lru.Remove(el)
	delete(c.items, it.key)
	c.used -= it.size
	_ = os.Remove(c.path(it.key))
}

// usage is the bytes the cache holds, by its count and on disk.
func (c *s3Cache) usage() (counted, onDisk int64) {
	c.mu.Lock()
	counted = c.used
	c.mu.Unlock()
	ents, _ := os.ReadDir(c.dir)
	for _, e := range ents {
		if fi, err := e.Info(); err == nil && !strings.HasPrefix(e.Name(), cacheTempPrefix) {
			onDisk += fi.Size()
		}
	}
	return counted, onDisk
}
